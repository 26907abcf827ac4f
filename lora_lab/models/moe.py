"""Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE, gpt-oss): their experts in 4 bits.

Under transformers 5 each layer's experts are two fused 3D parameters, `gate_up_proj` and
`down_proj` ([experts, out, in], or [experts, in, out] where the module is_transposed), which
bitsandbytes' quantization of nn.Linear layers does not touch: a "QLoRA" of such a model would
keep every expert in 16 bits. `quantize_experts` stores each of them as one bitsandbytes nf4
tensor (double-quantized statistics, as QLoRA's linear layers). The experts module keeps its
class and its transformers forward (grouped_mm: tokens sorted by expert once per layer, one
grouped product per projection); reading `gate_up_proj` or `down_proj` de-quantizes that
layer's tensor for the product at hand. Nothing else holds 16-bit experts: with gradient
checkpointing a layer's de-quantized experts live only while that layer computes (its forward,
then its recomputation and backward). Biases (gpt-oss) stay as they are; the experts are frozen.
"""

from __future__ import annotations

from typing import Any

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert tensors of transformers 5's experts modules."""
PACKED_SUFFIX = "_nf4"
"""A quantized tensor's packed bytes are the module's buffer `<name>_nf4`."""


def expert_modules(model) -> list[tuple[str, Any]]:
    """(name, module) of each experts module: one holding the fused 3D EXPERT_WEIGHTS, in 16
    bits or quantized."""
    return [(name, module) for name, module in model.named_modules() if _holds_experts(module)]


def _holds_experts(module) -> bool:
    if not hasattr(module, "num_experts"):
        return False
    for key in EXPERT_WEIGHTS:
        weight = module._parameters.get(key)
        if key + PACKED_SUFFIX not in module._buffers and getattr(weight, "ndim", 0) != 3:
            return False
    return True


def _is_quantized(module) -> bool:
    return all(key + PACKED_SUFFIX in module._buffers for key in EXPERT_WEIGHTS)


_DEQUANTIZING: dict[type, type] = {}


def _dequantizing_class(cls: type) -> type:
    """`cls` with EXPERT_WEIGHTS read from their nf4 buffers (one class per experts class)."""
    if cls not in _DEQUANTIZING:

        def weight(name: str) -> property:
            def read(self):
                import bitsandbytes.functional as bnb

                packed = self._buffers[name + PACKED_SUFFIX]
                state = self.nf4_states[name]
                if state.absmax.device != packed.device:
                    state.to(packed.device)
                return bnb.dequantize_4bit(packed, state)

            return property(read, doc=f"{name}, de-quantized from its nf4 buffer for this product")

        namespace = {key: weight(key) for key in EXPERT_WEIGHTS}
        _DEQUANTIZING[cls] = type(f"Nf4{cls.__name__}", (cls,), namespace)
    return _DEQUANTIZING[cls]


def quantize_experts(model, device=None) -> int:
    """Store every experts module's fused weights as nf4 (on `device`, default where they are;
    one tensor in 16 bits at a time, so a model held on the CPU is quantized onto the GPU layer by
    layer). Returns the bytes the quantized experts take (packed weights and statistics)."""
    import bitsandbytes.functional as bnb
    import torch

    total = 0
    for _, module in expert_modules(model):
        if _is_quantized(module):
            continue
        states = {}
        for key in EXPERT_WEIGHTS:
            weight = module._parameters.pop(key)
            data = weight.data.to(device) if device is not None else weight.data
            packed, state = bnb.quantize_4bit(data, quant_type="nf4", compress_statistics=True)
            del weight, data
            module.register_buffer(key + PACKED_SUFFIX, packed)
            states[key] = state
            total += packed.numel() * packed.element_size() + _state_bytes(state)
        module.nf4_states = states
        module.__class__ = _dequantizing_class(type(module))
    if device is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return total


def _state_bytes(state) -> int:
    tensors = [state.absmax, getattr(state, "code", None)]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expert_bytes(model) -> dict[str, int]:
    """Bytes of the experts' weights as held now: {"16-bit": ..., "nf4": ...}."""
    held = {"16-bit": 0, "nf4": 0}
    for _, module in expert_modules(model):
        for key in EXPERT_WEIGHTS:
            packed = module._buffers.get(key + PACKED_SUFFIX)
            if packed is not None:
                held["nf4"] += packed.numel() * packed.element_size() + _state_bytes(module.nf4_states[key])
            else:
                weight = module._parameters[key]
                held["16-bit"] += weight.numel() * weight.element_size()
    return held
