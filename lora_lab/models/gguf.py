"""GGUF files as models: a .gguf is de-quantized once into a Hugging Face folder (cached)."""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import time
from pathlib import Path

from ..errors import ModelError
from ..log import get_logger
from ..paths import cache_dir, human_bytes, staged_folder
from ..registry import END_OF_TURN_TOKENS
from .shipped import fetch_shipped_gguf, shipped_chat_template

log = get_logger()


def stop_token_ids(tokenizer) -> list[int]:
    """The end-of-turn ids the vocabulary has, then eos (a missing token is not mapped to unk)."""
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def convert_gguf(gguf: Path, out: Path | None = None) -> Path:
    """De-quantize a .gguf into a Hugging Face folder (bf16 safetensors), cached by file."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(out) if out else cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / ".complete").is_file():
        return out
    # processes converting one file at once (two test workers, two shells) take turns under an
    # flock, which the kernel releases if its holder dies: the second finds the first's folder
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out / ".complete").is_file():
                _convert(gguf, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """convert_gguf's work: read, de-quantize, copy into a bf16 model, save staged."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder in %s (once)", gguf, out)
    started = time.perf_counter()
    with open(gguf, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelError(
                f"--model {gguf}: not a GGUF file (it does not start with the GGUF "
                f"magic bytes). Download it again, or pass a model folder."
            )
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("--model *.gguf needs the `gguf` package: pip install gguf") from None
    log.info(f"  1/3: reading and de-quantizing {human_bytes(gguf.stat().st_size)} of GGUF tensors")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, struct.error, EOFError) as exc:
        raise ModelError(
            f"--model {gguf}: the GGUF file cannot be read ({type(exc).__name__}: "
            f"{str(exc)[:160]}); it may be cut short. Download it again."
        ) from None
    # The GGUF loader marks the model as quantized: copy the de-quantized weights into a plain one.
    plain = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    config = AutoConfig.for_model(**plain)
    config.dtype = "bfloat16"
    weights = loaded.state_dict()
    log.info(f"  2/3: copying {sum(t.numel() for t in weights.values()):,} weights into a bf16 model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise ModelError(f"{gguf}: unexpected tensors in the GGUF file ({unexpected[:3]} {missing[:3]}).")
    if missing:
        model.tie_weights()
    if tokenizer.chat_template is None:
        # a shipped base-model GGUF without a template gets its family's published one
        tokenizer.chat_template = shipped_chat_template(gguf)
    stops = stop_token_ids(tokenizer)
    model.generation_config.eos_token_id = stops
    pad = tokenizer.pad_token_id
    model.generation_config.pad_token_id = pad if pad is not None else (stops[-1] if stops else None)
    log.info("  3/3: saving the folder")
    with staged_folder(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    (out / ".complete").write_text(str(gguf) + "\n")
    log.info(f"  converted in {time.perf_counter() - started:.0f} s")


def fetch_shipped_model(name: str) -> Path:
    """models/shipped.py's SHIPPED_MODELS[name] as a Hugging Face folder (the GGUF fetched and
    checked, converted once, then cached)."""
    gguf = fetch_shipped_gguf(name)
    log.info(f"model: {gguf} (sha256 ok)")
    return convert_gguf(gguf)
