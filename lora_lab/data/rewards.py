"""The rewards of --task grpo (grpo.rewards): lora-lab's built-ins, which are TRL's reward
functions, and the user's own (PATH.py:FUNCTION). Each is wrapped so that a reward that raises,
or returns something else than one number (or None) per completion, stops the run with the
reward's file:line, the prompt and the completion it failed on: never a silent zero.

  format    TRL's think_format_reward: 1 when the completion is its reasoning in
            <think>...</think> followed by the answer, else 0
  accuracy  TRL's accuracy_reward: 1 when the completion's answer (its first LaTeX or \\boxed{}
            answer) equals the row's `solution` column, checked by math-verify
            (pip install math-verify), else 0; None (the completion left out of this reward)
            where the solution itself does not parse
  length    DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment): 0 up to
            grpo.max_completion_length minus a fifth of it, then falling to -1 at the limit

A reward function is called as TRL calls it: fn(prompts=..., completions=...,
completion_ids=..., **the rows' other columns, trainer_state=..., log_extra=..., log_metric=...),
each a list with one entry per completion; prompts and completions are messages
([{"role": "assistant", "content": text}] for a completion). It returns a list of floats, None
for a completion it does not score.
"""

from __future__ import annotations

import importlib.util
import math
import traceback
from pathlib import Path

from ..config.grpo import reward_file
from ..errors import TrainingError

SOFT_PUNISH_SHARE = 5
"""length: the penalty starts max_completion_length / SOFT_PUNISH_SHARE tokens before the limit
(the DAPO paper's 4,096 of 20,480)."""


def builtin_reward(name: str, max_completion_length: int):
    """The function behind a built-in reward name."""
    if name == "format":
        from trl.rewards import think_format_reward

        return think_format_reward
    if name == "accuracy":
        if importlib.util.find_spec("math_verify") is None:
            raise TrainingError("--reward accuracy checks answers with math-verify: pip install 'math-verify>=0.8'.")
        from trl.rewards import accuracy_reward

        return accuracy_reward
    from trl.rewards import get_soft_overlong_punishment

    return get_soft_overlong_punishment(max_completion_length, max(1, max_completion_length // SOFT_PUNISH_SHARE))


def user_reward(spec: str):
    """The function FUNCTION of the file PATH.py, imported from that file."""
    path, name = reward_file(spec) or ("", "")
    module_spec = importlib.util.spec_from_file_location(f"lora_lab_reward_{Path(path).stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise TrainingError(f"--reward {spec}: {path} cannot be imported as Python.")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise TrainingError(f"--reward {spec}: importing {path} failed{_where(exc, path)}: {_said(exc)}") from None
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise TrainingError(f"--reward {spec}: {path} has no function {name!r} (its functions: {', '.join(found)}).")
    return function


class Reward:
    """One reward of the run, called by TRL; its __name__ is the name TRL logs its mean under
    (rewards/NAME/mean)."""

    def __init__(self, spec: str, max_completion_length: int):
        self.spec = spec
        found = reward_file(spec)
        self.file = found[0] if found else None
        self.function = user_reward(spec) if found else builtin_reward(spec, max_completion_length)
        self.__name__ = found[1] if found else spec

    def __call__(self, prompts, completions, **columns) -> list:
        try:
            values = self.function(prompts=prompts, completions=completions, **columns)
        except Exception as exc:
            raise self._failure(prompts, completions, columns, exc) from None
        return self._checked(values, prompts, completions)

    def _checked(self, values, prompts, completions) -> list:
        """values as a list of floats or None, one per completion; else a TrainingError."""
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise TrainingError(
                f"reward {self.spec} returned {count} for {len(completions)} completions; it must return a list "
                "with one number (or None) per completion."
            )
        for index, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TrainingError(
                    f"reward {self.spec} returned {value!r} for completion {index + 1} of {len(values)}; each must "
                    f"be a finite number or None.\n{_shown(prompts[index], completions[index])}"
                )
        return [None if value is None else float(value) for value in values]

    def _failure(self, prompts, completions, columns, exc) -> TrainingError:
        """The error of a reward that raised: the first completion it raises on alone, with the
        reward's file:line (the whole batch's when no single completion fails)."""
        for index in range(len(completions)):
            one = {
                key: value[index : index + 1] if isinstance(value, list) else value for key, value in columns.items()
            }
            try:
                self.function(prompts=prompts[index : index + 1], completions=completions[index : index + 1], **one)
            except Exception as single:
                exc = single
                shown = _shown(prompts[index], completions[index])
                break
        else:
            shown = f"(on the batch of {len(completions)} completions; on each alone it did not raise)"
        return TrainingError(f"reward {self.spec} raised{_where(exc, self.file)}: {_said(exc)}\n{shown}")


def build_rewards(specs: list, max_completion_length: int) -> list[Reward]:
    return [Reward(spec, max_completion_length) for spec in specs]


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _where(exc: BaseException, file: str | None) -> str:
    """' at FILE:LINE': the deepest frame in the reward's file (else the deepest frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    mine = [f for f in frames if file and Path(f.filename).resolve() == Path(file).resolve()]
    frame = (mine or frames)[-1]
    return f" at {frame.filename}:{frame.lineno}"


def _shown(prompt, completion, limit: int = 300) -> str:
    """The prompt's last message and the completion, cut to `limit` characters each."""

    def text(value) -> str:
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1].get("content", "")
        value = str(value)
        return value if len(value) <= limit else value[:limit] + " [...]"

    return f"  prompt:     {text(prompt)!r}\n  completion: {text(completion)!r}"
