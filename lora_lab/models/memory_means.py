"""Memory means for long sequences on one GPU. Which of them a run uses is decided by
planning.memory.choose_memory_means (the planner counts the same), and `apply_memory_means` puts
them in place:

- the input embedding lives in CPU memory (1.02 GiB of Qwen2.5-7B's 16-bit weights): the
  lookup of a few thousand rows runs on the CPU and only the result is copied to the GPU;
- each decoder layer's checkpoint (its input, one bf16 hidden state per token) waits in pinned
  CPU memory between the forward and the backward pass, instead of 28 of them on the GPU;
- the MLP, whose [tokens x 18944] intermediates are the largest tensors of a recomputed layer,
  runs in chunks of tokens, each recomputed on its own during the backward pass.

The checkpoint is a reentrant one (like torch.utils.checkpoint with use_reentrant=True): the
layer runs without autograd in the forward pass and again with it in the backward pass, with the
same random state (dropout) and autocast settings. It serves one process only: the gradients of
the recomputed layer reach the LoRA weights from a nested backward call, which DDP and DeepSpeed
do not watch. The arithmetic is unchanged; tests/unit/test_memory_means.py checks that loss and
gradients equal the plain path's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch import nn

from ..errors import ConfigError
from .host_memory import HostSlab, host_copy, slab_bytes

# ----------------------------------------------------------------------------- embedding


class CpuEmbedding(nn.Module):
    """An input embedding whose table stays in CPU memory (frozen: it is not a parameter, so
    `model.to("cuda")` leaves it where it is). Returns the vectors on the model's device.

    Ids given on the CPU (the Trainer leaves them there: LoraLabTrainer._prepare_inputs) are
    looked up straight into pinned memory and copied to the GPU without waiting; ids on the GPU
    are first copied back, which waits for the GPU."""

    device_marker: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.table = embedding.weight.detach().to("cpu")
        self.padding_idx = embedding.padding_idx
        self.num_embeddings, self.embedding_dim = self.table.shape
        # where the vectors go: the old table's device, and wherever model.to(...) moves it
        self.register_buffer("device_marker", torch.empty(0, device=embedding.weight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.table

    @torch.compiler.disable  # a compiled decoding step (grpo.static_cache) calls it as it is
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        target = input_ids.device if input_ids.is_cuda else self.device_marker.device
        ids = input_ids.to("cpu").reshape(-1)
        pinned = target.type == "cuda"
        vectors = torch.empty((ids.numel(), self.embedding_dim), dtype=self.table.dtype, pin_memory=pinned)
        torch.index_select(self.table, 0, ids, out=vectors)
        vectors = vectors.view(*input_ids.shape, self.embedding_dim)
        return vectors.to(target, non_blocking=True) if pinned else vectors

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, in CPU memory"


def uses_cpu_embedding(model) -> bool:
    """Whether `model`'s input embedding is a CpuEmbedding (its ids are best kept on the CPU)."""
    get = getattr(model, "get_input_embeddings", None)
    return get is not None and isinstance(get(), CpuEmbedding)


def move_embedding_to_cpu(model) -> bool:
    """Swap the input embedding for a CpuEmbedding; not for tied embeddings (the output head
    shares the table and must stay on the GPU). Returns whether it moved."""
    if model.config.tie_word_embeddings:
        return False
    old = model.get_input_embeddings()
    model.set_input_embeddings(CpuEmbedding(old))
    del old
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True


# ----------------------------------------------------------------------------- checkpoints


def _autocast_state() -> dict:
    return {
        device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cuda", "cpu")
    }


def _autocast(state: dict) -> contextlib.ExitStack:
    """Re-enter the forward pass's autocast settings during the recomputation."""
    stack = contextlib.ExitStack()
    for device, (enabled, dtype) in state.items():
        if device == "cpu" or torch.cuda.is_available():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
    return stack


def _to_host(tensor: torch.Tensor, slab: HostSlab | None = None) -> torch.Tensor:
    """A copy in (pinned) CPU memory, in `slab` where it has room; the copy is queued on the
    current stream, so the GPU memory it reads is not reused before the copy is done."""
    host = host_copy(tensor, slab)
    host.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")
    return host


class OffloadedCheckpoint(torch.autograd.Function):
    """Run a layer without autograd; in the backward pass fetch its input back from CPU memory
    (`slab`'s pinned memory, models/host_memory.py), run it again with autograd (same random
    state and autocast) and back-propagate through it."""

    @staticmethod
    def forward(ctx, run_function, slab, hidden_states, *args):
        ctx.run_function, ctx.args = run_function, args
        ctx.device = hidden_states.device
        ctx.autocast = _autocast_state()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
        ctx.host_input = _to_host(hidden_states, slab)
        with torch.no_grad():
            return run_function(hidden_states, *args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        hidden = ctx.host_input.to(ctx.device, non_blocking=True).requires_grad_(True)
        ctx.host_input = None  # its piece of the slab is reused by copies queued after this one
        return (None,) + replay_backward(ctx, hidden, grad_outputs)


# True while a checkpointed layer runs again inside its backward pass; a context variable, so
# that it holds for the thread (and task) that runs the recomputation and nothing else
_REPLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_lab_replaying", default=False)


def replaying_layer() -> bool:
    """Whether the forward code running now is a checkpointed layer's recomputation, whose
    output only roots the backward pass (its values are never read)."""
    return _REPLAYING.get()


@contextlib.contextmanager
def _replay():
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def replay_backward(ctx, hidden: torch.Tensor, grad_outputs: tuple) -> tuple:
    """The backward pass of a checkpointed layer: run it again on its input `hidden` with the
    forward pass's random state (dropout) and autocast settings, then send the incoming
    gradients through it. ctx holds run_function, args, device, cpu_rng, cuda_rng, autocast."""
    devices = [ctx.device] if ctx.cuda_rng is not None else []
    with torch.random.fork_rng(devices=devices), _replay():
        torch.set_rng_state(ctx.cpu_rng)
        if ctx.cuda_rng is not None:
            torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
        with torch.enable_grad(), _autocast(ctx.autocast):
            outputs = ctx.run_function(hidden, *ctx.args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grad_outputs)
        if torch.is_tensor(out) and out.requires_grad and grad is not None
    ]
    torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return (None, hidden.grad) + (None,) * len(ctx.args)


