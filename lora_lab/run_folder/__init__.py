"""The run folder: the one reader and writer of its layout (RunFolder names every part of it).

output/<run-name>/
  config.yaml            the resolved config and where each value came from
  adapter/               final adapter (adapter_config.json, adapter_model.safetensors)
                         plus tokenizer files and chat template
  model/                 (--tuner full, instead of adapter/) the whole model as safetensors,
                         loadable with from_pretrained, plus tokenizer files
  adapter_init/          (lora.init pissa / olora) the adapter before the first step: the
                         final adapter/ is converted against it to apply to the original base
  checkpoint-<step>/     intermediate weights and trainer state (trainer_state.json, for resume),
                         with a manifest.json of sha256 sums written last (training/checkpoint.py)
  logs/                  TensorBoard events, train_log.jsonl (every logged value, one JSON
                         line per log event: the run's own per-step log), data_problems.jsonl,
                         console.log (a run started from `lora-lab ui`: what it printed),
                         stopped.json (a signal stopped the run)
  plots/                 PNG plots of the step log (training/plots.py; `lora-lab report RUN`)
  wandb/, swanlog/,      (--report-to wandb / swanlab / mlflow) those backends' own files
  mlflow.db
  run_summary.json       steps, losses, samples, time, memory
  benchmark_report.json  (`lora-lab eval --tasks`) base and fine-tune scores (use/benchmarks.py)
  merged/, export-*/     (`lora-lab merge`, `export`) the merged model, 4-bit and GGUF copies
  parity_report.json     (`lora-lab check`) each of those copies against the trained model
  launch/                (--gpus N) how the worker processes were launched (run_config.yaml,
                         accelerate.yaml, deepspeed.json; node-R/ with several nodes)
  .lock                  the process writing into the folder (training/lock.py)

With several processes only rank 0 writes here; every rank may read.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import yaml

from ..config import SECTIONS, ModelArgs, RunConfig
from ..errors import CheckpointError, ConfigError, LoraLabError, RunStopped
from ..log import get_logger
from ..paths import safetensors_problem
from . import names

log = get_logger()


@dataclass(frozen=True)
class Checkpoint:
    """checkpoint-<step>/: the weights and trainer state a run resumes from, with its manifest
    (training/checkpoint.py) written last."""

    path: Path

    @property
    def step(self) -> int:
        step = checkpoint_step(self.path)
        if step is None:
            raise ValueError(f"{self.path} is not a checkpoint-<step> folder")
        return step

    manifest = property(lambda self: self.path / names.MANIFEST_FILE, doc="manifest.json: sha256 sums, written last.")
    trainer_state = property(lambda self: self.path / names.TRAINER_STATE_FILE, doc="trainer_state.json.")
    adapter_config = property(lambda self: self.path / names.ADAPTER_CONFIG, doc="adapter_config.json.")

    @property
    def holds_adapter(self) -> bool:
        """A LoRA checkpoint (adapter files), not a --tuner full one (the whole model)."""
        return self.adapter_config.is_file()


@dataclass(frozen=True)
class RunFolder:
    """Every name of a run folder (the layout above); nothing else spells them."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def _at(self, name: str) -> Path:
        return self.path / name

    config = property(lambda self: self._at(names.CONFIG_FILE), doc="config.yaml: the resolved config.")
    adapter = property(lambda self: self._at(names.ADAPTER_FOLDER), doc="adapter/: the final adapter.")
    model = property(lambda self: self._at(names.MODEL_FOLDER), doc="model/: a --tuner full run's model.")
    initial_adapter = property(
        lambda self: self._at(names.INITIAL_ADAPTER_FOLDER), doc="adapter_init/ (pissa, olora)."
    )
    logs = property(lambda self: self._at(names.LOGS_FOLDER), doc="logs/: TensorBoard events and the logs below.")
    step_log = property(lambda self: self._at(names.STEP_LOG), doc="logs/train_log.jsonl: one line per log event.")
    data_problems = property(lambda self: self._at(names.DATA_PROBLEMS), doc="logs/data_problems.jsonl.")
    console_log = property(lambda self: self._at(names.CONSOLE_LOG), doc="logs/console.log (a run started by the UI).")
    serve_log = property(lambda self: self._at(names.SERVE_LOG), doc="logs/serve.log (a server the UI started).")
    stop_record = property(lambda self: self._at(names.STOP_FILE), doc="logs/stopped.json: a signal stopped the run.")
    plots = property(lambda self: self._at(names.PLOTS_FOLDER), doc="plots/: PNG plots of the step log.")
    launch = property(lambda self: self._at(names.LAUNCH_FOLDER), doc="launch/: how the worker processes started.")
    lock = property(lambda self: self._at(names.LOCK_FILE), doc=".lock: the process writing into the folder.")
    summary = property(lambda self: self._at(names.SUMMARY_FILE), doc="run_summary.json: steps, losses, time, memory.")
    benchmark_report = property(
        lambda self: self._at(names.BENCHMARK_REPORT), doc="benchmark_report.json: lm-eval scores, base and fine-tune."
    )
    parity_report = property(lambda self: self._at(names.PARITY_REPORT), doc="parity_report.json: `lora-lab check`.")
    merged = property(lambda self: self._at(names.MERGED_FOLDER), doc="merged/: `lora-lab merge`'s default output.")

    def export(self, name: str) -> Path:
        """export-<name>/: `lora-lab export`'s default output (name: nf4, w4a16, gguf-q8_0 ...)."""
        return self._at(f"{names.EXPORT_PREFIX}{name}")

    def exports(self) -> list[Path]:
        return sorted(p for p in self.path.glob(f"{names.EXPORT_PREFIX}*") if p.is_dir())

    @staticmethod
    def launch_config(folder: Path) -> Path:
        """A node's run_config.yaml in the launch folder (or its node-R/ subfolder)."""
        return Path(folder) / names.LAUNCH_CONFIG

    @staticmethod
    def launch_node(folder: Path, nodes: int, node_rank: int) -> Path:
        """Where one node's launch files go: the launch folder itself on one machine, its
        node-R/ subfolder with several."""
        return Path(folder) if nodes == 1 else Path(folder) / f"{names.NODE_PREFIX}{node_rank}"

    eval_report = property(
        lambda self: self._at(names.EVAL_REPORT), doc="eval_report.json: `lora-lab eval`'s default."
    )

    @property
    def is_run(self) -> bool:
        """A run folder is one with its config.yaml."""
        return self.config.is_file()

    def checkpoint(self, step: int) -> Checkpoint:
        return Checkpoint(self.path / f"{names.CHECKPOINT_PREFIX}{step}")

    def staging_checkpoint(self, step: int) -> Path:
        """Where checkpoint-<step> is written before its rename (hidden: nothing resumes from it)."""
        return self.path / f"{names.STAGING_PREFIX}{names.CHECKPOINT_PREFIX}{step}"

    def hidden_checkpoints(self) -> list[Path]:
        """Staged or replaced checkpoint folders (their names start with a dot)."""
        return [p for p in self.path.glob(f".*{names.CHECKPOINT_PREFIX}*") if p.is_dir()]

    def checkpoints(self) -> list[Checkpoint]:
        """checkpoint-<step> folders, lowest step first."""
        return [Checkpoint(p) for p in list_checkpoints(self.path)]


