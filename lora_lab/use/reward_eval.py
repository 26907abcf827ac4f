"""`lora-lab eval RUN --data PROMPTS` on a --task grpo run: the run's rewards on held-out prompts,
before (the starting policy: the base model, or the --from-run SFT adapter) and after (the trained
adapter). Each prompt's completion is greedy, at most grpo.max_completion_length tokens, from the
prompt encoded as training encoded it; the rewards are called as TRL calls them in training
(data/rewards.py: a reward that fails stops with its file:line), and the total is their
weighted sum, None counted as TRL's nansum does."""

from __future__ import annotations

import math

from ..config.grpo import reward_weights_of
from ..data import read_and_encode
from ..data.rewards import build_rewards
from ..errors import DataError


def evaluate_rewards(model, tokenizer, config, datasets: list, reference, samples_to_show: int = 5) -> dict:
    """The report of a grpo run's rewards on `datasets` (prompt rows) before and after training;
    `reference`: the context in which `model` computes as the starting policy."""
    loaded, report = read_and_encode(datasets, config.data, tokenizer, config.train.seed, "grpo")
    if not report.samples:
        raise DataError(f"--data {' '.join(datasets)}: no usable prompt to evaluate.")
    prompts = report.samples
    rewards = build_rewards(config.grpo.rewards, config.grpo.max_completion_length)
    weights = reward_weights_of(config.grpo)
    with reference:
        before = complete(model, tokenizer, [p.prompt_ids for p in prompts], config.grpo.max_completion_length)
    after = complete(model, tokenizer, [p.prompt_ids for p in prompts], config.grpo.max_completion_length)
    scored = {
        side: score(rewards, prompts, completions) for side, completions in (("before", before), ("after", after))
    }
    totals = {side: [weighted(row, weights) for row in zip(*values.values())] for side, values in scored.items()}
    return {
        "task": "grpo",
        "data": list(datasets),
        "prompts": len(prompts),
        "rewards": {
            r.__name__: {side: mean(scored[side][r.__name__]) for side in ("before", "after")} for r in rewards
        },
        "weights": weights,
        "reward": {side: mean(totals[side]) for side in ("before", "after")},
        "completions": [
            {"origin": p.origin, "prompt": p.prompt[-1]["content"], "before": b[0], "after": a[0]}
            for p, b, a in list(zip(prompts, before, after))[:samples_to_show]
        ],
        "not_used": [str(p) for p in loaded.problems + report.problems],
    }


def complete(model, tokenizer, prompt_ids: list, max_new_tokens: int, batch_size: int = 8) -> list:
    """(text, ids) of one greedy completion per encoded prompt, ids up to and with the first end
    of turn, text decoded as TRL decodes a completion (special tokens left out)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    out = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        width = max(len(ids) for ids in chunk)
        ids = torch.tensor([[pad] * (width - len(i)) + i for i in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in chunk], device=model.device)
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )[:, width:].tolist()
        for row in generated:
            end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
            out.append((tokenizer.decode(row[:end], skip_special_tokens=True), row[:end]))
    return out


def score(rewards: list, prompts: list, completions: list) -> dict:
    """Each reward's values (None where it does not score a completion), by reward name."""
    from transformers import TrainerState

    columns = {key: [p.columns.get(key) for p in prompts] for key in {k for p in prompts for k in p.columns}}
    given = {
        "prompts": [p.prompt for p in prompts],
        "completions": [[{"role": "assistant", "content": text}] for text, _ in completions],
        "completion_ids": [ids for _, ids in completions],
        "trainer_state": TrainerState(),
        "log_extra": lambda *args, **kwargs: None,
        "log_metric": lambda *args, **kwargs: None,
        **columns,
    }
    return {r.__name__: r(**given) for r in rewards}


def weighted(values: tuple, weights: list) -> float | None:
    """A completion's total reward: the weighted sum of the rewards that score it (nansum)."""
    scored = [w * v for w, v in zip(weights, values) if v is not None]
    return sum(scored) if scored else None


def mean(values: list) -> float | None:
    found = [v for v in values if v is not None and not math.isnan(v)]
    return sum(found) / len(found) if found else None
