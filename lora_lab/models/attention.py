"""Attention over packed rows: each sample of a row attends only to itself."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ModelError

PACKED_ATTENTION = {"segments": "lora_lab_segments", "varlen": "lora_lab_varlen"}
CUDNN_VARLEN = "lora_lab_varlen_cudnn"
"""varlen with the cuDNN kernel for rows of equal-length samples (model.cudnn_attention auto, true)."""
"""data.packed_attention, other than the block-diagonal mask: the name each registers as a
transformers attention implementation. Both attend within each sample of a packed row only, from
the sample lengths the collator passes (no [tokens x tokens] mask):

- segments: the causal sdpa kernel once per sample (one small kernel per sample and layer).
- varlen: one flash-attention call over the whole row with the samples' cumulative lengths
  (torch.nn.attention.varlen, PyTorch >= 2.10 on CUDA, bf16/fp16); a row whose samples all have
  one length goes to sdpa's cuDNN kernel as a batch instead, where model.cudnn_attention allows.
  Where the flash kernel is not available (CPU, older PyTorch, fp32 without autocast) it
  computes the same thing as segments.

auto = varlen where it runs: one kernel call a row and no mask, where segments launches a kernel
per sample and mask builds and reads [tokens x tokens] (speeds: docs/benchmarks.md).
"""


def segments_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_lengths=None,
    **kwargs,
):
    """transformers attention function: [batch 1, heads, tokens, dim] in, [1, tokens, heads,
    dim] out. Without packed_lengths (evaluation, generation) it is plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("packed_cu_seqlens", None)
    if packed_lengths is None:
        if _LENGTHS_GIVEN.get():  # no mask was built for this row: it must not attend whole
            raise ModelError(
                "data.packed_attention: this model's decoder does not pass the "
                "packed row's sample lengths to its attention layers. Use --set "
                "data.packed_attention=mask."
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = key.shape[1] != query.shape[1]
    window = kwargs.get("sliding_window")
    outputs, start = [], 0
    for length in packed_lengths:
        part = slice(start, start + length)
        mask = sliding_causal_mask(length, window, query.device) if window is not None and length > window else None
        outputs.append(
            nn.functional.scaled_dot_product_attention(
                query[:, :, part],
                key[:, :, part],
                value[:, :, part],
                is_causal=mask is None,
                attn_mask=mask,
                scale=scaling,
                dropout_p=dropout if module.training else 0.0,
                enable_gqa=gqa,
            )
        )
        start += length
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def sliding_causal_mask(length: int, window: int, device) -> torch.Tensor:
    """[length, length], True where a token may attend: itself and the window - 1 before it
    (transformers' sliding_window: the distance stays under the window)."""
    position = torch.arange(length, device=device)
    distance = position[:, None] - position[None, :]
    return (distance >= 0) & (distance < window)


@functools.lru_cache(maxsize=1)
def flash_varlen():
    """torch.nn.attention.varlen.varlen_attn as (function, its parameter names), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _kernel_dtype(module, query, dropout: float) -> torch.dtype | None:
    """The 16-bit type a fused kernel (flash varlen, cuDNN) runs this attention in, or None where
    it cannot: fp32 outside autocast, or attention dropout while training."""
    return None if dropout and module.training else _flash_dtype(query)


def _flash_dtype(query) -> torch.dtype | None:
    """The 16-bit type flash attention runs in here, or None (fp32 outside autocast)."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def varlen_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_lengths=None,
    packed_cu_seqlens=None,
    on_cudnn: bool = False,
    **kwargs,
):
    """Like segments_attention, with one flash-attention varlen kernel for the whole row.
    on_cudnn: a row whose samples all have one length goes to cuDNN's kernel as a
    batch (registered as CUDNN_VARLEN)."""
    found = flash_varlen()
    dtype = _kernel_dtype(module, query, dropout)
    if packed_lengths is None or packed_cu_seqlens is None or not query.is_cuda or found is None or dtype is None:
        return segments_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            packed_lengths=packed_lengths,
            **kwargs,
        )
    varlen_attn, params = found
    longest = max(packed_lengths)
    window = kwargs.get("sliding_window")
    # sliding-window layers (Gemma 3, Mistral): a token sees itself and the window - 1 before it
    reach = window - 1 if window is not None and longest > window else None
    banded = reach is not None
    if banded and "window_size" not in params:
        return segments_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            packed_lengths=packed_lengths,
            **kwargs,
        )
    if len(set(packed_lengths)) == 1 and on_cudnn and not banded:
        out = cudnn_equal_lengths(query, key, value, packed_lengths, dtype, scaling)
        if out is not None:
            return out, None
    # [1, heads, tokens, dim] -> [tokens, heads, dim]
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))
    options: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:  # grouped-query attention (Qwen2.5: 7 query heads per kv head)
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    # causal within each sample: PyTorch 2.10 spells it is_causal, later versions window_size
    options.update(
        {"window_size": (reach if reach is not None else -1, 0)} if "window_size" in params else {"is_causal": True}
    )
    if scaling is not None and "scale" in params:
        options["scale"] = scaling
    cu = packed_cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **options)
    return out[None], None


