"""Resolution: defaults -> preset -> --config YAML -> flags and --set, every value remembering
where it came from, every problem collected and reported at once."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from ..errors import ConfigError, ModelError
from ..paths import identity_datasets, presets_dir
from ..registry import model_config_of, resolve_model_spec, size_class
from .fields import (
    FLAG_FOR_KEY,
    FULL_FINETUNING_LR,
    LORA_INITS,
    REPORT_BACKENDS,
    SECTIONS,
    ModelArgs,
    RunConfig,
    all_keys,
    converts_initial_adapter,
    main_host_port,
    trains_adapter,
    world_size_of,
)

# ----------------------------------------------------------------------------- presets


def list_presets() -> list[dict]:
    """Each preset's name, file and one-line description."""
    out = []
    for path in sorted(presets_dir().glob("*.yaml"), key=_card_order):
        data = yaml.safe_load(path.read_text()) or {}
        out.append({"name": path.stem, "path": path, "description": data.get("description", "")})
    return out


def _card_order(path: Path) -> tuple:
    """cpu first, then the tiers by card size (8gb before 12gb), then any other preset."""
    digits = path.stem.removesuffix("gb")
    return (0, 0, "") if path.stem == "cpu" else (1, int(digits), "") if digits.isdigit() else (2, 0, path.stem)


def load_preset(name: str) -> tuple[dict, Path]:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        names = [p["name"] for p in list_presets()]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean --preset {close[0]}?" if close else ""
        raise ConfigError(
            [f"--preset {name}: no such preset.{hint} Available: {', '.join(names)} (see `lora-lab presets`)."]
        )
    return _read_yaml(path, f"preset {name}"), path


def _read_yaml(path: Path, what: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"--config {path}: file not found."]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError([f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})."]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                f"{path}: {what} must be a mapping of sections "
                f"(model:, lora:, data:, train:), got {type(data).__name__}."
            ]
        )
    return data


# ----------------------------------------------------------------------------- resolution


class _Layer:
    """One source of values: a label for errors ("--lora-rank", "my.yaml: lora.rank")."""

    def __init__(self, values: dict, source: str, label, recorded: dict | None = None):
        self.values, self.source, self.label = values, source, label
        self.recorded = recorded or {}
        """key -> source recorded in a saved config.yaml given as --config (kept as it was)."""


