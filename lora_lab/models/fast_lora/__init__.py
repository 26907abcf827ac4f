"""Fast LoRA projections: the LoRA branch in the activations' 16-bit type, with hand-written
backward passes, in place of peft's per-module forward.

peft's lora.Linear casts its input to the adapter weights' dtype (fp32) before the LoRA branch,
so every LoRA call copies a [tokens x in_features] activation to fp32 and autocast copies it back
to bf16 for the matrix product; with dropout > 0 the dropout runs on the fp32 copy, and autograd
keeps that fp32 copy for the backward pass. Here the small adapter weights are cast to the
activations' type instead, and:

- every projection computes `X @ W.T + b + s * (X @ A.T) @ B.T` in one autograd function that
  saves only X and X @ A.T (the frozen W is re-read, or re-dequantized for nf4, in backward);
- projections of one input share it: q_proj, k_proj and v_proj are one autograd function, and
  so are gate_proj and up_proj: one product with [A_q; A_k; A_v], one backward pass for all;
- each call site casts its adapter weights to 16 bits in one multi-tensor copy, once while the
  weights stay unchanged (_Casts: the forward pass, the checkpoint's recomputation and every
  micro-batch of an optimizer step share it), and their gradients back to the weights' types
  in one more; the scalings are the products' alpha;
- the SwiGLU MLP (down(silu(gate(x)) * up(x))) is one autograd function that keeps gate and up
  and recomputes silu(gate) * up in the backward pass (the largest activations of a layer), a
  chunk of at most FastLoraOptions.down_backward_tokens tokens at a time; run without autograd (a
  checkpointed layer's first pass, an evaluation) it writes silu(gate) * up over gate;
- where a checkpointed layer is recomputed for its backward pass (models.memory_means
  replay_backward) and its MLP output only enters the residual sum, the recomputation stops the
  MLP after gate and up: the down projection's output is never read in the backward pass;
- with chunk_tokens (model.fast_lora_chunk_tokens), an MLP run without autograd (a checkpointed
  layer's first pass) and the recomputed one's backward pass go a chunk of tokens at a time, so
  a layer's largest temporaries (gate, up, silu(gate) * up, their gradients) are a chunk's.

The arithmetic is the plain path's (16-bit products with fp32 accumulation, fp32 adapter
weights and gradients); tests/unit/test_fast_lora.py checks loss and gradients against peft.
Used only where it is exact: no dropout on the adapters (peft would apply it, this path does
not), plain LoRA (no DoRA or other variants), adapters not merged or disabled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..memory_means import replaying_layer
from .mlp import DOWN_BACKWARD_TOKENS, LoraMLP, _mlp_without_graph
from .products import LoraProjection, StepCounter, _Casts


@dataclass(frozen=True)
class FastLoraOptions:
    """How the fast path builds its layers (the model.fast_lora_* settings)."""

    chunk_tokens: int = 0
    """model.fast_lora_chunk_tokens: MLPs run on at most this many tokens at a time where
    LoraMLP says so (0: all at once)."""
    down_backward_tokens: int = DOWN_BACKWARD_TOKENS
    """model.fast_lora_down_backward_tokens: LoraMLP's backward pass from saved gate and up,
    a chunk of at most this many tokens at a time (0: all at once)."""
    residual_skip: bool = True
    """model.fast_lora_residual_skip: a recomputed RESIDUAL_MLP_LAYERS layer's MLP stops after
    gate and up."""
    shared_input: bool = True
    """model.fast_lora_shared_input: SHARED_INPUT_PROJECTIONS computed in one call."""
    cast_cache: bool = True
    """model.fast_lora_cast_cache: a call site's 16-bit adapter weights kept between calls."""

    @classmethod
    def of(cls, model_args) -> FastLoraOptions:
        """The options a config's model section (ModelArgs) asks for."""
        return cls(
            chunk_tokens=model_args.fast_lora_chunk_tokens,
            down_backward_tokens=model_args.fast_lora_down_backward_tokens,
            residual_skip=model_args.fast_lora_residual_skip,
            shared_input=model_args.fast_lora_shared_input,
            cast_cache=model_args.fast_lora_cast_cache,
        )


