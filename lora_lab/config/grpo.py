"""The `grpo` section of the run configuration: what --task grpo samples, rewards and optimizes
(training/grpo.py trains it with TRL's GRPOTrainer; docs/grpo.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .spec import spec_field as _f

GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo")
"""grpo.loss values (training/grpo.py says what each sets in TRL)."""
BUILTIN_REWARDS = ("format", "accuracy", "length")
"""grpo.rewards names of lora-lab's built-in rewards (data/rewards.py)."""


@dataclass(frozen=True)
class GrpoArgs:
    rewards: list = _f(
        [],
        "--task grpo: the rewards of a completion, one or more of: format (reasoning in "
        "<think>...</think>, then the answer; TRL's think_format_reward), accuracy (the answer "
        "equals the row's `solution`, checked by math-verify), length (DAPO's soft penalty as a "
        "completion nears grpo.max_completion_length), or PATH.py:FUNCTION, your function of "
        "(prompts, completions, completion_ids, **the row's other columns) returning one float per "
        "completion. Repeat --reward for several.",
    )
    reward_weights: list = _f(
        [],
        "One weight per reward, in the order of grpo.rewards (default 1 each); the advantage is "
        "taken over the weighted sum.",
    )
    loss: str = _f(
        "dapo",
        "The policy loss: grpo (the DeepSeekMath paper's: each completion's token mean), dr_grpo "
        "(Dr. GRPO: a constant divisor, rewards not scaled by their spread), dapo (DAPO: the "
        "token mean over the step, upper clip 0.28; add --reward length for its overlong penalty), bnpo (the "
        "token mean over the micro-batch) or gspo (GSPO: one importance ratio per sequence).",
        choices=GRPO_LOSSES,
    )
    num_generations: int = _f(
        8,
        "Completions sampled for each prompt: the group whose rewards are compared. "
        "train.micro_batch_size x train.grad_accum completions make a step, a multiple of it.",
        minimum=2,
    )
    max_completion_length: int = _f(
        256,
        "The longest completion sampled, in tokens (data.max_length bounds the prompt); the planner counts both.",
        minimum=1,
    )
    temperature: float = _f(1.0, "Sampling temperature of the completions (above 0).", minimum=0)
    static_cache: bool = _f(
        False,
        "Sample with a static KV cache sized for prompt + completion and transformers' compiled "
        "decoding step (torch.compile, CUDA graphs) on a CUDA GPU: the first step compiles, and a "
        "step whose prompts outgrow the cache compiles again. Off: a growing cache, no compilation.",
    )


def reward_weights_of(grpo: GrpoArgs) -> list[float]:
    """Each reward's weight, in the order of grpo.rewards: 1 each unless grpo.reward_weights says."""
    return [float(w) for w in grpo.reward_weights] or [1.0] * len(grpo.rewards)


def reward_file(spec: str) -> tuple[str, str] | None:
    """A user reward's (file, function) from PATH.py:FUNCTION; None for a built-in's name."""
    path, sep, function = spec.rpartition(":")
    return (path, function) if sep and path.endswith(".py") else None


def grpo_problems(grpo: GrpoArgs, train) -> list[tuple[str, str]]:
    """The grpo section against --task and the batch, each problem with its fix."""
    if train.task != "grpo":
        return [("grpo.rewards", "scores --task grpo's completions; pass --task grpo or drop --reward.")] * bool(
            grpo.rewards
        )
    problems = [("grpo.rewards", problem) for problem in _reward_problems(grpo.rewards)]
    weights = grpo.reward_weights
    if weights and (len(weights) != len(grpo.rewards) or not all(_is_number(w) for w in weights)):
        problems.append(
            ("grpo.reward_weights", f"one number per reward ({len(grpo.rewards)}, in order); got {weights}.")
        )
    completions = train.micro_batch_size * train.grad_accum
    if completions % grpo.num_generations:
        fix = -(-completions // grpo.num_generations) * grpo.num_generations // train.micro_batch_size
        problems.append(
            (
                "grpo.num_generations",
                f"a step of {train.micro_batch_size} x {train.grad_accum} completions does not hold whole groups of "
                f"{grpo.num_generations}; use --grad-accum {max(fix, 1)} (or a --num-generations that divides "
                f"{completions}).",
            )
        )
    if grpo.temperature <= 0:
        problems.append(("grpo.temperature", "must be above 0: GRPO compares sampled completions."))
    return problems


def _reward_problems(rewards: list) -> list[str]:
    if not rewards:
        return ["--task grpo needs a reward: --reward format (or accuracy, length, or PATH.py:FUNCTION for your own)."]
    problems = []
    for spec in rewards:
        found = reward_file(spec)
        if found is None and spec not in BUILTIN_REWARDS:
            problems.append(
                f"{spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor PATH.py:FUNCTION."
            )
        elif found is not None and not Path(found[0]).is_file():
            problems.append(f"{spec!r}: {found[0]} is not a file.")
    if len(set(rewards)) < len(rewards):
        problems.append(f"a reward is given twice ({rewards}); give each once and weigh it with grpo.reward_weights.")
    return problems


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
