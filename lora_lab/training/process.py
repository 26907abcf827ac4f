"""The process-wide settings a training run makes, set inside one context that puts them back when
train() returns (or raises): a library call to lora_lab.train() leaves the calling process as it
found it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..device import run_device_settings
from ..log import quiet_library_progress
from ..models.kernels import restored_kernel_patches
from ..models.linear_attention import fla_installed, torch_delta_rule_where_fla_refuses

if TYPE_CHECKING:
    from .plan import RunPlan


@contextlib.contextmanager
def run_settings(plan: RunPlan):
    """Device settings (allocator, memory cap, cuDNN attention), liger-kernel's patches, the
    progress bars of transformers and the hub, and the optimizer step hooks registered while
    the run's models were built (models.fast_lora's StepCounter), and transformers' torch delta
    rule where fla cannot train (models/linear_attention.py); all from the run's plan."""
    config, model_type = plan.config, plan.model.model_type
    expandable = config.train.expandable_segments and not plan.engine.startswith("deepspeed")
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored_optimizer_hooks())
        stack.enter_context(run_device_settings(expandable, config.model.cudnn_attention))
        stack.enter_context(restored_kernel_patches(plan.kernels, model_type))
        stack.enter_context(torch_delta_rule_where_fla_refuses(model_type if fla_installed() else None))
        stack.enter_context(quiet_library_progress())
        yield


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