def resolve_config(
    preset: str | None = "cpu",
    config_file: str | None = None,
    flags: dict | None = None,
    sets: list[str] | tuple = (),
    need_data: bool = True,
    training: bool = True,
) -> RunConfig:
    """Build the RunConfig: defaults -> preset YAML -> --config YAML -> flags and --set.

    `flags` maps config keys ("lora.rank") to values given by named flags; `sets` holds raw
    "key=value" strings from --set. All problems are collected and raised as one ConfigError.
    preset None: the defaults alone (the data commands, which need no hardware tier).
    need_data False: a config without training data is valid (the memory planner's).
    training False: the data commands that only count, check or show rows; the bundled identity
    set is valid there without --model-name / --model-author (data.with_identity_stand_ins).
    """
    problems: list[str] = []
    layers: list[_Layer] = []
    preset_sizes, preset_path = {}, None
    if preset is not None:
        preset_data, preset_path = load_preset(preset)
        preset_sizes = preset_data.pop("sizes", None) or {}
        preset_data.pop("description", None)
        layers.append(_yaml_layer(preset_data, f"preset {preset}", preset_path.name, problems))
    if config_file:
        user = _read_yaml(Path(config_file), "--config")
        user.pop("description", None)
        user.pop("preset", None)  # a run's saved config.yaml: its values already hold the preset's
        recorded = user.pop("resolved_from", None) or {}
        layer = _yaml_layer(user, f"config {config_file}", config_file, problems)
        layer.recorded = recorded if isinstance(recorded, dict) else {}
        layers.append(layer)
    flag_layer = {k: v for k, v in (flags or {}).items() if v is not None}
    layers.append(_Layer(flag_layer, "flag", lambda key, v: f"{FLAG_FOR_KEY.get(key, key)} {_show(v)}"))
    layers.append(_set_layer(sets, problems))

    model_spec = next(
        (layer.values["model.name"] for layer in reversed(layers) if "model.name" in layer.values), ModelArgs().name
    )
    size, why = size_class(model_spec)
    if size and size in preset_sizes:
        shown = f"sizes.{size}" + (f", {why}" if why else "")
        layers.insert(
            1, _yaml_layer(preset_sizes[size], f"preset {preset} ({shown})", f"{preset_path.name} {shown}", problems)
        )

    config = RunConfig(preset=preset or "none")
    labels = {}
    for layer in layers:
        for key, raw in layer.values.items():
            value, problem = _coerce(key, raw)
            label = layer.label(key, raw)
            if problem:
                problems.append(f"{label}: {problem}")
                continue
            section, name = key.split(".")
            setattr(getattr(config, section), name, value)
            source = layer.source if layer.source != "flag" else label.split()[0]
            if layer.recorded and key not in layer.recorded:
                config.sources.pop(key, None)  # a saved config.yaml: a default in that run
            else:
                config.sources[key] = layer.recorded.get(key, source)
            labels[key] = label
    _tuner_defaults(config)
    if config.train.engine == "auto" and world_size_of(config.train) == 1:
        config.train.engine = "ddp"  # several GPUs: planning.choice.pick_engine, at launch
        config.sources["train.engine"] = "auto (one GPU)"
    for key, problem in _validate(config, need_data, training):
        problems.append(f"{labels.get(key, FLAG_FOR_KEY.get(key, key))}: {problem}")
    try:
        resolve_model_spec(config.model.name)
    except ModelError as exc:
        problems.append(
            str(exc)
            if "model.name" not in labels or labels["model.name"].startswith("--model")
            else f"{labels['model.name']}: {exc}"
        )
    if problems:
        raise ConfigError(problems)
    return config


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _yaml_layer(tree: dict, source: str, where: str, problems: list) -> _Layer:
    values = {}
    for section, body in tree.items():
        if section not in SECTIONS:
            problems.append(f"{where}: unknown section `{section}`; expected one of {', '.join(SECTIONS)}.")
            continue
        if not isinstance(body, dict):
            problems.append(f"{where}: section `{section}` must be a mapping.")
            continue
        for name, value in body.items():
            key = f"{section}.{name}"
            if _check_key(key, f"{where}: {key}", problems):
                values[key] = value
    return _Layer(values, source, lambda key, v: f"{where}: {key}")


def _set_layer(sets, problems: list) -> _Layer:
    values = {}
    for item in sets:
        if "=" not in item:
            problems.append(f"--set {item}: expected key=value, e.g. --set lora.rank=16.")
            continue
        key, text = item.split("=", 1)
        key = key.strip()
        if _check_key(key, f"--set {item}", problems):
            values[key] = yaml.safe_load(text) if text.strip() else None
    return _Layer(values, "--set", lambda key, v: f"--set {key}={v}")


def _check_key(key: str, label: str, problems: list) -> bool:
    if key in all_keys():
        return True
    close = difflib.get_close_matches(key, all_keys(), n=1)
    hint = f" Did you mean `{close[0]}`?" if close else " Keys are listed by `lora-lab run --help`."
    problems.append(f"{label}: unknown key `{key}`.{hint}")
    return False


COMMA_LISTS = ("train.report_to",)
"""List keys whose items may also come as one comma-separated value."""

AUTO_OR_BOOL = (
    "embedding_on_cpu",
    "offload_checkpoints",
    "sync_each_micro_batch",
    "fast_lora",
    "cudnn_attention",
    "enable_thinking",
)


def _coerce(key: str, value) -> tuple[Any, str | None]:
    """Convert a value to the field's type; returns (value, problem)."""
    section, name = key.split(".")
    kind = get_type_hints(SECTIONS[section])[name]
    if value is None:
        return None, None
    or_auto = kind == int | str  # auto, or a number
    if or_auto:
        if str(value).strip().lower() == "auto":
            return "auto", None
        kind = int
    if kind == str | bool:  # auto, or a forced true / false
        if str(value).strip().lower() == "auto":
            return "auto", None
        kind = bool
    if kind is bool:
        if isinstance(value, bool):
            return value, None
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True, None
        if text in ("false", "no", "off", "0"):
            return False, None
        return (None, f"expected true or false{' (or auto)' if name in AUTO_OR_BOOL else ''}, got {value!r}.")
    if kind is int:
        try:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value)), None
        except (TypeError, ValueError):
            return None, f"expected a whole number{' (or auto)' if or_auto else ''}, got {value!r}."
    if kind is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            return None, f"expected a number, got {value!r}."
        if not math.isfinite(number):
            return None, f"expected a finite number, got {value!r}."
        return number, None
    if kind is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        if key in COMMA_LISTS:  # --report-to wandb,mlflow
            return [part.strip() for v in items for part in str(v).split(",") if part.strip()], None
        return [str(v) for v in items], None
    return str(value), None


