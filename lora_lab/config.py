"""Run configuration: one dataclass per concern, resolved defaults -> preset -> --config -> flags.

Every value remembers where it came from, so that the resolved config can be printed ("lora.rank
= 8  (preset 16gb)") and every problem can name the key the way the user typed it.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from .errors import ConfigError, ModelError
from .paths import presets_dir
from .registry import guess_model_size, resolve_model_spec


# ----------------------------------------------------------------------------- the dataclasses

ENGINES = ("ddp", "deepspeed-zero2", "deepspeed-zero2-offload", "deepspeed-zero3",
           "deepspeed-zero3-offload", "fsdp")
"""train.engine values; each but ddp has its config file in presets/engines/."""
DEEPSPEED_ENGINES = ("deepspeed-zero2", "deepspeed-zero2-offload", "deepspeed-zero3",
                     "deepspeed-zero3-offload")


def engine_template(engine: str) -> Path:
    """presets/engines/<engine>.json (DeepSpeed) or .yaml (accelerate: ddp, fsdp)."""
    suffix = ".json" if engine in DEEPSPEED_ENGINES else ".yaml"
    return presets_dir() / "engines" / f"{engine}{suffix}"


def _f(default, help: str, choices: tuple | None = None, minimum: float | None = None):
    """A config field with its help text (shown by `lora-lab run --help` and in errors)."""
    kwargs = {"default_factory": lambda: list(default)} if isinstance(default, list) else {
        "default": default}
    return field(metadata={"help": help, "choices": choices, "minimum": minimum}, **kwargs)


@dataclass
class ModelArgs:
    name: str = _f("qwen2.5-0.5b", "Hub id, alias (qwen2.5-7b, qwen2.5-7b-base), folder or .gguf.")
    dtype: str = _f("auto", "auto: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU.",
                    choices=("auto", "bf16", "fp16", "fp32"))
    quantization: str = _f("none", "none, or nf4 for 4-bit QLoRA (bitsandbytes).",
                           choices=("none", "nf4"))
    trust_remote_code: bool = _f(False, "Run Python code shipped with the model. Off by default.")
    attn_implementation: str = _f("sdpa", "Attention kernel: sdpa, eager or flash_attention_2.",
                                  choices=("sdpa", "eager", "flash_attention_2"))
    kernels: str = _f("auto", "Fused Triton kernels: liger (fused linear cross-entropy, RoPE, "
                              "RMSNorm, SwiGLU; needs a CUDA GPU and liger-kernel), none, or auto "
                              "(liger when both are there).", choices=("auto", "liger", "none"))
    embedding_on_cpu: str | bool = _f(
        "auto", "Keep the input embedding table in CPU memory (1.02 GiB of Qwen2.5-7B). auto: on "
                "for LoRA on one GPU when the model has its own output head (7B); never for tied "
                "embeddings (0.5B-3B). true / false force it.", choices=("auto", True, False))
    cudnn_attention: bool = _f(
        False, "Let torch's scaled_dot_product_attention use its cuDNN backend where it picks it. "
               "Off by default: cuDNN builds a plan for every new sequence length, and packed rows "
               "of short samples bring a new length at almost every step (docs/benchmarks.md "
               "has the measurement); flash and memory-efficient kernels stay on.")


@dataclass
class LoraArgs:
    rank: int = _f(8, "LoRA rank r.", minimum=1)
    alpha: float = _f(32, "LoRA alpha (scale = alpha / rank).", minimum=0)
    dropout: float = _f(0.05, "Dropout on the LoRA input.", minimum=0)
    target_modules: list = _f(["all-linear"], "Modules to adapt; all-linear = every linear layer "
                                              "except lm_head.")


@dataclass
class DataArgs:
    datasets: list = _f([], "Training data: files (.jsonl .json .csv .parquet), hub dataset ids "
                            "or 'self-cognition'; PATH#N samples N rows.")
    val_data: list = _f([], "Validation data (same forms as --data).")
    val_ratio: float = _f(0.0, "Fraction of the training rows held out for validation.",
                          minimum=0)
    format: str = _f("auto", "Row format; auto detects it per dataset.",
                     choices=("auto", "messages", "sharegpt", "swift-sharegpt", "alpaca",
                              "query-response", "text"))
    max_length: int = _f(2048, "Longest encoded sample in tokens.", minimum=8)
    packing: bool = _f(False, "Pack the samples of each optimizer step into as few rows as "
                              "pack_length allows (no padding; each sample keeps its own "
                              "positions and attends only to itself). Same samples per step.")
    packed_attention: str = _f("auto", "How a packed row's samples are kept apart: mask (one "
                                       "sdpa call with a block-diagonal mask), segments (one "
                                       "causal sdpa call per sample), varlen (one "
                                       "flash-attention call over the row from the samples' "
                                       "lengths; CUDA, PyTorch >= 2.10) or auto: varlen where "
                                       "it runs, else mask (docs/training.md, Packing).",
                               choices=("auto", "mask", "segments", "varlen"))
    pack_length: int = _f(0, "Tokens per packed row; 0 = max_length x micro_batch_size (the "
                             "same tokens per pass as without packing).", minimum=0)
    truncation: str = _f("truncate", "Samples over max_length: truncate (cut the end) or drop.",
                         choices=("truncate", "drop"))
    system: str = _f(None, "System prompt for conversations that have none "
                           "(default: the chat template's own).")
    model_name: str = _f(None, "Fills {{NAME}} (or {{name}}) placeholders in the data.")
    model_author: str = _f(None, "Fills {{AUTHOR}} (or {{author}}) placeholders in the data.")


FULL_FINETUNING_LR = 1e-5
"""train.lr for --tuner full unless given: LoRA learning rates would wreck the base weights."""


@dataclass
class TrainArgs:
    tuner: str = _f("lora", "What trains: lora (adapters on a frozen base; QLoRA is lora with "
                            "--quantization nf4) or full (every weight: bf16 mixed precision "
                            "with fp32 master weights, lr 1e-5 unless given, no fp16; the "
                            "run folder gets a from_pretrained-loadable model/ instead of "
                            "adapter/).", choices=("lora", "full"))
    output_dir: str = _f("output", "Run folders are created under this folder.")
    run_name: str = _f(None, "Run folder name (default: <model>-<preset>-<date-time>).")
    micro_batch_size: int = _f(1, "Samples per forward pass.", minimum=1)
    grad_accum: int = _f(16, "Micro-batches per optimizer step.", minimum=1)
    lr: float = _f(1e-4, "Peak learning rate.", minimum=0)
    epochs: float = _f(1.0, "Passes over the training data (ignored when max_steps > 0).",
                       minimum=0)
    max_steps: int = _f(-1, "Optimizer steps; -1 trains for `epochs`.")
    warmup_ratio: float = _f(0.05, "Fraction of steps with a linear learning-rate warm-up.",
                             minimum=0)
    lr_scheduler: str = _f("cosine", "Learning-rate schedule.",
                           choices=("cosine", "linear", "constant", "constant_with_warmup"))
    weight_decay: float = _f(0.0, "AdamW weight decay.", minimum=0)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.", minimum=0)
    gradient_checkpointing: bool = _f(True, "Recompute activations in backward to save memory.")
    offload_checkpoints: str | bool = _f(
        "auto", "Keep each layer's checkpoint in pinned CPU memory until the backward pass (LoRA "
                "on one GPU, with gradient checkpointing). auto: on when training on a GPU; true "
                "/ false force it.", choices=("auto", True, False))
    mlp_chunk_tokens: int = _f(4096, "Recompute each layer's MLP on at most this many tokens "
                                     "at a time (LoRA on one GPU, with gradient checkpointing), "
                                     "on a GPU only when the memory plan does not fit without "
                                     "it (it costs a third MLP pass); 0 turns it off.",
                               minimum=0)
    logging_steps: int = _f(5, "Log every N optimizer steps.", minimum=1)
    save_steps: int = _f(100, "Save a checkpoint every N optimizer steps.", minimum=1)
    eval_steps: int = _f(100, "Evaluate every N optimizer steps (when there is validation data).",
                         minimum=1)
    save_total_limit: int = _f(2, "Keep at most N checkpoints.", minimum=1)
    save_only_model: bool = _f(False, "Checkpoints hold the weights (adapter or model) only, "
                                      "without optimizer, scheduler and random state: for full "
                                      "fine-tuning a fraction of the size (7B: ~15 GB instead of "
                                      "~100 GB), but a run cannot resume from them.")
    disk_check: bool = _f(True, "Refuse up front a run whose checkpoints and final weights "
                                "would not fit the free space of --output-dir (estimated from "
                                "the model's shape).")
    seed: int = _f(42, "Random seed.")
    memory_check: bool = _f(True, "On a GPU, refuse up front a run the memory planner says "
                                  "will not fit (lora-lab plan shows the numbers).")
    resume: str = _f(None, "Continue a run: auto (the newest complete checkpoint in the run "
                           "folder; a fresh start if there is none), a run folder or a "
                           "checkpoint folder.")
    allow_config_change: bool = _f(False, "Resume even though the model, data, LoRA or batch "
                                          "settings differ from the run's config.yaml.")
    on_nonfinite: str = _f("stop", "A NaN or inf loss or gradient: stop the run, or skip that "
                                   "update and count it.", choices=("stop", "skip"))
    oom_retry: bool = _f(True, "On CUDA out-of-memory, halve the micro-batch, double grad_accum "
                               "(same effective batch) and resume from the last checkpoint.")
    gpus: int = _f(1, "Processes (one per GPU) to train with; above 1 the run is relaunched "
                      "through `accelerate launch` (on a machine without CUDA: CPU processes "
                      "over gloo). The effective batch is micro_batch_size x grad_accum x gpus.",
                   minimum=1)
    sync_each_micro_batch: str | bool = _f(
        "auto", "Several GPUs: reduce the gradients after every micro-batch, not only after "
                "the last one of an optimizer step. Without it FSDP keeps each GPU's whole "
                "unsharded 16-bit gradients between micro-batches (2 bytes a trained "
                "parameter: 2.9 GiB for full 1.5B); with it DDP communicates grad_accum times "
                "as often. auto: on for fsdp, off otherwise; DeepSpeed reduces every "
                "micro-batch either way.",
        choices=("auto", True, False))
    engine: str = _f("auto", "Distributed engine for --gpus: ddp (a full replica per GPU), "
                             "deepspeed-zero2, deepspeed-zero2-offload, deepspeed-zero3, "
                             "deepspeed-zero3-offload (pip install deepspeed) or fsdp; auto: "
                             "ddp on one GPU, else the fastest one the memory plan fits. The "
                             "engine configs are in presets/engines/.",
                     choices=("auto",) + ENGINES)


SECTIONS = {"model": ModelArgs, "lora": LoraArgs, "data": DataArgs, "train": TrainArgs}


@dataclass
class RunConfig:
    preset: str = "cpu"
    model: ModelArgs = field(default_factory=ModelArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    sources: dict = field(default_factory=dict, repr=False)
    """key -> where its value came from ("default", "preset 16gb", "--lora-rank" ...)."""

    def to_dict(self) -> dict:
        out = {"preset": self.preset}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def describe(self) -> str:
        """One line per key: value and where it came from."""
        lines = []
        for key, value in flatten(self.to_dict()).items():
            if key != "preset":
                lines.append(f"  {key:<28} = {value!r:<32} ({self.sources.get(key, 'default')})")
        return "\n".join(lines)


# The named flags of `lora-lab run`, and the key each sets. The CLI builds its options from this
# table and errors name the flag when that is where a value came from.
FLAGS = {
    "--model": "model.name", "--dtype": "model.dtype", "--quantization": "model.quantization",
    "--trust-remote-code": "model.trust_remote_code",
    "--lora-rank": "lora.rank", "--lora-alpha": "lora.alpha", "--lora-dropout": "lora.dropout",
    "--data": "data.datasets", "--val-data": "data.val_data", "--val-ratio": "data.val_ratio",
    "--format": "data.format", "--max-length": "data.max_length",
    "--truncation": "data.truncation", "--system": "data.system",
    "--model-name": "data.model_name", "--model-author": "data.model_author",
    "--output-dir": "train.output_dir", "--run-name": "train.run_name",
    "--micro-batch-size": "train.micro_batch_size", "--grad-accum": "train.grad_accum",
    "--lr": "train.lr", "--epochs": "train.epochs", "--max-steps": "train.max_steps",
    "--seed": "train.seed", "--memory-check/--no-memory-check": "train.memory_check",
    "--save-steps": "train.save_steps",
    "--logging-steps": "train.logging_steps", "--eval-steps": "train.eval_steps",
    "--gradient-checkpointing/--no-gradient-checkpointing": "train.gradient_checkpointing",
    "--resume": "train.resume", "--allow-config-change": "train.allow_config_change",
    "--on-nonfinite": "train.on_nonfinite", "--oom-retry/--no-oom-retry": "train.oom_retry",
    "--gpus": "train.gpus", "--engine": "train.engine", "--tuner": "train.tuner",
}


FLAG_FOR_KEY = {key: flag.split("/")[0] for flag, key in FLAGS.items()}
"""Config key -> the named flag that sets it (its positive form), for messages."""


def field_help(key: str) -> str:
    section, name = key.split(".")
    spec = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    return spec.metadata["help"]


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key in SECTIONS and not prefix:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


# ----------------------------------------------------------------------------- presets

def list_presets() -> list[dict]:
    """Each preset's name, file and one-line description."""
    out = []
    for path in sorted(presets_dir().glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        out.append({"name": path.stem, "path": path, "description": data.get("description", "")})
    return out


def load_preset(name: str) -> tuple[dict, Path]:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        names = [p["name"] for p in list_presets()]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean --preset {close[0]}?" if close else ""
        raise ConfigError([f"--preset {name}: no such preset.{hint} "
                           f"Available: {', '.join(names)} (see `lora-lab presets`)."])
    return _read_yaml(path, f"preset {name}"), path


def _read_yaml(path: Path, what: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"--config {path}: file not found."]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError([f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})."]
                          ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: {what} must be a mapping of sections "
                           f"(model:, lora:, data:, train:), got {type(data).__name__}."])
    return data