LONG_ROW_TOKENS = 16384
"""An unpacked training row of one sample at least this long goes to cuDNN's kernel with
model.cudnn_attention true (long_row): its grouped-query kernel reads k and v as they are, and a
cuDNN plan for the row's shape is built once a step at most, next to a step's attention over
this many tokens."""


def long_row(query, key, attention_mask, kwargs) -> bool:
    """A row of one causal sample (no mask, no sliding window, no cached keys) of LONG_ROW_TOKENS
    or more on CUDA."""
    return (
        query.is_cuda
        and attention_mask is None
        and key.shape[2] == query.shape[2]
        and kwargs.get("sliding_window") is None
        and query.shape[0] == 1
        and query.shape[2] >= LONG_ROW_TOKENS
    )


LONG_ROWS = "lora_lab_sdpa_long_rows"
"""The attention of unpacked training rows on CUDA with model.cudnn_attention true: sdpa, with a
long row (long_row) on cuDNN's kernel."""


def sdpa_long_rows(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except that a row of one long causal sample (long_row) goes
    to cuDNN's kernel with grouped-query heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = _kernel_dtype(module, query, dropout)
    if dtype is not None and long_row(query, key, attention_mask, kwargs):
        out = cudnn_equal_lengths(query, key, value, [query.shape[2]], dtype, scaling)
        if out is not None:
            return out, None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register_long_rows_attention() -> str:
    """Make LONG_ROWS a name from_pretrained accepts (its mask is sdpa's); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(LONG_ROWS, sdpa_long_rows)
    AttentionMaskInterface.register(LONG_ROWS, sdpa_mask)
    return LONG_ROWS


_cudnn_shapes: dict[tuple, bool] = {}
"""A cache of this process: (samples, length, heads, kv heads, head dim) -> whether cuDNN took the
shape (cudnn_equal_lengths)."""


def cudnn_shapes_taken() -> list[tuple]:
    """The shapes (samples, length, heads, kv heads, head dim) cuDNN's kernel attended in this
    process (the equal-length rows of varlen, and the long unpacked rows of sdpa_long_rows)."""
    return [shape for shape, taken in _cudnn_shapes.items() if taken]


CUDNN_MAX_SHAPES = 8
"""cuDNN builds a plan for each new shape (up to seconds), so rows of ever new lengths stay on
flash after this many shapes."""


def cudnn_equal_lengths(query, key, value, lengths, dtype, scaling):
    """A row of n samples of one length L, [1, heads, n L, dim], as the batch [n, heads, L, dim]
    to sdpa's cuDNN kernel (model.cudnn_attention; speeds: docs/benchmarks.md); returns [1, n L, heads,
    dim], or None where cuDNN does not take the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, length = len(lengths), lengths[0]
    shape = (n, length, query.shape[1], key.shape[1], query.shape[-1])
    seen = _cudnn_shapes
    if not seen.get(shape, len(seen) < CUDNN_MAX_SHAPES or length >= LONG_ROW_TOKENS):
        return None
    # [1, heads, n L, dim] -> [heads, n, L, dim] -> [n, heads, L, dim]: views, no copies
    q, k, v = (t[0].to(dtype).unflatten(1, (n, length)).transpose(0, 1) for t in (query, key, value))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
            )
    except RuntimeError:  # no cuDNN kernel for this shape, dtype or GPU
        seen[shape] = False
        return None
    seen[shape] = True
    return out.transpose(1, 2).reshape(1, n * length, out.shape[1], out.shape[3])


