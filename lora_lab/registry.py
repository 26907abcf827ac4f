"""The models lora-lab knows by name: aliases, the Qwen2.5 sizes and their real config.json
files, and how a --model value is classified (hub id, folder or .gguf)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import LoraLabError, ModelError
from .paths import model_configs_dir

QWEN25_SIZES = ("0.5b", "1.5b", "3b", "7b")


_SIZE_SPELLING = {"0.5b": "0.5B", "1.5b": "1.5B", "3b": "3B", "7b": "7B"}


def _model_aliases() -> dict[str, str]:
    aliases = {}
    for size, spelled in _SIZE_SPELLING.items():
        aliases[f"qwen2.5-{size}"] = f"Qwen/Qwen2.5-{spelled}-Instruct"
        aliases[f"qwen2.5-{size}-instruct"] = f"Qwen/Qwen2.5-{spelled}-Instruct"
        aliases[f"qwen2.5-{size}-base"] = f"Qwen/Qwen2.5-{spelled}"
    return aliases


MODEL_ALIASES = _model_aliases()

_SHIPPED_TOKENIZER_MODELS = {f"qwen/qwen2.5-{spelled.lower()}-instruct"
                             for spelled in _SIZE_SPELLING.values()}


def uses_shipped_tokenizer(repo_id: str) -> bool:
    """Every Qwen2.5 Instruct size has the tokenizer shipped in lora_lab/qwen25_tokenizer, byte
    for byte; base models are not covered (their files were not checked against it)."""
    return repo_id.lower() in _SHIPPED_TOKENIZER_MODELS


_NO_SUCH_SIZE = re.compile(r"qwen2\.5-(\d+(?:\.\d+)?)b", re.IGNORECASE)


def resolve_model_spec(spec: str) -> tuple[str, str]:
    """Classify --model: returns (kind, value) with kind in {"hub", "folder", "gguf"}."""
    text = str(spec).strip()
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"--model {text}: GGUF file not found. Check the path.")
        return "gguf", str(path.resolve())
    if path.is_dir():
        return "folder", str(path.resolve())
    match = _NO_SUCH_SIZE.search(text)
    if match and match.group(1).lower() + "b" not in QWEN25_SIZES:
        size = match.group(1)
        hint = " (1.8B is a Qwen1.5 size)" if size == "1.8" else ""
        raise ModelError(
            f"--model {text}: Qwen2.5 has no {size}B size{hint}. Qwen2.5 comes in "
            f"0.5B, 1.5B, 3B and 7B; try --model qwen2.5-1.5b.")
    if text.lower() in MODEL_ALIASES:
        return "hub", MODEL_ALIASES[text.lower()]
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1
    if looks_like_path:
        raise ModelError(f"--model {text}: no such folder. Pass an existing model folder, "
                         f"a .gguf file or a hub id such as Qwen/Qwen2.5-7B-Instruct.")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return "hub", text
    raise ModelError(f"--model {text}: not a folder, .gguf file, hub id or known alias. "
                     f"Aliases: {', '.join(sorted(MODEL_ALIASES)[:4])} ... (see "
                     f"docs/training.md).")


def _local_config(kind: str, value: str) -> dict | None:
    """A resolved model spec's own config.json, when it is a folder that has one."""
    path = Path(value) / "config.json"
    return json.loads(path.read_text()) if kind == "folder" and path.is_file() else None


def guess_model_size(spec: str) -> str | None:
    """'7b' for any Qwen2.5-7B spelling or a local folder of that shape; None if unknown."""
    try:
        kind, value = resolve_model_spec(spec)
    except LoraLabError:
        return None
    local = _local_config(kind, value)
    if local is not None:
        shape = _shape_of(local)
        for size in QWEN25_SIZES:
            if shape == _shape_of(known_model_config(size)):
                return size
        return None
    match = re.search(r"(\d+(?:\.\d+)?)b", Path(value).name.lower())
    size = match.group(1) + "b" if match else None
    return size if size in QWEN25_SIZES else None


def model_config_of(spec: str) -> dict | None:
    """The model's config.json: a local folder's own, else the shipped one of the Qwen2.5 size
    its name says; None if neither is known."""
    local = _local_config(*resolve_model_spec(spec))
    if local is not None:
        return local
    size = guess_model_size(spec)
    return known_model_config(size) if size else None


def _shape_of(config: dict) -> tuple:
    return tuple(config.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size"))


def known_model_config(size: str) -> dict:
    """The real config.json of Qwen2.5 at `size` (shipped in lora_lab/model_configs)."""
    return json.loads((model_configs_dir() / f"qwen2.5-{size}.json").read_text())
