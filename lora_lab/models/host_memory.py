"""Pinned CPU memory for the offloaded layer checkpoints of one model, pinned once at its planned
size (planning.memory counts the same bytes: "activation checkpoints (pinned)").

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every block up to the next
power of two and keeps the blocks cached for reuse: a checkpoint just over a power of two holds
nearly twice its bytes, and the host memory a long run needs depends on where its length falls.
A HostSlab is one block of exactly the planned bytes, allocated as ordinary CPU memory and pinned
with cudaHostRegister, and handed out per checkpoint: a layer's forward pass takes a piece, and
the piece comes back when its host tensor is dropped (after the backward pass has queued its copy
back to the GPU). A piece is only reused by a copy queued on the same CUDA stream as the copy that
last read it (the checkpoint code queues both on one stream), so stream order keeps them apart.
A checkpoint larger than what is left (a row longer than planned), or any checkpoint where the
block could not be pinned, falls back to torch's pinned allocator.
"""

from __future__ import annotations

import bisect
import weakref

import torch

ALIGN = 4096  # bytes: each piece starts on a page


class HostSlab:
    """`nbytes` of CPU memory, pinned where CUDA is available, lent out in pieces."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None  # allocated and pinned at the first serves()
        self.pinned = False
        self.unpinnable = False  # CUDA is there but the block could not be pinned: never used
        self.starts: list[int] = [0]  # free pieces, sorted, never adjacent
        self.ends: list[int] = [nbytes]

    def _allocate(self) -> None:
        """The block, made at the first checkpoint (after the model has loaded, so that its
        memory is not held beside the checkpoint files' pages read while loading). Where CUDA is
        there and pinning fails, the block is dropped at once: GPU copies need pinned memory."""
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        if not (torch.cuda.is_available() and self.nbytes):
            return
        try:
            error = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
            self.pinned = int(error) == 0
        except (AttributeError, RuntimeError):  # no cudart binding: torch's allocator serves
            self.pinned = False
        if self.pinned:
            weakref.finalize(self, _unregister, self.buffer)
        else:
            self.buffer, self.unpinnable = None, True

    def serves(self, device: torch.device) -> bool:
        """Whether a copy of a tensor on `device` may take a piece: a CPU tensor's always, a GPU
        tensor's once the block is pinned. The first call makes the block."""
        if self.buffer is None and not self.unpinnable:
            self._allocate()
        return self.buffer is not None and (device.type != "cuda" or self.pinned)

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` and `dtype` in the slab (its piece comes back when the tensor is
        dropped), or None when no free piece is large enough. Ask serves() first."""
        count = 1
        for size in shape:
            count *= size
        need = -(-count * dtype.itemsize // ALIGN) * ALIGN
        i = next((i for i, (s, e) in enumerate(zip(self.starts, self.ends, strict=True)) if e - s >= need), None)
        if i is None:
            return None
        start, end = self.starts[i], self.ends[i]
        if end - start == need:
            del self.starts[i], self.ends[i]
        else:
            self.starts[i] = start + need
        assert self.buffer is not None, "HostSlab.take before serves()"
        tensor = self.buffer[start : start + count * dtype.itemsize].view(dtype).view(shape)
        weakref.finalize(tensor, self._give_back, start, need)
        return tensor

    def _give_back(self, start: int, size: int) -> None:
        end = start + size
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] == start:  # joins the piece before
            i -= 1
            start = self.starts[i]
            del self.starts[i], self.ends[i]
        if i < len(self.starts) and self.starts[i] == end:  # and the piece after
            end = self.ends[i]
            del self.starts[i], self.ends[i]
        self.starts.insert(i, start)
        self.ends.insert(i, end)


def slab_bytes(pieces: int, piece_bytes: int) -> int:
    """A block for `pieces` pieces of `piece_bytes` each, every piece starting on a page."""
    return pieces * (-(-piece_bytes // ALIGN) * ALIGN)


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def host_copy(tensor: torch.Tensor, slab: HostSlab | None) -> torch.Tensor:
    """An empty CPU tensor for a copy of `tensor`: a piece of `slab`, else pinned by torch's
    allocator (a CUDA tensor) or ordinary memory (a CPU tensor)."""
    host = slab.take(tensor.shape, tensor.dtype) if slab is not None and slab.serves(tensor.device) else None
    if host is None:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    return host
