"""Fused kernels for training: liger-kernel's Triton kernels (with a patch of its fused loss
backward) and PyTorch's own fused RMSNorm in place of the models' RMSNorm layers."""

from __future__ import annotations

import contextlib
import importlib

from ..errors import ModelError
from ..log import get_logger
from ..registry import family_of

log = get_logger()


def liger_available() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def applies_liger(kernels: str) -> bool:
    """Whether the settled model.kernels (the run plan's, training/plan.settle_kernels: liger or
    none) applies liger; a liger this machine cannot run is refused."""
    if kernels == "none":
        return False
    if not liger_available():
        raise ModelError(
            "--set model.kernels=liger needs a CUDA GPU and the liger-kernel "
            "package (pip install liger-kernel); use model.kernels=auto or none."
        )
    return True


def apply_kernels(
    model, kernels: str, fused_loss: bool = True, native_norms: bool = True, liger_experts: bool = True
) -> str:
    """Swap in liger-kernel's fused Triton kernels (GPU only); returns what was applied.

    The fused linear cross-entropy never builds the [tokens x 151936] logits tensor, which is
    the largest single activation of a Qwen2.5 training step. It reads the output head's
    weight itself, so not where rows of the head train (lora.trainable_tokens: fused_loss off).
    native_norms (model.native_rms_norm): NATIVE_RMS_NORMS layers run through torch.rms_norm
    instead of liger's RMSNorm. liger_experts (model.liger_experts) False: a family whose experts
    liger replaces (registry.Family.liger_experts) keeps transformers' own (liger's swiglu off).
    liger patches the model's own modules; what it and the loss
    backward below rebind in modules of the process is put back by restored_kernel_patches.
    """
    if not applies_liger(kernels):
        return "none"
    import inspect

    import liger_kernel.transformers as liger

    family = family_of(model.config.model_type)
    apply = getattr(liger, family.liger, None) if family.liger else None
    if apply is None:
        log.info(
            f"liger kernels: none for model_type {model.config.model_type!r} in this "
            f"liger-kernel; the model trains without them"
        )
        return "none"
    native_norms = (
        native_norms
        and native_rms_norm_available()
        and any(type(m).__name__ in NATIVE_RMS_NORMS for m in model.modules())
    )
    wanted = {
        "rope": True,
        "rms_norm": not native_norms,
        "swiglu": True,
        "geglu": True,
        "cross_entropy": not fused_loss,
        "fused_linear_cross_entropy": fused_loss,
        "model": model,
    }
    wanted.update(dict.fromkeys(family.liger_without & wanted.keys(), False))
    if family.liger_experts and not liger_experts:
        wanted["swiglu"] = False
    params = inspect.signature(apply).parameters
    apply(**{k: v for k, v in wanted.items() if k in params})
    if native_norms:
        use_native_rms_norm(model)
    if fused_loss:
        scale_loss_gradients_on_device()
    return "liger"


def scale_on_device(grad_output, grad_input, grad_weight, grad_bias):
    """The fused linear cross-entropy's backward: the gradients its forward pass computed,
    times the loss's incoming gradient, multiplied on the device. liger first compares that
    gradient with 1 (torch.equal against a new CUDA tensor), which makes the host wait for the
    GPU once per micro-batch; multiplying by 1 is exact, so the comparison buys nothing."""
    for grad in (grad_input, grad_weight, grad_bias):
        if grad is not None:
            grad.mul_(grad_output)
    return grad_input, grad_weight, grad_bias


LOSS_BACKWARD = "fused_linear_cross_entropy_backward"


def scale_loss_gradients_on_device() -> bool:
    """Route liger's fused linear cross-entropy backward through scale_on_device; False where
    this liger-kernel has no such function (its own backward then runs)."""
    import inspect

    from liger_kernel.ops import fused_linear_cross_entropy as flce

    original = getattr(flce, LOSS_BACKWARD, None)
    if original is None or list(inspect.signature(original).parameters) != [
        "grad_output",
        "grad_input",
        "grad_weight",
        "grad_bias",
    ]:
        return False
    setattr(flce, LOSS_BACKWARD, scale_on_device)
    return True


NATIVE_RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Phi3RMSNorm")
"""RMSNorm layers that compute weight * (x * rsqrt(mean(x^2) + eps)) with the statistics in
fp32: what torch.rms_norm computes. On a GPU it is one fused CUDA kernel each way, launched from
C++, where liger's Triton kernel is launched from Python: a step on short rows waits on the host,
so every launch's Python counts. Gemma's (1 + weight) is not among them."""


def native_rms_norm_available() -> bool:
    """Whether this PyTorch has the fused RMSNorm kernels (2.9 and later)."""
    import torch

    return hasattr(torch.ops.aten, "_fused_rms_norm")


def _native_rms_norm(module, hidden_states):
    import torch

    weight = module.weight
    with torch.autocast(hidden_states.device.type, enabled=False):
        if weight.dtype == hidden_states.dtype:
            return torch.rms_norm(hidden_states, weight.shape, weight, module.variance_epsilon)
        # the model's types: the normalized input rounded to its type, then times the weight
        # (fp32 norms of a k-bit model give fp32)
        return weight * torch.rms_norm(hidden_states, weight.shape, None, module.variance_epsilon)


def use_native_rms_norm(model) -> int:
    """Route the NATIVE_RMS_NORMS layers of `model` through torch.rms_norm; returns how many."""
    import functools

    layers = [m for m in model.modules() if type(m).__name__ in NATIVE_RMS_NORMS]
    for layer in layers:
        layer.forward = functools.partial(_native_rms_norm, layer)
    return len(layers)


LIGER_LOSS_MODULE = "liger_kernel.ops.fused_linear_cross_entropy"


@contextlib.contextmanager
def restored_kernel_patches(kernels: str, model_type: str | None):
    """Put back, on exit, what applying model.kernels rebinds in modules of this process:
    liger-kernel's apply_liger_kernel_to_<family> replaces names in transformers' modeling
    module of the family and attributes of its classes (RMSNorm, MLP, rotary embedding, the
    loss), and scale_loss_gradients_on_device liger's fused loss backward. Both modules are
    imported on entry, so that their state before any patch is what comes back."""
    if not applies_liger(kernels):
        yield
        return
    names = [LIGER_LOSS_MODULE] + ([f"transformers.models.{model_type}.modeling_{model_type}"] if model_type else [])
    saved = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        owners = [module] + [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
        saved += [(owner, dict(vars(owner))) for owner in owners]
    try:
        yield
    finally:
        for owner, values in saved:
            for key, value in values.items():
                if vars(owner).get(key) is not value:
                    setattr(owner, key, value)
