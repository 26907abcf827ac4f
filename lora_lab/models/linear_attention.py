"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet): each sample starts
from a zero recurrent state and an empty causal-conv window, as it would alone.

A Gated DeltaNet layer carries a recurrent state and a 4-token convolution window along the
sequence; run over a packed row as one sequence, the second sample would start from the first
one's state. transformers passes neither the sample boundaries nor a mask to these layers in
training, so `keep_samples_apart` wraps every such layer:

- per sample: the layer's own forward once per sample of the row (exact on every device);
- on CUDA with flash-linear-attention installed (fla-core), one call over the whole row with the
  samples' cumulative lengths (`cu_seqlens`), which fla's conv and gated delta rule kernels
  restart at (`gated_delta_varlen`).

The sample lengths come from the collator (packed_lengths) or, for a row with a block mask,
from its position ids, which restart at 0 at every sample; they ride in the decoder's keyword
arguments, so a recomputed (checkpointed) layer sees them again in the backward pass.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect

import torch

from ..errors import ModelError

SAMPLE_LENGTHS = "linear_attention_lengths"
"""The decoder keyword that carries a packed row's sample lengths to the wrapped layers."""


def linear_attention_layers(model) -> list:
    """The model's linear-attention modules (Gated DeltaNet: in_proj_qkv, conv1d, A_log)."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "conv1d") and hasattr(module, "A_log") and hasattr(module, "in_proj_qkv")
    ]


def lengths_from_positions(position_ids) -> list[int] | None:
    """Sample lengths of one packed row from its position ids (a sample starts where they are 0);
    None for a batch of several rows or a row of one sample."""
    if position_ids is None:
        return None
    positions = position_ids[0] if position_ids.ndim == 3 else position_ids  # Qwen3.5's [4, rows, tokens]
    if positions.shape[0] != 1:
        return None
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0 or len(starts) < 2:
        return None
    bounds = starts + [positions.shape[1]]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def fla_installed() -> bool:
    """flash-linear-attention (fla-core) is importable here."""
    return importlib.util.find_spec("fla") is not None


@functools.lru_cache(maxsize=1)
def fla_kernels():
    """flash-linear-attention's (causal_conv1d, chunk_gated_delta_rule), or None where it is not
    installed; imported only on a CUDA run."""
    if not fla_installed():
        return None
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    why = fla_backward_refusal()
    if why:
        from ..log import get_logger

        get_logger().info(f"linear attention: each sample of a packed row runs on its own ({why})")
        return None
    return causal_conv1d, chunk_gated_delta_rule


def fla_backward_refusal() -> str | None:
    """Why fla's gated delta rule cannot train here, or None: fla refuses its gated backward
    on Hopper GPUs with Triton from 3.4.0 to before 3.7.1 (wrong gradients there) unless
    tilelang provides the kernel; its forward would run and the first backward would stop."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    return (
        "flash-linear-attention's gated backward does not run on this Hopper GPU with this "
        "Triton; pip install 'triton>=3.7.1' or tilelang to use its varlen kernels"
    )


DELTA_RULE = "torch_chunk_gated_delta_rule"
"""transformers' chunked gated delta rule in a Gated DeltaNet family's modeling module: a function
wrapped to call fla's kernel wherever fla is installed and the inputs are on CUDA."""


@contextlib.contextmanager
def torch_delta_rule_where_fla_refuses(model_type: str | None):
    """Where fla refuses its gated backward (fla_backward_refusal: Hopper with Triton 3.4-3.7.0),
    transformers' own Gated DeltaNet layers would still call fla's chunk kernel on every sequence
    and the first backward would stop the run. Inside the context the family's modeling module
    calls the torch delta rule the wrapper falls back to (exact, slower); put back on exit."""
    module = _delta_rule_module(model_type)
    if module is None or not torch.cuda.is_available() or fla_kernels() is not None:
        yield
        return
    wrapped = getattr(module, DELTA_RULE)
    setattr(module, DELTA_RULE, torch_function_of(wrapped))
    try:
        yield
    finally:
        setattr(module, DELTA_RULE, wrapped)


def torch_function_of(function):
    """transformers' torch function under its kernel wrappers: its own wrapper keeps it as
    __wrapped__; with the `kernels` package installed that wrapper sits inside a Func module, in
    its forward's closure."""
    forward = getattr(type(function), "forward", None)
    if isinstance(function, torch.nn.Module) and forward is not None:
        inner = [cell.cell_contents for cell in forward.__closure__ or () if inspect.isfunction(cell.cell_contents)]
        function = inner[0] if len(inner) == 1 else function
    return inspect.unwrap(function)


def _delta_rule_module(model_type: str | None):
    """The modeling module of a family with transformers' gated delta rule, where fla is installed."""
    if not model_type or not fla_installed():
        return None
    family = model_type.removesuffix("_text")
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None
    return module if hasattr(module, DELTA_RULE) else None


