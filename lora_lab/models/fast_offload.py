"""Layer checkpoints in pinned CPU memory, copied on a side CUDA stream so the copies overlap
the layers' compute (models.memory_means.OffloadedCheckpoint copies on the compute stream,
which then waits for each copy).

Forward: the layer's input is copied to the host on the copy stream while the layer runs.
Backward: the input of the layer whose backward comes next (the one run before it in the forward
pass) is fetched on the copy stream while this layer is recomputed and back-propagated, so the
compute stream finds it already there. A layer input copied to the host stays referenced until
the next layer's input has been queued for its copy, and is then released on the compute stream
after that stream has waited for its copy: its memory is reused one layer later, in stream order.
(record_stream would hold it until the copy stream drained everything queued by then, which
waits on compute work the host has queued ahead: many layers' inputs at the peak.) The
arithmetic is the plain checkpoint's: the same input, random state and autocast settings.
What the copies share (the stream, the last slot, the queued copies) is one CopyState per model,
bound to its layers by stream_layer_checkpoints: no module-level state.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .host_memory import HostSlab, host_copy
from .memory_means import _autocast_state, replay_backward


class _Slot:
    """One checkpoint's input: on the host, and (once fetched) back on the GPU."""

    def __init__(self, host: torch.Tensor, device: torch.device, stream: torch.cuda.Stream, previous):
        self.host: torch.Tensor | None = host  # None once the copy back is queued
        self.device, self.stream, self.previous = device, stream, previous
        self.gpu: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def fetch(self) -> None:
        """Queue the copy back to the GPU on the copy stream (once)."""
        if self.gpu is not None or self.host is None:
            return
        compute = torch.cuda.current_stream(self.device)
        gpu = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self.stream.wait_stream(compute)  # the new block may be memory the compute stream just freed
        with torch.cuda.stream(self.stream):
            gpu.copy_(self.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
            self.ready = ready
        self.gpu, self.host = gpu, None

    def take(self) -> torch.Tensor:
        self.fetch()
        gpu, ready = self.gpu, self.ready
        assert gpu is not None and ready is not None, "a slot's input is taken once"
        torch.cuda.current_stream(self.device).wait_event(ready)
        self.gpu = None
        return gpu


class CopyState:
    """The streamed copies of one model's checkpointed layers: its copy stream per device, the
    slot of the checkpoint run last in the forward pass (a weak reference), and the GPU inputs
    whose copies to the host are queued, oldest first (GPU tensor, compute stream, event of the
    copy's end)."""

    def __init__(self, slab: HostSlab | None):
        self.slab = slab
        self.streams: dict = {}
        self.last_slot = None
        self.copying: list = []

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def release_copied(self, keep: int) -> None:
        """Drop all but the newest `keep` GPU tensors whose copies to the host are queued; the
        compute stream first waits for each one's copy, so their memory is reused after it."""
        while len(self.copying) > keep:
            tensor, compute, done = self.copying.pop(0)
            compute.wait_event(done)
            del tensor

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy queued on the copy stream (a slab's piece is reused only by copies queued on
        that stream after this one's copy back: stream order keeps them apart)."""
        compute, stream = torch.cuda.current_stream(tensor.device), self.stream(tensor.device)
        host = host_copy(tensor, self.slab)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.release_copied(keep=1)
        self.copying.append((tensor, compute, done))
        return host


class StreamedOffloadedCheckpoint(torch.autograd.Function):
    """OffloadedCheckpoint with its copies on a side stream and the next input prefetched."""

    @staticmethod
    def forward(ctx, run_function, state, hidden_states, *args):
        ctx.run_function, ctx.args = run_function, args
        ctx.device = hidden_states.device
        ctx.autocast = _autocast_state()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(ctx.device)
        ctx.state = state
        host = state.to_host(hidden_states)
        ctx.slot = _Slot(host, ctx.device, state.stream(ctx.device), state.last_slot)
        state.last_slot = weakref.ref(ctx.slot)
        with torch.no_grad():
            return run_function(hidden_states, *args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        ctx.state.release_copied(keep=0)
        slot = ctx.slot
        hidden = slot.take().requires_grad_(True)
        earlier = slot.previous() if slot.previous is not None else None
        if earlier is not None:
            earlier.fetch()  # overlaps this layer's recomputation and backward
        ctx.slot = ctx.state = None
        return (None,) + replay_backward(ctx, hidden, grad_outputs)


def streamed_offloaded_checkpoint(function, hidden_states, *args, state: CopyState):
    """Drop-in for the `_gradient_checkpointing_func` of transformers' decoder layers; on CPU
    tensors it is models.memory_means.offloaded_checkpoint."""
    if hidden_states.device.type != "cuda":
        from .memory_means import offloaded_checkpoint

        return offloaded_checkpoint(function, hidden_states, *args, slab=state.slab)
    return StreamedOffloadedCheckpoint.apply(function, state, hidden_states, *args)


def stream_layer_checkpoints(model) -> int:
    """Switch layers whose checkpoints go to CPU memory to the streamed copies (one CopyState
    for the model, over the same HostSlab); returns how many."""
    from .memory_means import offload_slab, offloads_checkpoint

    layers = [m for m in model.modules() if offloads_checkpoint(m)]
    state = CopyState(offload_slab(layers[0]) if layers else None)
    for layer in layers:
        layer._gradient_checkpointing_func = functools.partial(streamed_offloaded_checkpoint, state=state)
    return len(layers)