# ----------------------------------------------------------------------------- resolution

class _Layer:
    """One source of values: a label for errors ("--lora-rank", "my.yaml: lora.rank")."""

    def __init__(self, values: dict, source: str, label, recorded: dict | None = None):
        self.values, self.source, self.label = values, source, label
        self.recorded = recorded or {}
        """key -> source recorded in a saved config.yaml given as --config (kept as it was)."""


def resolve_config(preset: str | None = "cpu", config_file: str | None = None,
                   flags: dict | None = None, sets: list[str] | tuple = (),
                   need_data: bool = True) -> RunConfig:
    """Build the RunConfig: defaults -> preset YAML -> --config YAML -> flags and --set.

    `flags` maps config keys ("lora.rank") to values given by named flags; `sets` holds raw
    "key=value" strings from --set. All problems are collected and raised as one ConfigError.
    preset None: the defaults alone (the data commands, which need no hardware tier).
    need_data False: a config without training data is valid (the memory planner's).
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
    layers.append(_Layer(flag_layer, "flag",
                         lambda key, v: f"{FLAG_FOR_KEY.get(key, key)} {_show(v)}"))
    layers.append(_set_layer(sets, problems))

    model_spec = next((layer.values["model.name"] for layer in reversed(layers)
                       if "model.name" in layer.values), ModelArgs().name)
    size = guess_model_size(model_spec)
    if size and size in preset_sizes:
        layers.insert(1, _yaml_layer(preset_sizes[size], f"preset {preset} (sizes.{size})",
                                     f"{preset_path.name} sizes.{size}", problems))

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
    if config.train.engine == "auto" and config.train.gpus == 1:
        config.train.engine = "ddp"  # several GPUs: lora_lab.memory.pick_engine, at launch
        config.sources["train.engine"] = "auto (one GPU)"
    for key, problem in _validate(config, need_data):
        problems.append(f"{labels.get(key, FLAG_FOR_KEY.get(key, key))}: {problem}")
    try:
        resolve_model_spec(config.model.name)
    except ModelError as exc:
        problems.append(str(exc) if "model.name" not in labels or labels["model.name"].startswith(
            "--model") else f"{labels['model.name']}: {exc}")
    if problems:
        raise ConfigError(problems)
    return config


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _yaml_layer(tree: dict, source: str, where: str, problems: list) -> _Layer:
    values = {}
    for section, body in tree.items():
        if section not in SECTIONS:
            problems.append(f"{where}: unknown section `{section}`; "
                            f"expected one of {', '.join(SECTIONS)}.")
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


AUTO_OR_BOOL = ("embedding_on_cpu", "offload_checkpoints", "sync_each_micro_batch")


def _coerce(key: str, value) -> tuple[Any, str | None]:
    """Convert a value to the field's type; returns (value, problem)."""
    section, name = key.split(".")
    kind = get_type_hints(SECTIONS[section])[name]
    if value is None:
        return None, None
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
        return None, f"expected true or false{' (or auto)' if name in AUTO_OR_BOOL else ''}, " \
                     f"got {value!r}."
    if kind is int:
        try:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value)), None
        except (TypeError, ValueError):
            return None, f"expected a whole number, got {value!r}."
    if kind is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value), None
        except (TypeError, ValueError):
            return None, f"expected a number, got {value!r}."
    if kind is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [str(v) for v in items], None
    return str(value), None


