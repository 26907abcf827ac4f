"""The learning-rate schedule: the warm-up's first optimizer step trains (never learning rate 0),
and after the warm-up every step has the Trainer's own learning rate."""

from __future__ import annotations

import pytest

from lora_lab.training.args import build_scheduler, warmup_steps


def learning_rates(scheduler, steps: int) -> list:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant_with_warmup", "constant"])
def test_the_warm_up_starts_above_zero_and_ends_on_the_trainers_schedule(kind):
    import torch
    from transformers import TrainingArguments
    from transformers.optimization import get_scheduler

    total = 30
    warmup = warmup_steps(0.1, total)
    args = TrainingArguments(output_dir="unused", learning_rate=3e-4, warmup_steps=warmup, lr_scheduler_type=kind)

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-4)

    ours = learning_rates(build_scheduler(args, optimizer(), total), total)
    trainers = learning_rates(get_scheduler(kind, optimizer(), warmup, total), total)
    assert warmup == 3
    if kind == "constant":  # no warm-up: the Trainer's schedule, untouched
        assert ours == trainers
        return
    assert trainers[0] == 0.0  # what the Trainer's own schedule does
    assert ours[:warmup] == pytest.approx([3e-4 * (s + 1) / (warmup + 1) for s in range(warmup)])
    assert ours[warmup:] == pytest.approx(trainers[warmup:], rel=1e-12, abs=0)


def test_a_schedule_without_warm_up_is_the_trainers():
    import torch
    from transformers import TrainingArguments
    from transformers.optimization import get_scheduler

    args = TrainingArguments(output_dir="unused", learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="cosine")
    ours = build_scheduler(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), 10)
    theirs = get_scheduler("cosine", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), 0, 10)
    assert learning_rates(ours, 10) == learning_rates(theirs, 10)
