"""Disk space a run needs: its checkpoints and final weights, from the model's shape."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import RunConfig, converts_initial_adapter, engine_of
from ..errors import LoraLabError
from ..registry import model_config_of, resolve_model_spec
from .shape import ModelShape

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
)
"""Files save_pretrained writes beside every checkpoint's and the final weights (when present)."""
TOKENIZER_BYTES_UNKNOWN = 12_000_000
"""Tokenizer files of a model whose folder is not here (a hub id, a GGUF): Qwen2.5's are 11 MB."""
SMALL_FILES_BYTES = 1_000_000
"""A checkpoint's other files: trainer state, scheduler, RNG state, manifest, README."""

GB = 1e9


def checkpoint_sizes(config: RunConfig, model_config: dict) -> tuple[float, float, float]:
    """Estimated bytes of a checkpoint's weights, of its optimizer state, and of the final
    weights, from the model's shape.

    Weights: LoRA adapters in fp32; full fine-tuning in 16 bits with DeepSpeed (its module is
    16-bit) and in fp32 otherwise (the master weights), the final model of a one-process run
    in bf16. Optimizer state: AdamW's two fp32 moments, plus DeepSpeed's fp32 master copy.
    lora.init pissa / olora: the final adapter is converted to twice the rank, beside the
    initial one."""
    shape = ModelShape.from_config(model_config)
    engine, full = engine_of(config.train), config.train.tuner == "full"
    deepspeed = engine.startswith("deepspeed")
    trained = shape.trained_params(config.train.tuner, config.lora.rank)
    weight_bytes = (2 if deepspeed else 4) if full else 4
    optimizer_bytes = 12 if deepspeed and full else 8
    final_bytes = (4 if engine == "fsdp" else 2) if full else 4
    if converts_initial_adapter(config.lora) and not full:
        final_bytes = 4 * 3  # adapter/ at twice the rank, and adapter_init/
    return trained * weight_bytes, trained * optimizer_bytes, trained * final_bytes


def check_disk_space(config: RunConfig, run_dir: Path, total_steps: int) -> None:
    """Refuse before training a run whose checkpoints and final weights will not fit the free
    space where they go: a full disk fails the save at the end, after all the training."""
    model_config = model_config_of(config.model.name) if config.train.disk_check else None
    if model_config is None or "hidden_size" not in model_config:
        return
    t = config.train
    weights, optimizer, final = checkpoint_sizes(config, model_config)
    side = tokenizer_bytes(config.model.name) + SMALL_FILES_BYTES
    weights, final = weights + side, final + side
    per_checkpoint = weights + (0 if t.save_only_model else optimizer)
    saves = -(-total_steps // t.save_steps)  # every save_steps, and at the last step
    # a new checkpoint is written before the oldest beyond save_total_limit is deleted
    kept = min(saves, t.save_total_limit + 1)
    needed = kept * per_checkpoint + final
    where = Path(run_dir)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed <= free:
        return
    what = "model" if t.tuner == "full" else "adapter"
    fixes = []
    if kept > 2:
        fixes.append(f"keep one checkpoint (--set train.save_total_limit=1: {_size(2 * per_checkpoint + final)})")
    if not t.save_only_model:
        fixes.append(
            f"save weights only (--set train.save_only_model=true: "
            f"{_size(kept * weights + final)}; such checkpoints cannot be resumed)"
        )
    fixes.append("write elsewhere (--output-dir) or free space")
    raise LoraLabError(
        f"--output-dir {t.output_dir}: this run writes about {_size(needed)} (up to {kept} "
        f"checkpoint(s) of {_size(per_checkpoint, 1)} and the final {what} of "
        f"{_size(final, 1)}) but {where} has {_size(free)} free. Either "
        + "; or ".join(fixes)
        + ". --set train.disk_check=false skips this check."
    )


def tokenizer_bytes(model_spec: str) -> int:
    """Bytes of the tokenizer files a save writes: those of a local model folder, else a guess."""
    kind, value = resolve_model_spec(model_spec)
    if kind != "folder":
        return TOKENIZER_BYTES_UNKNOWN
    return sum((Path(value) / name).stat().st_size for name in TOKENIZER_FILES if (Path(value) / name).is_file())


def _size(count: float, digits: int = 0) -> str:
    """Bytes for a message: GB with `digits` decimals, or MB below 1 GB."""
    return f"{count / GB:.{digits}f} GB" if count >= GB else f"{count / 1e6:.0f} MB"