def _tuner_defaults(config: RunConfig) -> None:
    """--tuner full: a learning rate the user did not give becomes FULL_FINETUNING_LR (the
    defaults and presets hold LoRA learning rates)."""
    source = config.sources.get("train.lr", "default")
    if config.train.tuner == "full" and (source == "default" or source.startswith("preset")):
        config.train.lr = FULL_FINETUNING_LR
        config.sources["train.lr"] = "--tuner full default"


def _validate(config: RunConfig, need_data: bool = True) -> list[tuple[str, str]]:
    problems = []
    for section, cls in SECTIONS.items():
        for spec in dataclasses.fields(cls):
            key, value = f"{section}.{spec.name}", getattr(getattr(config, section), spec.name)
            choices, minimum = spec.metadata["choices"], spec.metadata["minimum"]
            if choices and value not in choices:
                problems.append((key, f"must be one of {', '.join(choices)}; got {value!r}."))
            if minimum is not None and value is not None and value < minimum:
                problems.append((key, f"must be at least {minimum}; got {value!r}."))
    if config.data.val_ratio >= 1:
        problems.append(("data.val_ratio", f"must be below 1; got {config.data.val_ratio}."))
    if config.data.val_ratio and config.data.val_data:
        problems.append(("data.val_ratio", "give either --val-ratio or --val-data, not both."))
    if need_data and not config.data.datasets:
        problems.append(("data.datasets", "no training data. Pass --data FILE (or "
                                          "--data self-cognition for the bundled set)."))
    if config.train.tuner == "full" and config.model.quantization != "none":
        problems.append(("train.tuner", "full fine-tuning trains 16-bit weights; 4-bit weights "
                                        "cannot be trained. Drop --quantization nf4 (QLoRA is "
                                        "--tuner lora --quantization nf4)."))
    if config.train.tuner == "full" and config.model.dtype == "fp16":
        problems.append(("train.tuner", "full fine-tuning in fp16 is refused: Qwen2.5's "
                                        "activations overflow fp16 and whole-model updates "
                                        "diverge. Use --dtype bf16 (a GPU with bf16) or fp32."))
    single = (config.train.gpus == 1 and config.train.engine == "ddp"
              and config.train.tuner == "lora")
    for key, value in (("model.embedding_on_cpu", config.model.embedding_on_cpu),
                       ("train.offload_checkpoints", config.train.offload_checkpoints)):
        if value is True and not (single and config.train.gradient_checkpointing):
            problems.append((key, "true serves LoRA in one process with gradient checkpointing "
                                  "(DDP and DeepSpeed do not see its recomputed gradients). "
                                  "Use auto or false here."))
    if config.train.max_steps == 0 or config.train.max_steps < -1:
        problems.append(("train.max_steps", "must be -1 (use epochs) or at least 1."))
    return problems


def syncs_each_micro_batch(train: TrainArgs) -> bool:
    """train.sync_each_micro_batch resolved: auto is on for FSDP (see its help)."""
    if train.sync_each_micro_batch == "auto":
        return train.engine == "fsdp"
    return bool(train.sync_each_micro_batch)