def _tuner_defaults(config: RunConfig) -> None:
    """--tuner full: a learning rate the user did not give becomes FULL_FINETUNING_LR (the
    defaults and presets hold LoRA learning rates). A preference --task turns a preset's
    packing off."""
    source = config.sources.get("train.lr", "default")
    if config.train.tuner == "full" and (source == "default" or source.startswith("preset")):
        config.train.lr = FULL_FINETUNING_LR
        config.sources["train.lr"] = "--tuner full default"
    packing = config.sources.get("data.packing", "default")
    if config.train.task != "sft" and config.data.packing and packing.startswith("preset"):
        # a preset packs supervised rows; a preference task reads prompt + answer sequences
        config.data.packing = False
        config.sources["data.packing"] = f"--task {config.train.task} (no packing)"


def tuner_problems(config: RunConfig) -> list[tuple[str, str]]:
    """The tuner options that do not go together, each with its fix."""
    lora, train, tuner = config.lora, config.train, config.train.tuner
    problems = []
    if lora.init not in LORA_INITS and not re.fullmatch(r"pissa_niter_[1-9][0-9]*", lora.init):
        problems.append(
            (
                "lora.init",
                f"must be one of {', '.join(LORA_INITS)} or "
                f"pissa_niter_N (N iterations of randomised SVD, e.g. "
                f"pissa_niter_4); got {lora.init!r}.",
            )
        )
    if tuner == "ia3" and config.model.quantization != "none":
        problems.append(
            (
                "train.tuner",
                "IA3 trains on a 16-bit base only (it trains about "
                "0.02% of the weights: the base is the memory). "
                "Drop --quantization nf4, or use --tuner lora "
                "--quantization nf4 (QLoRA).",
            )
        )
    if tuner == "ia3" and lora.trainable_tokens is True:
        problems.append(
            (
                "lora.trainable_tokens",
                "true trains token rows beside a LoRA or "
                "DoRA adapter; peft's IA3 has none. Use "
                "--tuner lora, or lora.trainable_tokens "
                "auto.",
            )
        )
    if tuner in ("dora", "ia3") and config.model.fast_lora is True:
        problems.append(
            (
                "model.fast_lora",
                f"true computes plain LoRA layers; --tuner {tuner} "
                f"needs peft's forward. Use --set "
                f"model.fast_lora=auto (or false).",
            )
        )
    for key, on in (
        ("lora.use_rslora", lora.use_rslora),
        ("lora.init", lora.init != "default"),
        ("train.loraplus_lr_ratio", train.loraplus_lr_ratio > 0),
    ):
        if on and tuner in ("ia3", "full"):
            problems.append(
                (
                    key,
                    f"applies to --tuner lora and dora (LoRA's A and B "
                    f"matrices); --tuner {tuner} has none. Drop it, or use "
                    f"--tuner lora.",
                )
            )
    if converts_initial_adapter(lora) and tuner in ("lora", "dora"):
        if tuner == "dora":
            problems.append(
                (
                    "lora.init",
                    f"{lora.init} starts plain LoRA from the base "
                    f"weight's decomposition; peft converts no DoRA "
                    f"adapter back to the original base. Use --tuner lora, "
                    f"or lora.init default or gaussian with dora.",
                )
            )
        if config.model.quantization != "none":
            problems.append(
                (
                    "lora.init",
                    f"{lora.init} rewrites the base weights as the "
                    f"residual of their decomposition, which 4-bit "
                    f"weights cannot hold exactly. Drop --quantization "
                    f"nf4, or use lora.init default (QLoRA).",
                )
            )
        if train.engine.startswith("deepspeed-zero3"):
            problems.append(
                (
                    "lora.init",
                    f"{lora.init} decomposes each whole base weight when "
                    f"the adapter is made; {train.engine} has split them "
                    f"over the GPUs by then. Use --engine "
                    f"deepspeed-zero2, fsdp or ddp.",
                )
            )
    return problems


