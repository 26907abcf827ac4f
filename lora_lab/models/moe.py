"""Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE, gpt-oss): their experts in 4 bits.

Under transformers 5 each layer's experts are two fused 3D parameters, `gate_up_proj` and
`down_proj` ([experts, out, in], or [experts, in, out] where the module is_transposed), which
bitsandbytes' quantization of nn.Linear layers does not touch: a "QLoRA" of such a model would
keep every expert in 16 bits. `quantize_experts` stores each of them as nf4 through bitsandbytes'
parametrization of parameters (`bitsandbytes.nn.parametrize`, double-quantized statistics, as
QLoRA's linear layers): the packed bytes are the parameter's `original`, and reading
`gate_up_proj` or `down_proj` de-quantizes that layer's tensor (once per forward of the module).
The experts module keeps its transformers forward (grouped_mm: tokens sorted by expert once per
layer, one grouped product per projection). Nothing else holds 16-bit experts: with gradient
checkpointing a layer's de-quantized experts live only while that layer computes (its forward,
then its recomputation and backward). Biases (gpt-oss) stay as they are; the experts are frozen.

LoRA on the experts (lora.experts, peft's target_parameters) is attached while they are still in
16 bits, then they are quantized (adapted_experts_to); the adapter is laid out as one trained on
16-bit experts. Where the experts compute through transformers' own experts forward (not a kernel
that replaced it, e.g. liger's fused MoE), their LoRA runs in low rank on the grouped products
(expert_lora_in_low_rank): x @ W + scaling * (x @ A) @ B per expert group, so no tensor the size
of the experts is built for the adapter and the frozen experts get no weight gradient. Elsewhere
each forward adds the adapter's delta (scaling * B @ A per expert) to the experts' tensors.

gpt-oss's MXFP4 checkpoint, read de-quantized (models/load.py), has its linear layers held in
nf4 the same way (quantize_linear_layers): bitsandbytes' config cannot replace its own at load.
"""

from __future__ import annotations

from typing import Any

from ..config.rules import expert_lora_rank_grouped
from ..errors import ModelError

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert tensors of transformers 5's experts modules."""


def expert_modules(model) -> list[tuple[str, Any]]:
    """(name, module) of each experts module: one holding the fused 3D EXPERT_WEIGHTS, in 16
    bits or quantized (inside peft's wrappers too)."""
    return [(name, module) for name, module in model.named_modules() if _holds_experts(module)]


def _holds_experts(module) -> bool:
    if not hasattr(module, "num_experts"):
        return False
    return all(_packed(module, key) is not None or _plain(module, key) is not None for key in EXPERT_WEIGHTS)


def _plain(module, key: str):
    """The 16-bit 3D expert tensor `key`, or None."""
    weight = module._parameters.get(key)
    return weight if getattr(weight, "ndim", 0) == 3 else None