def gated_delta_varlen(layer, hidden_states, cu_seqlens, conv_fn, rule_fn):
    """One Gated DeltaNet layer over a packed row [1, tokens, hidden] whose samples start at
    cu_seqlens: the layer's projections, its conv and gated delta rule restarted at every
    sample (conv_fn, rule_fn: fla's kernels, which take cu_seqlens), its gated norm and output.
    Mirrors transformers' Qwen3_5GatedDeltaNet.forward without a cache."""
    import torch.nn.functional as F

    _, tokens, _ = hidden_states.shape
    mixed_qkv = layer.in_proj_qkv(hidden_states)
    z = layer.in_proj_z(hidden_states).reshape(1, tokens, -1, layer.head_v_dim)
    b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    weight = layer.conv1d.weight.squeeze(1)
    mixed_qkv = conv_fn(
        x=mixed_qkv, weight=weight, bias=layer.conv1d.bias, activation=layer.activation, cu_seqlens=cu_seqlens
    )
    if isinstance(mixed_qkv, tuple):  # fla returns (output, final state)
        mixed_qkv = mixed_qkv[0]
    query, key, value = torch.split(mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(1, tokens, -1, layer.head_k_dim)
    key = key.reshape(1, tokens, -1, layer.head_k_dim)
    value = value.reshape(1, tokens, -1, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    if layer.num_v_heads > layer.num_k_heads:  # grouped value heads: each key head serves several
        repeat = layer.num_v_heads // layer.num_k_heads
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    out, _ = rule_fn(
        query,
        key,
        value,
        g=g,
        beta=beta,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
        output_final_state=False,
    )
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(1, tokens, -1))


def _wrap(layer, use_fla: bool) -> None:
    original = layer.forward

    def forward(hidden_states, *args, **kwargs):
        lengths = kwargs.pop(SAMPLE_LENGTHS, None)
        if not lengths or len(lengths) < 2:
            return original(hidden_states, *args, **kwargs)
        if hidden_states.shape[0] != 1 or sum(lengths) != hidden_states.shape[1]:
            raise ModelError(
                "data.packing: a packed row's sample lengths do not add up to its tokens "
                "in a linear-attention layer. Use --set data.packing=false."
            )
        found = fla_kernels() if use_fla and hidden_states.is_cuda else None
        if found is not None:
            ends = torch.tensor(lengths, device=hidden_states.device).cumsum(0)
            cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.long)
            return gated_delta_varlen(layer, hidden_states, cu_seqlens, *found)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "cache", "cache_params")}
        parts = torch.split(hidden_states, lengths, dim=1)
        return torch.cat([original(part, **kwargs) for part in parts], dim=1)

    layer.forward = forward


ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}
"""Layer kinds (config.json layer_types) whose only link between tokens is attention, which the
packed row's mask or sample lengths keep within each sample."""


def _refuse_packed_rows(model, kinds: list) -> None:
    """A model with stateful layers lora-lab cannot restart: a packed row is refused when it
    arrives (rows of one sample and unpacked batches train as usual)."""

    def before(module, args, kwargs):
        given = kwargs.get("packed_lengths")
        lengths = list(given) if given is not None else lengths_from_positions(kwargs.get("position_ids"))
        if lengths and len(lengths) > 1:
            raise ModelError(
                f"data.packing: this model's {', '.join(kinds)} layers carry a state from one token to the "
                f"next, and lora-lab cannot restart it at each sample of a packed row (the samples would mix). "
                f"Use --set data.packing=false."
            )

    model.get_decoder().register_forward_pre_hook(before, with_kwargs=True)


def keep_samples_apart(model, use_fla: bool = True) -> int:
    """Make every linear-attention layer of `model` restart at each sample of a packed row;
    returns how many layers were wrapped (0: the model has none, nothing changes). A model
    whose config names other stateful layer kinds (not attention, not Gated DeltaNet) refuses
    packed rows with one message instead."""
    layers = linear_attention_layers(model)
    if not layers:
        kinds = getattr(model.config, "layer_types", None) or []
        stateful = sorted({k for k in kinds if isinstance(k, str)} - ATTENTION_KINDS)
        if stateful:
            _refuse_packed_rows(model, stateful)
        return 0
    for layer in layers:
        _wrap(layer, use_fla)

    def before(module, args, kwargs):
        lengths = kwargs.pop("packed_lengths", None)
        found = list(lengths) if lengths is not None else lengths_from_positions(kwargs.get("position_ids"))
        if lengths is not None:
            kwargs["packed_lengths"] = lengths  # the packed attentions read it too
        kwargs[SAMPLE_LENGTHS] = found
        return args, kwargs

    model.get_decoder().register_forward_pre_hook(before, with_kwargs=True)
    return len(layers)