def identity_problem(specs: list, model_name: str | None, model_author: str | None) -> str | None:
    """Why `specs` cannot be trained on as given: a bundled identity set (self-cognition) with
    --model-name or --model-author missing. Said before anything is loaded or printed."""
    missing = [flag for flag, value in (("--model-name", model_name), ("--model-author", model_author)) if not value]
    if not identity_datasets(specs) or not missing:
        return None
    return (
        f"the bundled self-cognition rows say {{{{NAME}}}} and {{{{AUTHOR}}}} where the "
        f"model's new name and its author go; pass --model-name and --model-author, e.g. "
        f"--model-name Aurora --model-author 'Lab X' ({' and '.join(missing)} not given)."
    )


def _validate(config: RunConfig, need_data: bool = True, training: bool = True) -> list[tuple[str, str]]:
    problems = []
    identity = identity_problem(
        config.data.datasets + config.data.val_data, config.data.model_name, config.data.model_author
    )
    if training and identity:
        problems.append(("data.datasets", identity))
    for section, cls in SECTIONS.items():
        for spec in dataclasses.fields(cls):
            key, value = f"{section}.{spec.name}", getattr(getattr(config, section), spec.name)
            choices, minimum = spec.metadata["choices"], spec.metadata["minimum"]
            if choices and value not in choices:
                problems.append((key, f"must be one of {', '.join(choices)}; got {value!r}."))
            if minimum is not None and isinstance(value, (int, float)) and value < minimum:
                problems.append((key, f"must be at least {minimum}; got {value!r}."))
            maximum = spec.metadata["maximum"]
            if maximum is not None and value is not None and value > maximum:
                problems.append((key, f"must be at most {maximum:,}; got {value:,}."))
    if not 0 <= config.lora.dropout < 1:
        problems.append(
            (
                "lora.dropout",
                f"must be at least 0 and below 1 (a share of the LoRA input zeroed); got {config.lora.dropout}.",
            )
        )
    name = config.train.run_name
    if name is not None and (name in ("", ".", "..") or "/" in name or "\\" in name):
        problems.append(("train.run_name", f"must be one folder name inside --output-dir (no / or ..); got {name!r}."))
    if config.data.val_ratio >= 1:
        problems.append(("data.val_ratio", f"must be below 1; got {config.data.val_ratio}."))
    if config.data.val_ratio and config.data.val_data:
        problems.append(("data.val_ratio", "give either --val-ratio or --val-data, not both."))
    if need_data and not config.data.datasets:
        problems.append(
            ("data.datasets", "no training data. Pass --data FILE (or --data self-cognition for the bundled set).")
        )
    if config.train.tuner == "full" and config.model.quantization != "none":
        problems.append(
            (
                "train.tuner",
                "full fine-tuning trains 16-bit weights; 4-bit weights "
                "cannot be trained. Drop --quantization nf4 (QLoRA is "
                "--tuner lora --quantization nf4).",
            )
        )
    if config.train.tuner == "full" and config.model.dtype == "fp16":
        problems.append(
            (
                "train.tuner",
                "full fine-tuning in fp16 is refused: Qwen2.5's "
                "activations overflow fp16 and whole-model updates "
                "diverge. Use --dtype bf16 (a GPU with bf16) or fp32.",
            )
        )
    problems += tuner_problems(config)
    single = world_size_of(config.train) == 1 and config.train.engine == "ddp" and trains_adapter(config.train)
    for key, value in (
        ("model.embedding_on_cpu", config.model.embedding_on_cpu),
        ("train.offload_checkpoints", config.train.offload_checkpoints),
    ):
        if value is True and not (single and config.train.gradient_checkpointing):
            problems.append(
                (
                    key,
                    "true serves LoRA in one process with gradient checkpointing "
                    "(DDP and DeepSpeed do not see its recomputed gradients). "
                    "Use auto or false here.",
                )
            )
    kept = config.train.uncheckpointed_layers
    if kept not in (0, "auto") and not (single and config.train.gradient_checkpointing):
        problems.append(
            (
                "train.uncheckpointed_layers",
                "serves LoRA in one process with gradient checkpointing on. Set it to 0 here.",
            )
        )
    layers = (model_config_of(config.model.name) or {}).get("num_hidden_layers")
    if isinstance(kept, int) and layers and kept > layers:
        problems.append(
            ("train.uncheckpointed_layers", f"the model has {layers} decoder layers: use at most {layers}, or auto.")
        )
    if config.train.max_steps == 0 or config.train.max_steps < -1:
        problems.append(("train.max_steps", "must be -1 (use epochs) or at least 1."))
    problem = report_to_problem(config.train.report_to, check_installed=training)
    if problem:
        problems.append(("train.report_to", problem))
    problems += _task_problems(config.train, config.data)
    problems += _node_problems(config.train, launching=need_data and training)
    return problems