def is_adapter_folder(path: Path) -> bool:
    return (Path(path) / names.ADAPTER_CONFIG).is_file()


# ----------------------------------------------------------------------------- config.yaml


def save_config(config: RunConfig, path: Path) -> None:
    """Write the resolved config (and where each value came from) as YAML."""
    body = config.to_dict()
    body["resolved_from"] = dict(sorted(config.sources.items()))
    Path(path).write_text(yaml.safe_dump(body, sort_keys=False, allow_unicode=True))


def load_saved_config(path: Path) -> RunConfig:
    """Read back a run's config.yaml (written by save_config)."""
    try:
        body = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise CheckpointError(
            f"{path}: not readable{where}: the run's config.yaml is damaged. "
            f"Restore it from a copy, or pass the adapter folder itself "
            f"(RUN/adapter) where a command takes one."
        ) from None
    if not isinstance(body, dict) or not all(isinstance(body.get(s, {}), dict) for s in SECTIONS):
        raise CheckpointError(
            f"{path}: not a lora-lab run config (expected the sections "
            f"model:, lora:, data:, train:). Restore it from a copy."
        )
    sections = {}
    for section, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        sections[section] = cls(**{k: v for k, v in (body.get(section) or {}).items() if k in known})
    return RunConfig(preset=body.get("preset", "?"), **sections, sources=body.get("resolved_from") or {})


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: Path) -> int | None:
    match = names.CHECKPOINT_NAME.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint-N folders of a run, lowest step first."""
    found = [
        p for p in Path(run_dir).glob(f"{names.CHECKPOINT_PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None
    ]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def run_dir_of(resume: str) -> Path | None:
    """The run folder named by --resume PATH (None for auto)."""
    if resume == "auto":
        return None
    path = Path(resume).expanduser()
    return path.parent if checkpoint_step(path) is not None else path


def trim_step_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint resumed from: they are about to be trained again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except ValueError:
            continue  # a line cut short by the kill
    path.write_text("".join(kept))


def read_step_log(run_dir: Path) -> list[dict]:
    """The step log's events in order (logs/train_log.jsonl); a line cut short by a kill is
    left out. A run without a step log has no events."""
    path = Path(run_dir) / names.STEP_LOG
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def tracker_locations(run_dir: Path) -> dict[str, str]:
    """Where the --report-to backends write inside the run folder, as the environment variables
    each reads: wandb makes its wandb/ folder in WANDB_DIR, swanlab logs to SWANLAB_LOG_DIR,
    mlflow to the SQLite database of MLFLOW_TRACKING_URI."""
    run_dir = Path(run_dir).resolve()
    return {
        "WANDB_DIR": str(run_dir),
        "SWANLAB_LOG_DIR": str(run_dir / names.SWANLAB_FOLDER),
        "MLFLOW_TRACKING_URI": f"sqlite:///{run_dir / names.MLFLOW_DATABASE}",
    }


# ----------------------------------------------------------------------------- adapter/, model/


def full_model_of(path: str | Path) -> Path | None:
    """The from_pretrained folder of a full fine-tuning run (--tuner full), else None."""
    path = Path(path)
    if RunFolder(path).is_run and (path / names.MODEL_FOLDER / names.MODEL_CONFIG).is_file():
        return path / names.MODEL_FOLDER
    return None


def find_adapter(path: str | Path) -> tuple[Path, Path | None]:
    """A run folder or an adapter folder -> (adapter folder, run folder or None)."""
    path = Path(path)
    if full_model_of(path):
        raise CheckpointError(
            f"{path}: a full fine-tuning run (--tuner full) has no adapter; "
            f"its model is {path / 'model'} (pass it as --model, or to "
            f"`lora-lab export`; there is nothing to merge)."
        )
    if is_adapter_folder(path):
        run_dir = path.parent if RunFolder(path.parent).is_run else None
        return check_adapter(path), run_dir
    if RunFolder(path).is_run:
        if is_adapter_folder(path / names.ADAPTER_FOLDER):
            return check_adapter(path / names.ADAPTER_FOLDER), path
        checkpoints = [c for c in list_checkpoints(path) if is_adapter_folder(c)]
        if checkpoints:
            return check_adapter(checkpoints[-1]), path
        raise CheckpointError(
            f"{path}: this run has no adapter yet (no adapter/ or checkpoint-*/ folder). Did the run finish?"
        )
    raise CheckpointError(f"{path}: not a run folder (config.yaml) or an adapter folder (adapter_config.json).")


def check_adapter(folder: Path) -> Path:
    """An adapter folder whose two files are there and whole; else what is wrong with it."""
    config, weights = folder / names.ADAPTER_CONFIG, folder / names.ADAPTER_WEIGHTS
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(
            f"{config} is not valid JSON: the adapter is damaged. Use a "
            f"checkpoint-N/ folder of the run, or train again."
        ) from None
    problem = safetensors_problem(weights) if weights.is_file() else f"{weights} is missing"
    if problem:
        raise CheckpointError(
            f"{problem}: the adapter is damaged. Use a checkpoint-N/ folder of the run, or train again."
        )
    return folder


def base_model_of(adapter_dir: Path, run_dir: Path | None) -> ModelArgs:
    """The base model an adapter was trained on: from the run config, else adapter_config."""
    if run_dir is not None:
        return load_saved_config(run_dir / names.CONFIG_FILE).model
    base = json.loads((adapter_dir / names.ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    return ModelArgs(name=base)


def read_sft_run(path: str | Path) -> tuple[Path, RunConfig]:
    """--from-run: an SFT run folder -> (its final adapter folder, its saved config). Only the
    finished adapter/ is taken: a checkpoint is a run still under way."""
    run_dir = Path(path)
    if not RunFolder(run_dir).is_run:
        raise CheckpointError(
            f"--from-run {path}: not a run folder (no {names.CONFIG_FILE}); pass the folder of a finished `lora-lab run`."
        )
    if full_model_of(run_dir):
        raise CheckpointError(
            f"--from-run {path}: a full fine-tuning run has no adapter to "
            f"continue; pass its model/ as --model instead."
        )
    if not is_adapter_folder(run_dir / names.ADAPTER_FOLDER):
        raise CheckpointError(
            f"--from-run {path}: the run has no {names.ADAPTER_FOLDER}/ yet; let it finish (or resume it) first."
        )
    saved = load_saved_config(run_dir / names.CONFIG_FILE)
    return check_adapter(run_dir / names.ADAPTER_FOLDER), saved


def training_precision(run_dir: Path) -> str | None:
    """The precision a run trained in (bf16, fp16 or fp32), from its config.yaml; None where
    the run recorded only `auto` (runs written before train() settled --dtype auto there)."""
    dtype = load_saved_config(Path(run_dir) / names.CONFIG_FILE).model.dtype
    return None if dtype == "auto" else dtype


def source_adapter(path: Path) -> Path | None:
    """The adapter a merge or export of `path` is made from: a merged folder's recorded one
    (merge_report.json), else the one find_adapter takes for a run or adapter folder; None for a
    full fine-tune, a plain model or a run without an adapter."""
    report = path / names.MERGE_REPORT
    if report.is_file():
        return Path(json.loads(report.read_text())["adapter_dir"])
    if not (is_adapter_folder(path) or RunFolder(path).is_run) or full_model_of(path):
        return None
    try:
        return find_adapter(path)[0]
    except CheckpointError:
        return None


def owning_run_dir(path: Path) -> Path | None:
    """The run folder whose config.yaml (training data) belongs to `path`, if there is one."""
    for candidate in (path, path.parent):
        if RunFolder(candidate).is_run:
            return candidate
    report = path / names.MERGE_REPORT
    if report.is_file():
        adapter = Path(json.loads(report.read_text())["adapter_dir"])
        if RunFolder(adapter.parent).is_run:
            return adapter.parent
    return None


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path | None
    """adapter/ of a LoRA run (None for --tuner full)."""
    global_step: int
    train_loss: float
    eval_loss: float | None
    train_samples: int
    trained_tokens: int
    seconds: float
    nonfinite_skipped_steps: list
    model_dir: Path | None = None
    """model/ of a --tuner full run: loadable with from_pretrained."""
    benchmark: dict | None = None  # train.eval_tasks: the base's and the fine-tune's scores


# ----------------------------------------------------------------------------- the run


def default_run_name(config: RunConfig) -> str:
    """<model>-<preset>-<date-time>: the model's folder or file name, without .gguf and without
    the cache key a converted GGUF's folder carries."""
    model = Path(config.model.name.rstrip("/")).name.lower().replace(".gguf", "")
    model = re.sub(r"-[0-9a-f]{16}$", "", model)
    return f"{model}-{config.preset}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def locate_run_dir(config: RunConfig) -> Path:
    """The run folder: --resume PATH names it; otherwise --output-dir / --run-name (a new name
    from the model, preset and time when there is none). The config is not changed: the caller
    records the folder with fix_run_dir."""
    resume = config.train.resume
    named = run_dir_of(resume) if resume else None
    if named is not None:
        return named
    if resume == "auto" and not config.train.run_name:
        raise ConfigError(
            [
                "--resume auto: also pass --run-name (and --output-dir) to say which "
                "run to continue, or pass the run folder: --resume output/NAME."
            ]
        )
    return Path(config.train.output_dir) / (config.train.run_name or default_run_name(config))


