"""Resolution: defaults -> preset -> --config YAML -> flags and --set, every value remembering
where it came from, every problem collected and reported at once."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from ..errors import ConfigError, ModelError
from ..paths import presets_dir
from ..registry import resolve_model_spec, size_class
from .checks import config_problems
from .fields import FULL_FINETUNING_LR, SECTIONS, ModelArgs, RunConfig
from .flags import FLAG_FOR_KEY, all_keys

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
    The config returned is frozen: what a run derives from it goes into its plan
    (training/plan.py).
    """
    problems: list[str] = []
    layers = _layers(preset, config_file, flags, sets, problems)
    values, sources, labels = _merge(layers, problems)
    config = _derived_defaults(_build(preset or "none", values, sources))
    for key, problem in config_problems(config, need_data, training):
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


def _layers(preset: str | None, config_file: str | None, flags: dict | None, sets, problems: list) -> list[_Layer]:
    """The sources of values, lowest first: preset (and its size section), --config, flags, --set."""
    layers: list[_Layer] = []
    preset_sizes: dict = {}
    preset_path = Path()
    if preset is not None:
        preset_data, preset_path = load_preset(preset)
        preset_sizes = preset_data.pop("sizes", None) or {}
        preset_data.pop("description", None)
        layers.append(_yaml_layer(preset_data, f"preset {preset}", preset_path.name, problems))
    if config_file:
        user = _read_yaml(Path(config_file), "--config")
        user.pop("description", None)
        user.pop("preset", None)  # a run's saved config.yaml: its values already hold the preset's
        user.pop("plan", None)  # a launcher's plan file: its settled facts are the plan's to read
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
    return layers


def _merge(layers: list[_Layer], problems: list) -> tuple[dict, dict, dict]:
    """Each key's value from the last layer that gives it: (values, sources, labels)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    labels: dict[str, str] = {}
    for layer in layers:
        for key, raw in layer.values.items():
            value, problem = _coerce(key, raw)
            label = layer.label(key, raw)
            if problem:
                problems.append(f"{label}: {problem}")
                continue
            values[key] = value
            source = layer.source if layer.source != "flag" else label.split()[0]
            if layer.recorded and key not in layer.recorded:
                sources.pop(key, None)  # a saved config.yaml: a default in that run
            else:
                sources[key] = layer.recorded.get(key, source)
            labels[key] = label
    return values, sources, labels


def _build(preset: str, values: dict, sources: dict) -> RunConfig:
    """The frozen RunConfig of the merged values; every other key keeps its default."""
    sections: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        section, name = key.split(".")
        sections[section][name] = value
    return RunConfig(preset=preset, **{name: cls(**sections[name]) for name, cls in SECTIONS.items()}, sources=sources)


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
    "liger_experts",
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


def _derived_defaults(config: RunConfig) -> RunConfig:
    """Defaults that follow from other keys. --tuner full: a learning rate the user did not give
    becomes FULL_FINETUNING_LR (the defaults and presets hold LoRA learning rates). --task grpo
    takes beta 0 unless given (TRL's default: no reference model). A preference or grpo --task
    turns a preset's packing off. train.engine auto stays auto: the run plan settles it."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    given = config.sources.get("train.lr", "default")
    if config.train.tuner == "full" and (given == "default" or given.startswith("preset")):
        values["train.lr"], sources["train.lr"] = FULL_FINETUNING_LR, "--tuner full default"
    if config.train.task == "grpo" and config.sources.get("train.pref_beta", "default") == "default":
        values["train.pref_beta"], sources["train.pref_beta"] = 0.0, "--task grpo default (no reference pass)"
    packing = config.sources.get("data.packing", "default")
    if config.train.task != "sft" and config.data.packing and packing.startswith("preset"):
        # a preset packs supervised rows; a preference task reads prompt + answer sequences
        values["data.packing"], sources["data.packing"] = False, f"--task {config.train.task} (no packing)"
    return config.with_changes(values, sources) if values else config