def offloaded_checkpoint(function, hidden_states, *args, slab: HostSlab | None = None):
    """Drop-in for the `_gradient_checkpointing_func` of transformers' decoder layers (with
    `slab` bound by offload_layer_checkpoints)."""
    return OffloadedCheckpoint.apply(function, slab, hidden_states, *args)


def offload_layer_checkpoints(model, tokens: int = 0) -> int:
    """Make every checkpointed decoder layer keep its input in CPU memory; returns how many.
    tokens: the longest micro-batch's, for which one HostSlab holds every layer's input (0:
    torch's pinned allocator, block by block)."""
    layers = checkpointed_layers(model)
    slab = None
    if tokens and layers:
        hidden = model.config.get_text_config().hidden_size
        # a layer's input has the embedding's dtype (model.dtype is the first floating parameter's:
        # peft's fp32 LoRA weights on a 16-bit or 4-bit base, which would double the block)
        itemsize = model.get_input_embeddings().weight.dtype.itemsize
        slab = HostSlab(slab_bytes(len(layers), tokens * hidden * itemsize))
    for layer in layers:
        layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, slab=slab)
    return len(layers)


def offload_slab(layer) -> HostSlab | None:
    """The HostSlab a layer's offloaded checkpoint uses (its own, or its streamed copies'
    CopyState's: models/fast_offload.py), or None (not offloaded, or no slab)."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    if not isinstance(func, functools.partial):
        return None
    return func.keywords.get("slab") or getattr(func.keywords.get("state"), "slab", None)


def offloads_checkpoint(layer) -> bool:
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return isinstance(func, functools.partial) and func.func is offloaded_checkpoint


# ----------------------------------------------------------------------------- MLP chunks


def _chunked(mlp_forward, chunk_tokens: int):
    from torch.utils.checkpoint import checkpoint

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-2] <= chunk_tokens:
            return mlp_forward(hidden)
        parts = hidden.split(chunk_tokens, dim=-2)
        if not torch.is_grad_enabled():
            return torch.cat([mlp_forward(part) for part in parts], dim=-2)
        return torch.cat([checkpoint(mlp_forward, part, use_reentrant=True) for part in parts], dim=-2)

    return forward


def chunk_mlps(model, chunk_tokens: int) -> int:
    """Run every decoder layer's MLP on at most `chunk_tokens` tokens at a time (the MLP treats
    each token on its own, so the result is the same); returns how many MLPs were wrapped."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith(".mlp") and hasattr(module, "down_proj"):
            module.forward = _chunked(module.forward, chunk_tokens)
            count += 1
    return count


def checkpointed_layers(model) -> list:
    """The decoder layers whose gradient checkpointing is on, first to last."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


@contextlib.contextmanager
def checkpointing_paused(model):
    """Gradient checkpointing off inside the block and back on after it, every module's own
    setting and checkpoint function kept: for generation inside a training step (--task grpo),
    whose layers then run with their cache. TRL switches a checkpointing model off and on again
    through transformers, which would put torch's checkpoint in place of lora-lab's (checkpoints
    in CPU memory) and turn the layers left uncheckpointed (keep_last_layers) back on; it finds
    checkpointing off here and leaves both alone."""
    paused = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in paused:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in paused:
            module.gradient_checkpointing = True


def keep_last_layers(model, count: int) -> int:
    """Turn gradient checkpointing off for the last `count` decoder layers: they keep their
    activations from the forward pass to the backward pass instead of running again. Returns
    how many were turned off; more than the model has is refused."""
    layers = checkpointed_layers(model)
    if count > len(layers):
        raise ConfigError(
            [
                f"train.uncheckpointed_layers {count}: the model has {len(layers)} "
                f"checkpointed decoder layers. Use at most {len(layers)}, or "
                f"--no-gradient-checkpointing to recompute none."
            ]
        )
    for layer in layers[len(layers) - count :]:
        layer.gradient_checkpointing = False
    return count


def apply_memory_means(model, means) -> None:
    """Put the chosen planning.memory.MemoryMeans in place on a model whose checkpointing is on
    (the embedding before PEFT wraps the model, so its input-grad hook lands on the new one)."""
    if means.uncheckpointed_layers:  # first: the offload below takes the checkpointed ones
        keep_last_layers(model, means.uncheckpointed_layers)
    if means.offload_checkpoints:
        offload_layer_checkpoints(model, means.checkpoint_tokens)
    if means.mlp_chunk_tokens:
        chunk_mlps(model, means.mlp_chunk_tokens)
