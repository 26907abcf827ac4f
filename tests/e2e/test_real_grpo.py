"""--task grpo on the real Qwen2.5-Coder-0.5B-Instruct (the GGUF of tests/e2e/test_real_model.py),
through the CLI and TRL's GRPOTrainer on the CPU: ten steps of one group of 4 completions on a
small arithmetic set move its reward (about 90 s on 2 cores). The reward is a user's file: the
sum, in as few words as possible (the model first says "34 + 58 equals 92." and learns to answer
"92")."""

import json
import random

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

pytestmark = pytest.mark.real_model

REWARD = '''
import re


def terse_sum(completions, solution, **kwargs):
    """1 / words of the reply when its last number is the sum, else 0."""
    scores = []
    for completion, answer in zip(completions, solution):
        text = completion[0]["content"]
        numbers = re.findall(r"-?\\d+", text)
        scores.append(1.0 / max(1, len(text.split())) if numbers and numbers[-1] == answer else 0.0)
    return scores
'''


def test_grpo_moves_the_real_models_reward_on_an_arithmetic_set(real_model_gguf, tmp_path):
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randint(10, 60), rng.randint(10, 60)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)})
    prompts = write_jsonl(tmp_path / "sums.jsonl", rows)
    (tmp_path / "reward.py").write_text(REWARD)
    args = ["run", "--preset", "cpu", "--model", real_model_gguf, "--task", "grpo", "--data", prompts,
            "--reward", f"{tmp_path / 'reward.py'}:terse_sum", "--num-generations", 4,
            "--max-completion-length", 16, "--grad-accum", 1, "--max-steps", 10, "--lr", "5e-4",
            "--logging-steps", 1, "--output-dir", tmp_path, "--run-name", "sums"]  # fmt: skip
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    log = [json.loads(line) for line in (tmp_path / "sums" / "logs" / "train_log.jsonl").read_text().splitlines()]
    steps = [event for event in log if "reward" in event]
    rewards = [event["reward"] for event in steps]
    lengths = [event["completions/mean_length"] for event in steps]
    assert len(rewards) == 10
    assert sum(rewards[-2:]) / 2 >= sum(rewards[:2]) / 2 + 0.15, rewards  # the reward moved
    assert sum(lengths[-2:]) / 2 <= sum(lengths[:2]) / 2 - 3, lengths  # by shorter answers
