"""The process-wide settings a training run makes, set inside one context that puts them back when
train() returns (or raises): a library call to lora_lab.train() leaves the calling process as it
found it."""

from __future__ import annotations

import contextlib

from ..config import RunConfig
from ..device import run_device_settings
from ..log import quiet_library_progress
from ..models.kernels import resolve_kernels, restored_kernel_patches
from ..models.linear_attention import fla_installed, torch_delta_rule_where_fla_refuses
from ..registry import model_config_of


@contextlib.contextmanager
def run_settings(config: RunConfig):
    """Device settings (allocator, memory cap, cuDNN attention), liger-kernel's patches, the
    progress bars of transformers and the hub, and the optimizer step hooks registered while
    the run's models were built (models.fast_lora's StepCounter), and transformers' torch delta
    rule where fla cannot train (models/linear_attention.py)."""
    expandable = config.train.expandable_segments and not config.train.engine.startswith("deepspeed")
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored_optimizer_hooks())
        stack.enter_context(run_device_settings(expandable, config.model.cudnn_attention))
        stack.enter_context(restored_kernel_patches(config.model.kernels, _model_type(config)))
        stack.enter_context(torch_delta_rule_where_fla_refuses(model_type_of(config) if fla_installed() else None))
        stack.enter_context(quiet_library_progress())
        yield


def _model_type(config: RunConfig) -> str | None:
    """The model's model_type, read only where kernels are applied (liger patches its module)."""
    if resolve_kernels(config.model.kernels) == "none":
        return None
    return model_type_of(config)


def model_type_of(config: RunConfig) -> str | None:
    return (model_config_of(config.model.name) or {}).get("model_type")


@contextlib.contextmanager
def restored_optimizer_hooks():
    """torch.optim's global step hooks registered inside the context are removed on exit (a fast
    LoRA model registers one when it is built; it must not outlive the run that trained it)."""
    from torch.optim import optimizer

    hooks = optimizer._global_optimizer_post_hooks
    before = set(hooks)
    try:
        yield
    finally:
        for key in set(hooks) - before:
            del hooks[key]
