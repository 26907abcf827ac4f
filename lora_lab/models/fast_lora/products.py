"""The fast LoRA path's products (see the package docstring): the frozen weights as the
products read them, the adapters' 16-bit copies, `X @ W.T + b + s * (X @ A.T) @ B.T` and its
backward pass, and LoraProjection, the autograd function of one or several projections of one
input."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

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
    at rank 8 each stays under the caching allocator's 1 MiB line for small blocks (the A and B
    blocks of a 7B MLP together are 8 x 26,112 + 8 x 41,472 bf16 values, 1.08 MB), so the casts
    come from its small-block pool as the separate casts did, not from large segments."""
    params = list(lora_as) + list(lora_bs)
    if all(p.dtype == dtype for p in params):
        return list(lora_as), list(lora_bs)
    views = [
        view
        for part in (lora_as, lora_bs)
        for view in _views(torch.empty(sum(p.numel() for p in part), dtype=dtype, device=part[0].device), part)
    ]
    torch._foreach_copy_(views, params)
    return views[: len(lora_as)], views[len(lora_as) :]


def _views(flat: torch.Tensor, likes) -> list:
    """Views of one buffer, shaped like each of `likes` in turn."""
    views, start = [], 0
    for like in likes:
        views.append(flat[start : start + like.numel()].view(like.shape))
        start += like.numel()
    return views


class StepCounter:
    """Optimizer steps taken in this process since a fast model was built (any torch.optim
    optimizer: fused AdamW and bitsandbytes' optimizers update in place without moving the
    weights' version counters). apply_fast_lora registers it with torch's global optimizer
    step hooks when it builds the model; the hook goes with the model (or with `remove`)."""

    def __init__(self):
        self.steps = 0
        self.handle = register_optimizer_step_post_hook(self._count)

    def _count(self, optimizer, args, kwargs) -> None:
        self.steps += 1

    def remove(self) -> None:
        self.handle.remove()


class _Casts:
    """The 16-bit copies of one call site's adapter weights (_adapter_weights), made again when
    an optimizer has stepped (steps: the model's StepCounter), a weight was changed in place
    otherwise (its version counter: a loaded checkpoint) or replaced, or another type is asked
    for. A new copy goes to new memory: the autograd calls that saved the old one keep it.
    cache false (model.fast_lora_cast_cache): a new copy at every call."""

    def __init__(self, steps: StepCounter | None = None, cache: bool = True):
        self.key: tuple | None = None
        self.weights = None
        self.step_counter, self.cache = steps, cache

    def get(self, lora_as, lora_bs, dtype: torch.dtype):
        if not self.cache or self.step_counter is None:
            return _adapter_weights(lora_as, lora_bs, dtype)
        params = (*lora_as, *lora_bs)
        key = (dtype, self.step_counter.steps, *((id(p), p.data_ptr(), p._version) for p in params))
        if key != self.key:
            self.key, self.weights = key, _adapter_weights(lora_as, lora_bs, dtype)
        return self.weights


def _stacked(a16):
    """[A_1; A_2 ...] of same-width blocks: a view where they lie in order in one buffer."""
    if len(a16) == 1:
        return a16[0]
    first, rows = a16[0], sum(a.shape[0] for a in a16)
    contiguous = all(a.is_contiguous() for a in a16) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(a16, a16[1:])
    )
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
        flat = torch.empty(sum(grads[i].numel() for i in picked), dtype=dtype, device=grads[picked[0]].device)
        for i, view in zip(picked, _views(flat, [grads[i] for i in picked])):
            result[i] = view
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
        out.addmm_(xa[:, start : start + rank], b.t(), alpha=s)
        outputs.append(out)
        start += rank
    return outputs, xa


def _project_backward(x2, xa, grads, bases, a16, b16, scalings, need_input: bool, weights=None, grad_x_out=None):
    """(dX, [dA_i], [dB_i]) for _project, given the gradients of its outputs. weights: the
    bases' 16-bit weights where the caller holds them already (de-quantized once for several
    calls); grad_x_out: where dX is written (a caller's buffer, x2's own memory included: x2 is
    read before dX is written), else new memory."""
    parts = [_scaled_mm(g, b, s) for g, b, s in zip(grads, b16, scalings)]  # [tokens, r_i]
    g_xa = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    grad_a = (g_xa.t() @ x2).split([a.shape[0] for a in a16])
    grad_b, start = [], 0
    for g, a, s in zip(grads, a16, scalings):
        rank = a.shape[0]
        grad_b.append(_scaled_mm(g.t(), xa[:, start : start + rank], s))
        start += rank
    grad_x = None
    if need_input:
        grad_x = torch.mm(g_xa, _stacked(a16), out=grad_x_out)
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
            x2, xa, grads, ctx.bases, a16, b16, ctx.scalings, ctx.needs_input_grad[0]
        )
        if grad_x is not None:
            grad_x = grad_x.view(*grad_outs[0].shape[:-1], x2.shape[-1]).to(ctx.x_dtype)
        return (grad_x, None, None, None) + _gradients_as(grad_a + grad_b, ctx.param_dtypes)
