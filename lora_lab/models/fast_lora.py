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
  and recomputes silu(gate) * up in the backward pass (the largest activations of a layer);
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

import torch
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from .memory_means import replaying_layer


# ----------------------------------------------------------------------------- weights

def _base_weight(base, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight [out, in] in `dtype`; bitsandbytes 4-bit weights are dequantized."""
    weight = base.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        import bitsandbytes.functional as bnb_functional

        weight = bnb_functional.dequantize_4bit(weight.data, quant_state)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _bias(base, dtype: torch.dtype):
    bias = getattr(base, "bias", None)
    return None if bias is None else bias.to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The type the products run in: autocast's where it is on, else the input's."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


# ----------------------------------------------------------------------------- adapters

def _adapter_weights(lora_as, lora_bs, dtype: torch.dtype):
    """The adapter weights in `dtype`: ([A_i], [B_i]). One multi-tensor copy casts them all
    (one kernel launch, not one per weight) into two buffers: the A blocks side by side (so that
    a stacked [A_1; A_2 ...] is a view, not a concatenation), and the B blocks. Two, not one:
    at rank 8 each stays under the caching allocator's 1 MiB line for small blocks, as the
    separate casts did (one buffer per 7B MLP, 1.08 MB, raised the reserved peak by 0.14 GiB)."""
    params = list(lora_as) + list(lora_bs)
    if all(p.dtype == dtype for p in params):
        return list(lora_as), list(lora_bs)
    views = []
    for part in (lora_as, lora_bs):
        flat = torch.empty(sum(p.numel() for p in part), dtype=dtype, device=part[0].device)
        start = 0
        for p in part:
            views.append(flat[start:start + p.numel()].view(p.shape))
            start += p.numel()
    torch._foreach_copy_(views, params)
    return views[:len(lora_as)], views[len(lora_as):]


_optimizer_steps = [0]  # optimizer steps taken in this process (any torch.optim optimizer)


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class _Casts:
    """The 16-bit copies of one call site's adapter weights (_adapter_weights), made again when
    an optimizer has stepped (fused AdamW and bitsandbytes' optimizers update in place without
    moving the version counter), a weight was changed in place otherwise (its version counter:
    a loaded checkpoint) or replaced, or another type is asked for. A new copy goes to new
    memory: the autograd calls that saved the old one keep it."""

    def __init__(self):
        self.key, self.weights = None, None

    def get(self, lora_as, lora_bs, dtype: torch.dtype):
        key = (dtype, _optimizer_steps[0],
               *((id(p), p.data_ptr(), p._version) for p in (*lora_as, *lora_bs)))
        if key != self.key:
            self.key, self.weights = key, _adapter_weights(lora_as, lora_bs, dtype)
        return self.weights


def _stacked(a16):
    """[A_1; A_2 ...] of same-width blocks: a view where they lie in order in one buffer."""
    if len(a16) == 1:
        return a16[0]
    first, rows = a16[0], sum(a.shape[0] for a in a16)
    contiguous = all(a.is_contiguous() for a in a16) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(a16, a16[1:]))
    if contiguous and first.untyped_storage().data_ptr() == a16[-1].untyped_storage().data_ptr():
        return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))
    return torch.cat(a16)


def _gradients_as(grads, dtypes):
    """Each gradient in its parameter's dtype. The casts are one multi-tensor copy per dtype into
    one buffer whose views are the gradients (autograd keeps a view as the parameter's .grad as
    it would a tensor of its own)."""
    result = list(grads)
    for dtype in dict.fromkeys(dtypes):
        picked = [i for i, (g, d) in enumerate(zip(grads, dtypes)) if d == dtype and g.dtype != d]
        if not picked:
            continue
        flat = torch.empty(sum(grads[i].numel() for i in picked), dtype=dtype,
                           device=grads[picked[0]].device)
        start = 0
        for i in picked:
            result[i] = flat[start:start + grads[i].numel()].view(grads[i].shape)
            start += grads[i].numel()
        torch._foreach_copy_([result[i] for i in picked], [grads[i] for i in picked])
    return tuple(result)


# ----------------------------------------------------------------------------- products

def _scaled_mm(a, b, scale: float):
    """scale * (a @ b) as one product: the scaling is the product's alpha, not a kernel of its
    own (beta 0: the empty input is never read)."""
    if scale == 1:
        return a @ b
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=scale)


def _project(x2, bases, a16, b16, scalings, weights=None):
    """Outputs of projections that share the input x2 [tokens, in], and x2 @ [A_1; A_2 ...].T.
    weights: the bases' 16-bit weights where the caller holds them already."""
    xa = x2 @ _stacked(a16).t()
    outputs, start = [], 0
    weights = weights or [_base_weight(base, x2.dtype) for base in bases]
    for base, weight, a, b, s in zip(bases, weights, a16, b16, scalings):
        out = F.linear(x2, weight, _bias(base, x2.dtype))
        rank = a.shape[0]
        out.addmm_(xa[:, start:start + rank], b.t(), alpha=s)
        outputs.append(out)
        start += rank
    return outputs, xa


def _project_backward(x2, xa, grads, bases, a16, b16, scalings, need_input: bool,
                      weights=None):
    """(dX, [dA_i], [dB_i]) for _project, given the gradients of its outputs. weights: the
    bases' 16-bit weights where the caller holds them already (de-quantized once for several
    calls)."""
    parts = [_scaled_mm(g, b, s) for g, b, s in zip(grads, b16, scalings)]  # [tokens, r_i]
    g_xa = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    grad_a = (g_xa.t() @ x2).split([a.shape[0] for a in a16])
    grad_b, start = [], 0
    for g, a, s in zip(grads, a16, scalings):
        rank = a.shape[0]
        grad_b.append(_scaled_mm(g.t(), xa[:, start:start + rank], s))
        start += rank
    grad_x = None
    if need_input:
        grad_x = g_xa @ _stacked(a16)
        weights = weights or [_base_weight(base, x2.dtype) for base in bases]
        for g, weight in zip(grads, weights):
            grad_x.addmm_(g, weight)
    return grad_x, list(grad_a), grad_b


class LoraProjection(torch.autograd.Function):
    """Projections of one input (one projection, or an attention's q, k and v):
    X @ W_i.T + b_i + s_i * (X @ A_i.T) @ B_i.T, with one product X @ [A_1; A_2 ...].T, one
    backward pass summing the input's gradient in place. casts: the call site's _Casts.
    params: A_1 ... A_n, B_1 ... B_n."""

    @staticmethod
    def forward(ctx, x, bases, scalings, casts, *params):
        dtype = _compute_dtype(x)
        count = len(bases)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            a16, b16 = casts.get(params[:count], params[count:], dtype)
            outputs, xa = _project(x2, bases, a16, b16, scalings)
        ctx.bases, ctx.scalings, ctx.x_dtype = bases, scalings, x.dtype
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(x2, xa, *a16, *b16)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x2, xa, *weights = ctx.saved_tensors
        count = len(ctx.bases)
        a16, b16 = weights[:count], weights[count:]
        grads = [g.reshape(-1, g.shape[-1]).to(x2.dtype) for g in grad_outs]
        grad_x, grad_a, grad_b = _project_backward(
            x2, xa, grads, ctx.bases, a16, b16, ctx.scalings, ctx.needs_input_grad[0])
        if grad_x is not None:
            grad_x = grad_x.view(*grad_outs[0].shape[:-1], x2.shape[-1]).to(ctx.x_dtype)
        return (grad_x, None, None, None) + _gradients_as(grad_a + grad_b, ctx.param_dtypes)


# ----------------------------------------------------------------------------- SwiGLU

def _swiglu(gate, up):
    try:
        from liger_kernel.ops.swiglu import swiglu_forward
    except ImportError:
        return F.silu(gate) * up
    if not gate.is_cuda:
        return F.silu(gate) * up
    return swiglu_forward(gate, up)[2]


def _swiglu_backward(gate, up, grad_h):
    """(d gate, d up); may overwrite gate and up (the saved ones are not needed afterwards)."""
    if gate.is_cuda:
        try:
            from liger_kernel.ops.swiglu import swiglu_backward
        except ImportError:
            pass
        else:
            return swiglu_backward(gate, up, grad_h)
    g = gate.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    grad_up = (grad_h.float() * silu).to(gate.dtype)
    grad_gate = (grad_h.float() * up.float() * sig * (1 + g * (1 - sig))).to(gate.dtype)
    return grad_gate, grad_up


def _sum_into(total, part):
    """A gradient summed over chunks of tokens: in fp32 from the second chunk on (the whole
    pass's product accumulates in fp32 too); one chunk stays as its product made it."""
    return part if total is None else total.float().add_(part)


def _mlp_without_graph(x, bases, scalings, casts, params, chunk_tokens: int):
    """LoraMLP's output where no gradient is taken (a checkpointed layer's first pass, an
    evaluation), chunk_tokens tokens at a time: gate, up and silu(gate) * up, the largest
    temporaries of a layer, are a chunk's. Each frozen weight is read (de-quantized) once."""
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        (ag, au, ad), (bg, bu, bd) = casts.get(params[0::2], params[1::2], dtype)
        weights = [_base_weight(base, dtype) for base in bases]
        out = x2.new_empty(x2.shape[0], bases[2].out_features)
        for start in range(0, x2.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            (gate, up), _ = _project(x2[rows], bases[:2], [ag, au], [bg, bu], scalings[:2],
                                     weights[:2])
            h = _swiglu(gate, up)
            del gate, up
            (down,), _ = _project(h, bases[2:], [ad], [bd], scalings[2:], weights[2:])
            out[rows] = down
            del h, down
    return out.view(*x.shape[:-1], out.shape[-1])


class LoraMLP(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with LoRA on all three; keeps x, gate, up.

    chunk_tokens: the backward pass through down and SwiGLU runs on at most this many tokens at
    a time (0: all), so its [tokens x intermediate] temporaries (silu(gate) * up and its
    gradient) are a chunk's; gate and up then back-propagate over all tokens at once.
    output_unread: the output's values are never read (a checkpointed layer's recomputation
    whose MLP output only enters the residual sum): the forward pass returns zeros of the
    output's shape (a stride-0 view: no memory) for the residual sum and the backward pass
    computes silu(gate) * up @ A_down.T itself. With chunk_tokens too, the forward pass keeps x
    alone and the backward pass runs the whole MLP a chunk at a time (_chunked_backward): no
    [tokens x intermediate] tensor is ever made for all tokens."""

    @staticmethod
    def forward(ctx, x, bases, scalings, output_unread, chunk_tokens, casts, a_gate, b_gate,
                a_up, b_up, a_down, b_down):
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            (ag, au, ad), (bg, bu, bd) = casts.get(
                (a_gate, a_up, a_down), (b_gate, b_up, b_down), dtype)
            gate = up = xa = ha = None
            recompute = output_unread and 0 < chunk_tokens < x2.shape[0]
            if not recompute:
                (gate, up), xa = _project(x2, bases[:2], [ag, au], [bg, bu], scalings[:2])
            if output_unread:
                out = x2.new_zeros(()).expand(x2.shape[0], bases[2].out_features)
            else:
                h = _swiglu(gate, up)
                (out,), ha = _project(h, bases[2:], [ad], [bd], scalings[2:])
        ctx.bases, ctx.scalings, ctx.x_dtype = bases, scalings, x.dtype
        ctx.chunk_tokens = chunk_tokens
        ctx.param_dtypes = [p.dtype for p in (a_gate, b_gate, a_up, b_up, a_down, b_down)]
        ctx.save_for_backward(x2, gate, up, xa, ha, ag, bg, au, bu, ad, bd)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, gate, up, xa, ha, ag, bg, au, bu, ad, bd = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(x2.dtype)
        if gate is None:
            grad_x, grads = _chunked_backward(ctx, x2, g, (ag, bg, au, bu, ad, bd))
        else:
            grad_x, grads = _saved_backward(ctx, x2, g, gate, up, xa, ha,
                                            (ag, bg, au, bu, ad, bd))
        if grad_x is not None:
            grad_x = grad_x.view(*grad_out.shape[:-1], x2.shape[-1]).to(ctx.x_dtype)
        return (grad_x, None, None, None, None, None) + _gradients_as(grads, ctx.param_dtypes)


def _saved_backward(ctx, x2, g, gate, up, xa, ha, adapters):
    """LoraMLP's backward pass from the saved gate and up: (dX, (dA_gate, dB_gate, dA_up, dB_up,
    dA_down, dB_down))."""
    ag, bg, au, bu, ad, bd = adapters
    bases, scalings = ctx.bases, ctx.scalings
    tokens = x2.shape[0]
    chunk = min(ctx.chunk_tokens or tokens, tokens)
    down = _base_weight(bases[2], x2.dtype)
    grad_ad = grad_bd = None
    # down projection and SwiGLU, a chunk of tokens at a time: gate and up are overwritten
    # with their gradients, so the [tokens x intermediate] temporaries are a chunk's
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        h = _swiglu(gate[rows], up[rows])
        h_a = h @ ad.t() if ha is None else ha[rows]  # as _project computes it forward
        grad_h, (part_ad,), (part_bd,) = _project_backward(
            h, h_a, [g[rows]], bases[2:], [ad], [bd], scalings[2:], True, [down])
        del h
        grad_ad, grad_bd = _sum_into(grad_ad, part_ad), _sum_into(grad_bd, part_bd)
        for saved, grad in zip((gate[rows], up[rows]), _swiglu_backward(
                gate[rows], up[rows], grad_h)):
            if grad.data_ptr() != saved.data_ptr():
                saved.copy_(grad)
        del grad_h
    del down
    grad_x, (grad_ag, grad_au), (grad_bg, grad_bu) = _project_backward(
        x2, xa, [gate, up], bases[:2], [ag, au], [bg, bu], scalings[:2],
        ctx.needs_input_grad[0])
    return grad_x, (grad_ag, grad_bg, grad_au, grad_bu, grad_ad, grad_bd)


def _chunked_backward(ctx, x2, g, adapters):
    """LoraMLP's backward pass from x alone, chunk_tokens tokens at a time: each chunk computes
    its gate and up, runs down and SwiGLU backward and then gate and up backward; the adapters'
    gradients are summed over the chunks. Each frozen weight is read (de-quantized) once."""
    ag, bg, au, bu, ad, bd = adapters
    bases, scalings, chunk = ctx.bases, ctx.scalings, ctx.chunk_tokens
    weights = [_base_weight(base, x2.dtype) for base in bases]
    need_input = ctx.needs_input_grad[0]
    grad_x = torch.empty_like(x2) if need_input else None
    sums = [None] * 6  # dA_gate, dB_gate, dA_up, dB_up, dA_down, dB_down
    for start in range(0, x2.shape[0], chunk):
        rows = slice(start, start + chunk)
        (gate, up), xa = _project(x2[rows], bases[:2], [ag, au], [bg, bu], scalings[:2],
                                  weights[:2])
        h = _swiglu(gate, up)
        grad_h, (part_ad,), (part_bd,) = _project_backward(
            h, h @ ad.t(), [g[rows]], bases[2:], [ad], [bd], scalings[2:], True, weights[2:])
        del h
        grad_gate, grad_up = _swiglu_backward(gate, up, grad_h)
        del grad_h, gate, up
        part_x, (part_ag, part_au), (part_bg, part_bu) = _project_backward(
            x2[rows], xa, [grad_gate, grad_up], bases[:2], [ag, au], [bg, bu], scalings[:2],
            need_input, weights[:2])
        del grad_gate, grad_up
        if need_input:
            grad_x[rows] = part_x
        parts = (part_ag, part_bg, part_au, part_bu, part_ad, part_bd)
        sums = [_sum_into(total, part) for total, part in zip(sums, parts)]
    return grad_x, tuple(sums)


# ----------------------------------------------------------------------------- wiring

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
            isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)):
        return None
    if getattr(module, "use_dora", {}).get(name, False):
        return None
    return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


class _SharedInput:
    """LoRA projections that read one input (an attention's q_proj, k_proj and v_proj): the
    first one called computes all of them in one LoraProjection, and each other one, handed the
    same input tensor, returns its output from that call. A call with another input, extra
    arguments or an adapter the fast path does not take computes that projection alone."""

    def __init__(self, modules):
        self.modules = tuple(modules)
        self.pending = {}  # id(module) -> (input, output) computed for it by a sibling's call
        self.casts = _Casts()  # the call for all modules
        self.own_casts = {id(m): _Casts() for m in self.modules}  # a module's call alone

    def forward_of(self, module):
        original = module.forward

        def forward(x, *args, **kwargs):
            if args or kwargs:
                return original(x, *args, **kwargs)
            held = self.pending.pop(id(module), None)
            if held is not None and held[0] is x:
                return held[1]
            adapters = [_plain_adapter(m) for m in self.modules]
            if any(a is None for a in adapters):
                own = adapters[self.modules.index(module)]
                if own is None:
                    return original(x)
                return LoraProjection.apply(x, (module.get_base_layer(),), (own[2],),
                                            self.own_casts[id(module)], *own[:2])[0]
            outputs = LoraProjection.apply(
                x, tuple(m.get_base_layer() for m in self.modules), tuple(a[2] for a in adapters),
                self.casts, *(a[0] for a in adapters), *(a[1] for a in adapters))
            self.pending = {id(m): (x, out) for m, out in zip(self.modules, outputs)
                            if m is not module}
            return outputs[self.modules.index(module)]

        return forward


def _fast_mlp_forward(mlp, output_to_residual: bool, chunk_tokens: int):
    """output_to_residual: the decoder layer adds the MLP's output to the residual stream and
    does nothing else with it, so a recomputation (replaying_layer) need not compute it."""
    original = mlp.forward
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    casts = _Casts()

    def forward(x):
        adapters = [_plain_adapter(p) for p in projections]
        if any(a is None for a in adapters):
            return original(x)
        bases = tuple(p.get_base_layer() for p in projections)
        scalings = tuple(a[2] for a in adapters)
        params = [t for a in adapters for t in a[:2]]
        if chunk_tokens and not torch.is_grad_enabled() and x[..., 0].numel() > chunk_tokens:
            return _mlp_without_graph(x, bases, scalings, casts, params, chunk_tokens)
        unread = output_to_residual and torch.is_grad_enabled() and replaying_layer()
        return LoraMLP.apply(x, bases, scalings, unread, chunk_tokens, casts, *params)

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
    return (all(_is_lora_linear(getattr(mlp, n, None)) for n in names)
            and (act is None or isinstance(act, torch.nn.SiLU)
                 or getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu"))


# decoder layers that end in `residual + mlp(norm(hidden))`: the MLP output goes nowhere else
RESIDUAL_MLP_LAYERS = ("Qwen2DecoderLayer", "Qwen3DecoderLayer", "LlamaDecoderLayer",
                       "MistralDecoderLayer")


def _mlps_by_layer(model) -> dict:
    """id(mlp) -> whether its decoder layer is one of RESIDUAL_MLP_LAYERS."""
    return {id(layer.mlp): type(layer).__name__ in RESIDUAL_MLP_LAYERS
            for layer in model.modules()
            if isinstance(getattr(layer, "mlp", None), torch.nn.Module)}


def apply_fast_lora(model, chunk_tokens: int = 0) -> dict:
    """Route a peft model's LoRA layers through the fast path: SwiGLU MLPs (gate, up, down with
    LoRA on all three) as one LoraMLP, every other LoRA linear layer as a LoraProjection. Each
    call checks the adapter and falls back to peft's forward where the fast path would differ.
    chunk_tokens: the MLPs run on at most this many tokens at a time where LoraMLP says so
    (0: all at once).
    Returns how many MLPs and projections were routed."""
    mlps = projections = 0
    inside_mlp, residual = set(), _mlps_by_layer(model)
    for name, module in model.named_modules():
        if name.endswith(".mlp") and _swiglu_mlp(module):
            module.forward = _fast_mlp_forward(module, residual.get(id(module), False),
                                               chunk_tokens)
            inside_mlp.update(id(getattr(module, n)) for n in ("gate_proj", "up_proj",
                                                                "down_proj"))
            mlps += 1
    groups = {}  # id(projection) -> its _SharedInput
    for module in model.modules():
        siblings = [getattr(module, n, None) for n in SHARED_INPUT_PROJECTIONS]
        if all(_fast_linear(m) for m in siblings) and \
                len({m.get_base_layer().in_features for m in siblings}) == 1:
            group = _SharedInput(siblings)
            groups.update((id(m), group) for m in siblings)
    for module in model.modules():
        if _fast_linear(module) and id(module) not in inside_mlp:
            group = groups.get(id(module)) or _SharedInput([module])
            module.forward = group.forward_of(module)
            projections += 1
    return {"mlps": mlps, "projections": projections}