def _node_problems(train, launching: bool = True) -> list[tuple[str, str]]:
    """--nodes N: a node rank among them; to launch, node 0's address and one run folder name
    for all (a plan needs neither)."""
    if train.node_rank >= train.nodes:
        ranks = {1: "0", 2: "0 and 1"}.get(train.nodes, f"0 to {train.nodes - 1}")
        return [
            (
                "train.node_rank",
                f"out of range: with --nodes {train.nodes} the node ranks are {ranks}; got {train.node_rank}.",
            )
        ]
    if train.nodes == 1:
        return []
    problems = []
    if not train.main_address:
        if launching:
            problems.append(
                (
                    "train.main_address",
                    f"--nodes {train.nodes} needs node 0's "
                    f"address: --main-address HOST[:PORT], the "
                    f"same on every node.",
                )
            )
    elif (
        not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+)(:\d{1,5})?", train.main_address)
        or not 0 < main_host_port(train)[1] < 65536
    ):
        problems.append(
            (
                "train.main_address",
                f"expected HOST or HOST:PORT (e.g. 10.0.0.1:29500 or node01); got {train.main_address!r}.",
            )
        )
    if not train.run_name and not train.resume and launching:
        problems.append(
            (
                "train.run_name",
                f"--nodes {train.nodes}: pass --run-name NAME, the "
                f"same on every node, so that all of them train into "
                f"one run folder.",
            )
        )
    return problems


def _task_problems(train, data) -> list[tuple[str, str]]:
    """Preference tasks train a LoRA adapter on unpacked pairs; --from-run is theirs alone."""
    if train.task == "sft":
        return (
            [
                (
                    "train.from_run",
                    "continues an SFT run with a preference task; pass --task dpo (or orpo, simpo, kto) with it.",
                )
            ]
            if train.from_run
            else []
        )
    problems = []
    if train.tuner != "lora":
        problems.append(("train.task", f"{train.task} trains a LoRA adapter; drop --tuner {train.tuner}."))
    if data.packing:
        problems.append(
            (
                "data.packing",
                f"--task {train.task} trains on prompt + answer sequences, not packed rows; drop data.packing.",
            )
        )
    if train.gpus > 1:
        problems.append(("train.gpus", f"--task {train.task} trains in one process; use --gpus 1."))
    if train.task == "kto" and train.micro_batch_size < 2:
        problems.append(
            (
                "train.micro_batch_size",
                "--task kto estimates its KL term from the "
                "other answers of a micro-batch; use "
                "--micro-batch-size 2 or more.",
            )
        )
    return problems


def report_to_problem(names: list, check_installed: bool = True) -> str | None:
    """Why train.report_to cannot be used: an unknown name, none mixed with a backend, or a
    backend whose package is not installed (said before anything is loaded)."""
    valid = ", ".join([*REPORT_BACKENDS, "none"])
    unknown = [n for n in names if n not in REPORT_BACKENDS and n != "none"]
    if unknown:
        return f"unknown backend {', '.join(map(repr, unknown))}; the valid ones are {valid}."
    if "none" in names and len(names) > 1:
        return f"none turns every backend off; give it alone or not at all (got {','.join(names)})."
    missing = (
        [REPORT_BACKENDS[n] for n in names if n != "none" and importlib.util.find_spec(REPORT_BACKENDS[n]) is None]
        if check_installed
        else []
    )
    if missing:
        return (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed. "
            f"Run: pip install {' '.join(missing)} (or pip install 'lora-lab[trackers]' "
            f"for every backend), or leave {' and '.join(missing)} out of --report-to."
        )
    return None