_LENGTHS_GIVEN = contextvars.ContextVar("lora_lab_lengths_given", default=False)
"""True while a decoder runs on a packed row with its sample lengths (set and reset by the hooks
of skip_masks_of_packed_rows around the decoder's forward)."""


def _packed_attention_mask(*args, **kwargs):
    """The mask function of the packed attentions: nothing for a packed row whose sample lengths
    the attention is given (it attends from them and never reads a mask, where transformers
    would build the [tokens x tokens] block mask from the restarting position ids: 64 MiB at
    8192 tokens, held by every checkpointed layer until its backward pass); sdpa's otherwise
    (evaluation's padded batches)."""
    from transformers.masking_utils import sdpa_mask

    return None if _LENGTHS_GIVEN.get() else sdpa_mask(*args, **kwargs)


def register_packed_attention(kind: str, cudnn_equal_lengths: bool = True) -> str:
    """Make data.packed_attention `kind` (segments, varlen) a name from_pretrained accepts;
    returns it (CUDNN_VARLEN for varlen with cudnn_equal_lengths: model.cudnn_attention is not
    false). skip_masks_of_packed_rows puts its mask function to use."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = CUDNN_VARLEN if kind == "varlen" and cudnn_equal_lengths else PACKED_ATTENTION[kind]
    function: Callable[..., Any] = segments_attention
    if kind == "varlen":
        function = functools.partial(varlen_attention, on_cudnn=name == CUDNN_VARLEN)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, _packed_attention_mask)
    return name


def skip_masks_of_packed_rows(model) -> None:
    """While the model's decoder runs with packed_lengths (the packed collator's rows for
    segments and varlen), the packed attentions' mask function builds no mask."""
    decoder = model.get_decoder()

    tokens = []

    def before(module, args, kwargs):
        tokens.append(_LENGTHS_GIVEN.set(kwargs.get("packed_lengths") is not None))

    def after(module, args, kwargs, output):
        if tokens:
            _LENGTHS_GIVEN.reset(tokens.pop())

    decoder.register_forward_pre_hook(before, with_kwargs=True)
    decoder.register_forward_hook(after, with_kwargs=True, always_call=True)


def masks_from_positions(model) -> None:
    """Packed rows attended by the model's own attention (data.packed_attention settled to
    positions) in a family whose decoder builds its masks without the position ids (gpt-oss,
    registry.Family.masks_without_positions): its decoder is handed the masks transformers' own
    mask functions build from the position ids that restart at each sample, one per layer type
    (full, and sliding window), so no sample attends to another. Other decoders build them so
    themselves."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    decoder = model.get_decoder()

    def before(module, args, kwargs):
        positions, ids = kwargs.get("position_ids"), kwargs.get("input_ids")
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if kwargs.get("attention_mask") is not None or positions is None or ids is None or cached:
            return None
        shape = torch.empty((*ids.shape, 1), dtype=module.dtype, device=ids.device)  # shape, dtype only
        layer_types = set(getattr(module.config, "layer_types", None) or ["full_attention"])
        masks = {kind: makers[kind](module.config, shape, None, None, positions) for kind in layer_types}
        return args, {**kwargs, "attention_mask": masks}

    decoder.register_forward_pre_hook(before, with_kwargs=True)
