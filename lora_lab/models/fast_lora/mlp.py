"""The fast LoRA path's SwiGLU MLP (see the package docstring): down(silu(gate(x)) * up(x)) with
LoRA on all three as one autograd function, LoraMLP, and the same MLP a chunk of tokens at a time
where no gradient is taken."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .products import _base_weight, _compute_dtype, _gradients_as, _project, _project_backward, _views

# The backward pass through down and SwiGLU from saved gate and up (LoraMLP without chunks)
# runs on at most this many tokens at a time: silu(gate) * up, rewritten as its gradient, is a
# chunk's (74 MiB instead of 296 for a 7B row of 8192 tokens), for about a dozen more kernel
# launches a chunk on a GPU and no more compute (`bench/op_count.py --down-backward-tokens`).
# Smaller chunks lower the peak and add launches, which weigh most where a step waits on the
# host (small models); what 2048 does to each preset's peak and speed is in docs/benchmarks.md.
# 0: all tokens at once.
DOWN_BACKWARD_TOKENS = 2048
"""The default of model.fast_lora_down_backward_tokens (FastLoraOptions.down_backward_tokens)."""


def _swiglu(gate, up, over_gate: bool = False):
    """silu(gate) * up; over_gate: written over gate (where gate is not read afterwards: no
    new [tokens x intermediate] tensor) by PyTorch's in-place silu and product, which compute
    it as liger's kernel does (silu in fp32, rounded to the inputs' type, times up)."""
    if over_gate:
        return F.silu(gate, inplace=True).mul_(up)
    if gate.is_cuda:  # liger's kernel; not imported off CUDA (a failed import searches the path)
        try:
            from liger_kernel.ops.swiglu import swiglu_forward
        except ImportError:
            pass
        else:
            return swiglu_forward(gate, up)[2]
    return F.silu(gate) * up


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


def in_chunks(tokens: int, chunk_tokens: int) -> bool:
    """Whether chunk_tokens (0: off) splits `tokens` into more than one chunk."""
    return 0 < chunk_tokens < tokens


def _mlp_without_graph(x, bases, scalings, casts, params, chunk_tokens: int):
    """LoraMLP's output where no gradient is taken (a checkpointed layer's first pass, an
    evaluation), chunk_tokens tokens at a time (0: all): gate and up, the largest temporaries
    of a layer, are a chunk's, and silu(gate) * up is written over gate. Each frozen weight is
    read (de-quantized) once."""
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        (ag, au, ad), (bg, bu, bd) = casts.get(params[0::2], params[1::2], dtype)
        weights = [_base_weight(base, dtype) for base in bases]
        out = x2.new_empty(x2.shape[0], bases[2].out_features)
        chunk_tokens = chunk_tokens or max(x2.shape[0], 1)  # an empty input: no chunk
        for start in range(0, x2.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            (gate, up), _ = _project(x2[rows], bases[:2], [ag, au], [bg, bu], scalings[:2], weights[:2])
            h = _swiglu(gate, up, over_gate=True)
            del gate, up
            (down,), _ = _project(h, bases[2:], [ad], [bd], scalings[2:], weights[2:])
            out[rows] = down
            del h, down
    return out.view(*x.shape[:-1], out.shape[-1])


class LoraMLP(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with LoRA on all three; keeps x, and gate and up unless the
    whole MLP runs in chunks (below).

    chunks: (chunk_tokens, down_backward_tokens). The backward pass through down and SwiGLU runs
    on at most chunk_tokens tokens at a time (0: down_backward_tokens; 0 too: all), so its [tokens x intermediate] temporaries (silu(gate) *
    up and its gradient) are a chunk's; saved gate and up then back-propagate over all tokens
    at once.
    output_unread: the output's values are never read (a checkpointed layer's recomputation
    whose MLP output only enters the residual sum): the forward pass returns zeros of the
    output's shape (a stride-0 view: no memory) for the residual sum and the backward pass
    computes silu(gate) * up @ A_down.T itself. With chunk_tokens too, the forward pass keeps x
    alone and the backward pass runs the whole MLP a chunk at a time (_chunked_backward): no
    [tokens x intermediate] tensor is ever made for all tokens."""

    @staticmethod
    def forward(ctx, x, bases, scalings, output_unread, chunks, casts, a_gate, b_gate, a_up, b_up, a_down, b_down):
        dtype = _compute_dtype(x)
        chunk_tokens, ctx.down_backward_tokens = chunks
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            (ag, au, ad), (bg, bu, bd) = casts.get((a_gate, a_up, a_down), (b_gate, b_up, b_down), dtype)
            gate = up = xa = ha = None
            if not (output_unread and in_chunks(x2.shape[0], chunk_tokens)):
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
            grad_x, grads = _saved_backward(ctx, x2, g, gate, up, xa, ha, (ag, bg, au, bu, ad, bd))
        if grad_x is not None:
            grad_x = grad_x.view(*grad_out.shape[:-1], x2.shape[-1]).to(ctx.x_dtype)
        return (grad_x, None, None, None, None, None) + _gradients_as(grads, ctx.param_dtypes)


