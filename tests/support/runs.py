"""Comparing two finished runs: their logged losses and their saved adapters."""

import json
from pathlib import Path

import pytest


def step_losses(run_dir: Path) -> list:
    """(step, loss) of every training log event of a run folder."""
    lines = [json.loads(line) for line in (run_dir / "logs" / "train_log.jsonl").open()]
    return [(line["step"], line["loss"]) for line in lines if "loss" in line]


def assert_same_training(reference: Path, other: Path, steps: list) -> None:
    """The same logged steps, losses within 1e-4 relative, a loss that moved, and adapter
    tensors within rtol 1e-3, atol 1e-5 (processes sum their gradients in another order)."""
    import torch
    from safetensors.torch import load_file

    one, two = step_losses(reference), step_losses(other)
    assert [s for s, _ in two] == [s for s, _ in one] == steps
    for (_, a), (_, b) in zip(one, two):
        assert b == pytest.approx(a, rel=1e-4)
    assert one[-1][1] != one[0][1]  # it trained
    a = load_file(reference / "adapter" / "adapter_model.safetensors")
    b = load_file(other / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-5)
