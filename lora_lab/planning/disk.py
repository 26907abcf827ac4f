"""Disk space a run needs: its checkpoints and final weights, from the model's shape."""
from __future__ import annotations

import shutil
from pathlib import Path

from ..config import RunConfig
from ..errors import LoraLabError
from ..registry import model_config_of
from .memory import ModelShape

GB = 1e9


def checkpoint_sizes(config: RunConfig, model_config: dict) -> tuple[float, float, float]:
    """Estimated bytes of a checkpoint's weights, of its optimizer state, and of the final
    weights, from the model's shape.

    Weights: LoRA adapters in fp32; full fine-tuning in 16 bits with DeepSpeed (its module is
    16-bit) and in fp32 otherwise (the master weights), the final model of a one-process run
    in bf16. Optimizer state: AdamW's two fp32 moments, plus DeepSpeed's fp32 master copy."""
    shape = ModelShape.from_config(model_config)
    engine, full = config.train.engine, config.train.tuner == "full"
    deepspeed = engine.startswith("deepspeed")
    trained = shape.trained_params(config.train.tuner, config.lora.rank)
    weight_bytes = (2 if deepspeed else 4) if full else 4
    optimizer_bytes = 12 if deepspeed and full else 8
    final_bytes = (4 if engine == "fsdp" else 2) if full else 4
    return trained * weight_bytes, trained * optimizer_bytes, trained * final_bytes


def check_disk_space(config: RunConfig, run_dir: Path, total_steps: int) -> None:
    """Refuse before training a run whose checkpoints and final weights will not fit the free
    space where they go: a full disk fails the save at the end, after all the training."""
    model_config = model_config_of(config.model.name) if config.train.disk_check else None
    if model_config is None or "hidden_size" not in model_config:
        return
    t = config.train
    weights, optimizer, final = checkpoint_sizes(config, model_config)
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
        fixes.append(f"keep one checkpoint (--set train.save_total_limit=1: "
                     f"{(2 * per_checkpoint + final) / GB:.0f} GB)")
    if not t.save_only_model:
        fixes.append(f"save weights only (--set train.save_only_model=true: "
                     f"{(kept * weights + final) / GB:.0f} GB; such checkpoints cannot be "
                     f"resumed)")
    fixes.append("write elsewhere (--output-dir) or free space")
    raise LoraLabError(
        f"--output-dir {t.output_dir}: this run writes about {needed / GB:.0f} GB (up to {kept} "
        f"checkpoint(s) of {per_checkpoint / GB:.1f} GB and the final {what} of "
        f"{final / GB:.1f} GB) but {where} has {free / GB:.0f} GB free. Either "
        + "; or ".join(fixes) + ". --set train.disk_check=false skips this check.")