def fix_run_dir(config: RunConfig, run_dir: Path) -> RunConfig:
    """The config with the run folder recorded, so that every process and config.yaml name it."""
    values = {"train.output_dir": str(run_dir.parent), "train.run_name": run_dir.name}
    return config.with_changes(values, {k: config.sources.get(k, "default") for k in values})


def holds_run(run_dir: Path) -> bool:
    return (
        (run_dir / names.ADAPTER_FOLDER).exists()
        or (run_dir / names.MODEL_FOLDER).exists()
        or any(run_dir.glob(f"{names.CHECKPOINT_PREFIX}*"))
    )


def check_run_dir(run_dir: Path, config: RunConfig, resume_from: Path | None) -> None:
    """A run folder is reused only to resume; a finished run is never started over."""
    if resume_from is not None or not holds_run(run_dir):
        return
    if config.train.resume and (run_dir / names.ADAPTER_FOLDER).exists():
        raise CheckpointError(
            f"--resume {config.train.resume}: {run_dir} holds a finished run "
            f"(adapter/) but no complete checkpoint of it; refusing to start "
            f"over in it. Pick another --run-name."
        )
    if config.train.resume:
        return  # only incomplete checkpoints: a fresh start replaces them step by step
    raise LoraLabError(
        f"--run-name {run_dir.name}: {run_dir} already holds a run. Pass --resume "
        f"auto to continue it, pick another --run-name or --output-dir, or delete "
        f"that folder."
    )