def _plain_adapter(module):
    """(A, B, scaling) of the one active plain-LoRA adapter of a peft layer, or None where the
    fast path would not compute what peft computes (dropout, variants, merged, disabled)."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return None
    adapters = list(getattr(module, "active_adapters", []))
    if len(adapters) != 1:
        return None
    name = adapters[0]
    if name not in module.lora_A or name in getattr(module, "lora_variant", {}):
        return None
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and not (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    ):
        return None
    if getattr(module, "use_dora", {}).get(name, False):
        return None
    return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


class _SharedInput:
    """LoRA projections that read one input (an attention's q_proj, k_proj and v_proj): the
    first one called computes all of them in one LoraProjection, and each other one, handed the
    same input tensor, returns its output from that call. A call with another input, extra
    arguments or an adapter the fast path does not take computes that projection alone."""

    def __init__(self, modules, new_casts):
        self.modules = tuple(modules)
        self.pending = {}  # id(module) -> (input, output) computed for it by a sibling's call
        self.casts = new_casts()  # the call for all modules
        self.own_casts = {id(m): new_casts() for m in self.modules}  # a module's call alone

    def forward_of(self, module):
        original = module.forward

        def forward(x, *args, **kwargs):
            if args or kwargs or torch.compiler.is_compiling():  # compiled: peft's own, traceable
                return original(x, *args, **kwargs)
            held = self.pending.pop(id(module), None)
            if held is not None and held[0] is x:
                return held[1]
            adapters = [_plain_adapter(m) for m in self.modules]
            if any(a is None for a in adapters):
                own = adapters[self.modules.index(module)]
                if own is None:
                    return original(x)
                return LoraProjection.apply(
                    x, (module.get_base_layer(),), (own[2],), self.own_casts[id(module)], *own[:2]
                )[0]
            outputs = LoraProjection.apply(
                x,
                tuple(m.get_base_layer() for m in self.modules),
                tuple(a[2] for a in adapters),
                self.casts,
                *(a[0] for a in adapters),
                *(a[1] for a in adapters),
            )
            self.pending = {id(m): (x, out) for m, out in zip(self.modules, outputs) if m is not module}
            return outputs[self.modules.index(module)]

        return forward


def _fast_mlp_forward(mlp, output_to_residual: bool, options: FastLoraOptions, casts: _Casts):
    """output_to_residual: the decoder layer adds the MLP's output to the residual stream and
    does nothing else with it, so a recomputation (replaying_layer) need not compute it."""
    original = mlp.forward
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    chunk_tokens, down_tokens = options.chunk_tokens, options.down_backward_tokens

    def forward(x):
        if torch.compiler.is_compiling():  # a compiled step (grpo.static_cache): peft's own, traceable
            return original(x)
        adapters = [_plain_adapter(p) for p in projections]
        if any(a is None for a in adapters):
            return original(x)
        bases = tuple(p.get_base_layer() for p in projections)
        scalings = tuple(a[2] for a in adapters)
        params = [t for a in adapters for t in a[:2]]
        if not torch.is_grad_enabled():
            return _mlp_without_graph(x, bases, scalings, casts, params, chunk_tokens)
        unread = output_to_residual and replaying_layer()
        return LoraMLP.apply(x, bases, scalings, unread, (chunk_tokens, down_tokens), casts, *params)

    return forward


def _is_lora_linear(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def _fast_linear(module) -> bool:
    """A peft LoRA layer over a linear layer whose weight the fast path reads."""
    return _is_lora_linear(module) and hasattr(module.get_base_layer(), "weight")


# an attention's projections of one input, computed together where all carry LoRA
SHARED_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _swiglu_mlp(mlp) -> bool:
    act = getattr(mlp, "act_fn", None)
    names = ("gate_proj", "up_proj", "down_proj")
    return all(_is_lora_linear(getattr(mlp, n, None)) for n in names) and (
        act is None
        or isinstance(act, torch.nn.SiLU)
        or getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu"
    )


# decoder layers that end in `residual + mlp(norm(hidden))`: the MLP output goes nowhere else
RESIDUAL_MLP_LAYERS = ("Qwen2DecoderLayer", "Qwen3DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer")


def _mlps_by_layer(model) -> dict:
    """id(mlp) -> whether its decoder layer is one of RESIDUAL_MLP_LAYERS."""
    return {
        id(layer.mlp): type(layer).__name__ in RESIDUAL_MLP_LAYERS
        for layer in model.modules()
        if isinstance(getattr(layer, "mlp", None), torch.nn.Module)
    }


def apply_fast_lora(model, options: FastLoraOptions = FastLoraOptions()) -> dict:
    """Route a peft model's LoRA layers through the fast path: SwiGLU MLPs (gate, up, down with
    LoRA on all three) as one LoraMLP, every other LoRA linear layer as a LoraProjection. Each
    call checks the adapter and falls back to peft's forward where the fast path would differ.
    The model's StepCounter (the optimizer step hook its casts read) is registered here and
    removed with the model (and by training/process.restored_optimizer_hooks when a run ends).
    Returns how many MLPs and projections were routed."""
    steps = StepCounter()
    weakref.finalize(model, steps.remove)
    model.__dict__[STEP_COUNTER] = steps

    def new_casts() -> _Casts:
        return _Casts(steps, options.cast_cache)

    mlps = projections = 0
    inside_mlp: set[int] = set()
    residual = _mlps_by_layer(model) if options.residual_skip else {}
    for name, module in model.named_modules():
        if name.endswith(".mlp") and _swiglu_mlp(module):
            module.forward = _fast_mlp_forward(module, residual.get(id(module), False), options, new_casts())
            inside_mlp.update(id(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))
            mlps += 1
    groups: dict[int, _SharedInput] = {}  # id(projection) -> its _SharedInput
    for module in model.modules() if options.shared_input else ():
        siblings: list[Any] = [getattr(module, n, None) for n in SHARED_INPUT_PROJECTIONS]
        if all(_fast_linear(m) for m in siblings) and len({m.get_base_layer().in_features for m in siblings}) == 1:
            group = _SharedInput(siblings, new_casts)
            groups.update((id(m), group) for m in siblings)
    for module in model.modules():
        if _fast_linear(module) and id(module) not in inside_mlp:
            group = groups.get(id(module)) or _SharedInput([module], new_casts)
            module.forward = group.forward_of(module)
            projections += 1
    return {"mlps": mlps, "projections": projections}


STEP_COUNTER = "lora_lab_step_counter"
"""Where apply_fast_lora keeps a model's StepCounter (in the model's own __dict__)."""
