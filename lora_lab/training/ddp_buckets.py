"""A resumed torch DDP run reduces every step in the buckets the uninterrupted run used.

DDP reduces its first synchronised backward in its first bucket layout (every gradient in
registration order) and rebuilds its buckets at the next forward in the order the gradients
became ready; a sum over more than two processes depends on an element's place in its bucket
(tests/e2e/test_ddp_reduction_order.py). A resumed run therefore replays that first backward,
zero-weighted, before its first step (LoraLabMixin in training/trainer.py calls it). Only torch
is imported here: the multi-process tests load this module in every process."""

from __future__ import annotations

import random
from contextlib import contextmanager


def rebuilds_buckets(model) -> bool:
    """Whether model is a torch DDP still in its first bucket layout that will rebuild it
    after a synchronised backward (find_unused_parameters off, or a static graph)."""
    from torch.nn.parallel import DistributedDataParallel

    return (
        isinstance(model, DistributedDataParallel)
        and not model._has_rebuilt_buckets
        and (model.static_graph or not model.find_unused_parameters)
    )


@contextmanager
def rng_kept():
    """On leaving, torch's CPU and current CUDA generators, Python's and NumPy's are where they
    were on entering, whatever was drawn inside."""
    import numpy as np
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def replay_bucket_rebuild(model, loss_of) -> None:
    """One synchronised backward of 0 x loss_of(model) through the DDP `model`, then every
    gradient None and every RNG as before: what a DDP run's first step leaves behind, without
    changing a weight, an optimizer state or the next step's random draws. The zero-weighted
    backward gives every trained parameter a gradient in the order a real step does, so DDP's
    rebuild at the next forward follows the uninterrupted run's (the module's rule)."""
    with rng_kept():
        sync, model.require_backward_grad_sync = model.require_backward_grad_sync, True
        try:  # inside no_sync too: DDP records the ready order only in a synchronised backward
            (loss_of(model) * 0).backward()
        finally:
            model.require_backward_grad_sync = sync
    for param in model.parameters():
        param.grad = None