def write_data_problems(run_dir: Path, data) -> None:
    """Every row not used (error), truncated or read with a remark (warning), one JSON line each."""
    truncated = data.train.truncated + (data.val.truncated if data.val else [])
    with open(run_dir / names.DATA_PROBLEMS, "w") as handle:
        for severity, problems in (("error", data.all_problems()), ("warning", data.all_warnings())):
            for problem in problems:
                handle.write(
                    json.dumps(
                        {"origin": problem.origin, "severity": severity, "reason": problem.reason}, ensure_ascii=False
                    )
                    + "\n"
                )
        for origin in truncated:
            handle.write(
                json.dumps({"origin": origin, "severity": "warning", "reason": "truncated to max_length"}) + "\n"
            )


def write_summary(result: TrainResult, timer, peaks: list, memory_means: str = "none") -> None:
    """run_summary.json; with several processes each memory figure is the largest of them, and
    the figure of every process is kept under <name>_per_gpu (rank order)."""
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    summary["memory_means"] = memory_means
    performance = summary["performance"] = timer.summary()
    for key in peaks[0]:
        values = [p.get(key) for p in peaks]
        known = [v for v in values if v is not None]
        performance[key] = max(known) if known else None
        if len(peaks) > 1:
            performance[f"{key}_per_gpu"] = values
    (result.run_dir / names.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def read_result(run_dir: Path) -> TrainResult:
    """A finished run's TrainResult, from its run_summary.json."""
    summary = json.loads((run_dir / names.SUMMARY_FILE).read_text())
    fields = TrainResult.__dataclass_fields__
    values = {k: v for k, v in summary.items() if k in fields}
    for key in ("run_dir", "adapter_dir", "model_dir"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    return TrainResult(**values)


# ----------------------------------------------------------------------------- a signal stop


def record_stop(run_dir: Path, signum: int, step: int) -> RunStopped:
    """Note in logs/stopped.json that a signal stopped the run after `step` (for the launcher
    of several processes, which reads it back); returns the error that says how to continue."""
    (Path(run_dir) / names.STOP_FILE).write_text(json.dumps({"signal": signum, "step": step}))
    return stop_error(run_dir, signum, step)


def recorded_stop(run_dir: Path) -> RunStopped | None:
    """The stop record_stop wrote, as its error; None when the run was not stopped."""
    path = Path(run_dir) / names.STOP_FILE
    if not path.is_file():
        return None
    stop = json.loads(path.read_text())
    return stop_error(run_dir, stop["signal"], stop["step"])


def stop_error(run_dir: Path, signum: int, step: int) -> RunStopped:
    run_dir = Path(run_dir)
    return RunStopped(
        f"stopped by {signal.Signals(signum).name} after step {step}: "
        f"{RunFolder(run_dir).checkpoint(step).path} is complete. The same command with "
        f"--resume auto --run-name {run_dir.name} continues the run.",
        128 + signum,
    )