def _down_backward(h, h_a, g, bases, ad, bd, scalings, down):
    """The down projection's backward pass for one chunk: (d h, [dA_down], [dB_down]). d h is
    written over h (h is read only by dA_down, which comes first), so a chunk holds one
    [tokens x intermediate] tensor fewer."""
    return _project_backward(h, h_a, [g], bases[2:], [ad], [bd], scalings[2:], True, [down], grad_x_out=h)


def _saved_backward(ctx, x2, g, gate, up, xa, ha, adapters):
    """LoraMLP's backward pass from the saved gate and up: (dX, (dA_gate, dB_gate, dA_up, dB_up,
    dA_down, dB_down))."""
    ag, bg, au, bu, ad, bd = adapters
    bases, scalings = ctx.bases, ctx.scalings
    tokens = x2.shape[0]
    chunk = max(1, min(ctx.chunk_tokens or ctx.down_backward_tokens or tokens, tokens))
    down = _base_weight(bases[2], x2.dtype)
    grad_ad = grad_bd = None
    # down projection and SwiGLU, a chunk of tokens at a time: gate and up are overwritten
    # with their gradients, so the [tokens x intermediate] temporaries are a chunk's
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        h = _swiglu(gate[rows], up[rows])
        h_a = h @ ad.t() if ha is None else ha[rows]  # as _project computes it forward
        grad_h, (part_ad,), (part_bd,) = _down_backward(h, h_a, g[rows], bases, ad, bd, scalings, down)
        grad_ad, grad_bd = _sum_into(grad_ad, part_ad), _sum_into(grad_bd, part_bd)
        for saved, grad in zip((gate[rows], up[rows]), _swiglu_backward(gate[rows], up[rows], grad_h)):
            if grad.data_ptr() != saved.data_ptr():
                saved.copy_(grad)
        del grad_h, h
    del down
    grad_x, (grad_ag, grad_au), (grad_bg, grad_bu) = _project_backward(
        x2, xa, [gate, up], bases[:2], [ag, au], [bg, bu], scalings[:2], ctx.needs_input_grad[0]
    )
    return grad_x, (grad_ag, grad_bg, grad_au, grad_bu, grad_ad, grad_bd)


def _chunked_backward(ctx, x2, g, adapters):
    """LoraMLP's backward pass from x alone, chunk_tokens tokens at a time: each chunk computes
    its gate and up, runs down and SwiGLU backward and then gate and up backward; the adapters'
    gradients are summed over the chunks in one fp32 buffer (one multi-tensor add a chunk: the
    small models' steps are bound by the host's launches). Each frozen weight is read
    (de-quantized) once."""
    ag, bg, au, bu, ad, bd = adapters
    bases, scalings, chunk = ctx.bases, ctx.scalings, ctx.chunk_tokens
    weights = [_base_weight(base, x2.dtype) for base in bases]
    need_input = ctx.needs_input_grad[0]
    grad_x = torch.empty_like(x2) if need_input else None
    sums = _views(
        torch.zeros(
            sum(a.numel() for a in adapters), device=x2.device, dtype=torch.promote_types(x2.dtype, torch.float32)
        ),
        adapters,
    )
    for start in range(0, x2.shape[0], chunk):
        rows = slice(start, start + chunk)
        (gate, up), xa = _project(x2[rows], bases[:2], [ag, au], [bg, bu], scalings[:2], weights[:2])
        h = _swiglu(gate, up)
        grad_h, (part_ad,), (part_bd,) = _down_backward(h, h @ ad.t(), g[rows], bases, ad, bd, scalings, weights[2])
        grad_gate, grad_up = _swiglu_backward(gate, up, grad_h)
        del grad_h, h, gate, up
        _, (part_ag, part_au), (part_bg, part_bu) = _project_backward(
            x2[rows],
            xa,
            [grad_gate, grad_up],
            bases[:2],
            [ag, au],
            [bg, bu],
            scalings[:2],
            need_input,
            weights[:2],
            grad_x[rows] if need_input else None,
        )
        del grad_gate, grad_up
        torch._foreach_add_(sums, [part_ag, part_bg, part_au, part_bu, part_ad, part_bd])
    return grad_x, tuple(sums)