def _packed(module, key: str):
    """The nf4 bytes of expert tensor `key` (its parametrization's original), or None."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    parametrizations = getattr(module, "parametrizations", {})
    if key not in parametrizations or not isinstance(parametrizations[key][0], Bnb4bitParametrization):
        return None
    return parametrizations[key].original


def _state(module, key: str):
    return module.parametrizations[key][0].quant_state


def quantize_experts(model, device=None) -> int:
    """Store every experts module's fused weights as nf4 (on `device`, default where they are;
    one tensor in 16 bits at a time, so a model held on the CPU is quantized onto the GPU layer by
    layer; a module whose experts wait in the checkpoint files, models/expert_loading.py, reads
    them first). Returns the bytes the quantized experts take (packed weights and statistics)."""
    import torch

    from .expert_loading import SOURCE, read_experts, waits_for_experts

    total = 0
    for _, module in expert_modules(model):
        if _packed(module, EXPERT_WEIGHTS[0]) is None:
            if waits_for_experts(module):  # models/expert_loading.py: read from the checkpoint now
                for key in EXPERT_WEIGHTS:
                    module._parameters[key] = torch.nn.Parameter(
                        read_experts(module, key, device), requires_grad=False
                    )
                del module.__dict__[SOURCE]
            total += sum(_to_nf4(module, key, device) for key in EXPERT_WEIGHTS)
    if device is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return total


def quantize_linear_layers(model, device=None) -> int:
    """QLoRA of a checkpoint whose own quantization config was read de-quantized (gpt-oss's
    MXFP4, which bitsandbytes' config cannot replace at load): every linear layer's weight but
    the output head's, in nf4 the way the experts are (on `device`, a layer at a time). Returns
    the bytes they take."""
    import torch

    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return sum(_to_nf4(layer, "weight", device) for layer in layers if not _packed(layer, "weight"))


def _to_nf4(module, key: str, device) -> int:
    """Parameter `key` of `module` stored as bitsandbytes nf4 (double-quantized statistics) on
    `device` (None: where it is); the bytes it then takes."""
    import torch
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    weight = module._parameters[key]
    if device is not None:
        module._parameters[key] = torch.nn.Parameter(weight.data.to(device), requires_grad=False)
    del weight
    replace_parameter_4bit(module, key, compress_statistics=True, quant_type="nf4")
    if not any(hook is _states_follow_the_bytes for hook in module._forward_pre_hooks.values()):
        module.register_forward_pre_hook(_states_follow_the_bytes)
    packed = _packed(module, key)
    return packed.numel() * packed.element_size() + _state_bytes(_state(module, key))


def keep_experts_on_cpu_moving(model, device) -> None:
    """Move the model to `device`, all but its 16-bit expert tensors, which stay in CPU memory
    until quantize_experts takes them there in 4 bits."""
    held = [
        (module, {key: module._parameters.pop(key) for key in EXPERT_WEIGHTS}) for _, module in expert_modules(model)
    ]
    model.to(device)
    for module, weights in held:
        module._parameters.update(weights)


def adapted_experts_to(model, device) -> int:
    """QLoRA of a mixture of experts in training, once the adapter is attached to its 16-bit
    experts (still in CPU memory when `device` is a GPU): the experts go to `device` in 4 bits
    (quantize_experts) and their LoRA factors with them. Returns the quantized bytes. peft's
    wrappers of the expert tensors (lora.experts) then compute through expert_lora_in_low_rank."""
    from types import MethodType

    from peft.tuners.lora import ParamWrapper

    held = quantize_experts(model, device)
    for wrapper in (m for m in model.modules() if isinstance(m, ParamWrapper)):
        wrapper.get_param = MethodType(_described_param, wrapper)  # type: ignore[method-assign]
        if device is not None:
            wrapper.lora_A.to(device)
            wrapper.lora_B.to(device)
    expert_lora_in_low_rank(model)
    return held


def expert_lora_in_low_rank(model) -> int:
    """The experts' LoRA (lora.experts) computed by `_with_expert_lora`: the outermost of each
    experts module's nested peft wrappers forwards through it. Returns how many modules."""
    from types import MethodType

    from peft.tuners.lora import ParamWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    inner = {id(w.base_layer) for w in wrappers}
    outermost = [w for w in wrappers if id(w) not in inner]
    for wrapper in outermost:
        wrapper.forward = MethodType(_with_expert_lora, wrapper)  # type: ignore[method-assign]
    return len(outermost)


def _described_param(wrapper):
    """ParamWrapper.get_param for a parameter held in nf4: a tensor of its shape and dtype with no
    storage (peft reads only those from it to lay out its delta), not a de-quantized copy."""
    import torch

    state = wrapper.get_base_layer().parametrizations[wrapper.parameter_name][0].quant_state
    return torch.empty(state.shape, dtype=state.dtype, device="meta")


def _with_expert_lora(outer, x, *args, **kwargs):
    """The experts module's forward with every nested wrapper's LoRA: in low rank on the grouped
    products where the module computes through transformers' experts forward (_grouped_with_lora),
    else as peft computes it, each tensor plus its delta (_with_expert_deltas). With the adapters
    disabled (a preference task's reference) the module computes without them."""
    from peft.tuners.lora import ParamWrapper

    base = outer.get_base_layer()
    if outer.disable_adapters:
        return base(x, *args, **kwargs)
    factors, wrapper = {}, outer
    while isinstance(wrapper, ParamWrapper):
        active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
        if len(active) > 1:
            raise ModelError("LoRA on the fused experts takes one active adapter at a time")
        if active:
            factors[wrapper.parameter_name] = wrapper.get_delta_factors(active[0])
        wrapper = wrapper.base_layer
    if _computes_grouped(base, x, factors):
        return _grouped_with_lora(base, x, *args, lora=factors, **kwargs)
    if _packed(base, EXPERT_WEIGHTS[0]) is None:  # 16-bit experts: peft's own forward
        return ParamWrapper.forward(outer, x, *args, **kwargs)
    return _with_expert_deltas(base, x, args, kwargs, factors)


def _computes_grouped(base, x, factors: dict) -> bool:
    """Whether the experts module computes through transformers' experts forward (no kernel bound
    its own forward to the module, no expert parallelism or norm after the experts) and torch's
    grouped product takes this LoRA rank (config/rules.py expert_lora_rank_grouped)."""
    import torch

    transformers_forward = "forward" not in vars(base) and hasattr(base, "has_gate")
    plain = not getattr(base, "_is_expert_parallel", False) and not getattr(base, "has_post_expert_norm", False)
    aligned = all(expert_lora_rank_grouped(lhs.shape[-1], lhs.element_size()) for lhs, _, _ in factors.values())
    return transformers_forward and plain and aligned and hasattr(torch.nn.functional, "grouped_mm")


def _grouped_with_lora(module, hidden_states, top_k_index, top_k_weights, *, lora: dict):
    """transformers' grouped experts forward (integrations/moe.py grouped_mm_experts_forward:
    tokens sorted by expert once, one grouped product per projection, routing weights, the
    tokens' order restored) with each adapted tensor's LoRA in low rank on the same groups."""
    import torch

    num_top_k, num_tokens = top_k_index.size(-1), hidden_states.size(0)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // num_top_k]
    # histc, not bincount: no wait for the GPU (bincount sizes its output from the largest id)
    counts = torch.histc(
        expert_ids.float() if x.device.type == "cpu" else expert_ids.int(),
        bins=module.num_experts,
        min=0,
        max=module.num_experts - 1,
    )
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = "gate_up_proj" if module.has_gate else "up_proj"
    h = _grouped_product(module, up, x, offsets, expert_ids, lora)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    out = _grouped_product(module, "down_proj", h, offsets, expert_ids, lora)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    restore = torch.empty_like(perm)
    restore[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[restore].view(num_tokens, num_top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _grouped_product(module, key: str, x, offsets, expert_ids, lora: dict):
    """x @ W (+ bias) per expert group for expert tensor `key` (de-quantized as it is read where
    it is held in nf4), plus scaling * (x @ A) @ B where `key` carries LoRA. peft's factors are
    in the tensor's own layout (lhs @ rhs is its delta); the grouped product wants [in, out]."""
    from torch.nn.functional import grouped_mm

    weight = getattr(module, key)
    x = x.to(weight.dtype)  # peft's factors come in the tensor's dtype too (get_delta_factors)
    out = grouped_mm(x, weight if module.is_transposed else weight.transpose(-2, -1), offs=offsets)
    if key in lora:
        lhs, rhs, scaling = lora[key]
        a, b = (lhs, rhs) if module.is_transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        low = grouped_mm(x, a.contiguous(), offs=offsets) * scaling
        out = out + grouped_mm(low, b.contiguous(), offs=offsets)
    bias = getattr(module, f"{key}_bias", None) if module.has_bias else None
    return out if bias is None else out + bias[expert_ids]


def _with_expert_deltas(base, x, args: tuple, kwargs: dict, factors: dict):
    """The experts module's forward with each LoRA delta on its 4-bit tensor: each de-quantized
    tensor plus scaling * lhs @ rhs (peft's own factors and fold), the module computed once with
    them, then the deltas taken off. peft 0.21 adds each wrapper's delta as a parametrization
    nested inside the one before, which on a parameter that is already parametrized (the nf4
    de-quantization) reads the inner tensor while the outer one's cache is on and keeps it
    without its delta, and leaves a single adapter's delta in place after the forward."""
    from peft.tuners.lora.layer import _LoraFactorsProxy
    from torch.nn.utils import parametrize

    added = []
    for name, (lhs, rhs, scaling) in factors.items():
        parametrize.register_parametrization(base, name, _LoraFactorsProxy(lhs, rhs, scaling), unsafe=True)
        added.append(name)
    try:
        with parametrize.cached():
            return base(x, *args, **kwargs)
    finally:
        for name in added:
            del base.parametrizations[name][-1]


def _states_follow_the_bytes(module, _inputs) -> None:
    """A module moved after quantizing (an engine placing it) carries its packed bytes, which are
    parameters; the statistics beside them are not, and follow here."""
    for key in module.parametrizations:
        packed = _packed(module, key)
        if packed is not None and _state(module, key).absmax.device != packed.device:
            _state(module, key).to(packed.device)


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
            packed = _packed(module, key)
            if packed is not None:
                held["nf4"] += packed.numel() * packed.element_size() + _state_bytes(_state(module, key))
            else:  # a stand-in waiting for its experts (models/expert_loading.py) holds one value
                weight = module._parameters[key]
                held["16-bit"] += weight.untyped_storage().nbytes()
    return held
