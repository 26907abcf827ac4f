"""--task grpo's inputs without a model: the prompt row forms and their bad rows by line (real
Qwen2.5 tokenizer and template), the grpo config's checks, and the reward wrapper's errors."""

import pytest

from lora_lab.config import resolve_config
from lora_lab.data.prompts import encode_prompts, load_prompt_spec
from lora_lab.data.rewards import Reward
from lora_lab.errors import ConfigError, TrainingError
from lora_lab.training.args import count_optimizer_steps
from tests.support.tiny import write_jsonl

USER = {"role": "user", "content": "What is 2+2?"}


def test_each_row_form_gives_the_templates_generation_prompt_and_the_reward_columns(tokenizer, tmp_path):
    rows = [
        {"messages": [USER], "solution": "4"},  # ms-swift
        {"prompt": [USER], "solution": "4"},  # TRL, conversational
        {"prompt": "What is 2+2?", "solution": "4"},  # TRL text: the user's message
        {"instruction": "What is 2+2?", "solution": "4"},  # alpaca
    ]
    loaded = load_prompt_spec(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    assert not loaded.problems
    report = encode_prompts(tokenizer, loaded.samples, 512, None, "auto")
    expected = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert [s.prompt_ids for s in report.samples] == [list(expected)] * 4
    assert [s.row() for s in report.samples] == [{"prompt": [USER], "solution": "4"}] * 4


def test_bad_prompt_rows_are_reported_by_line_with_the_fix(tokenizer, tmp_path):
    rows = [
        {"messages": [USER, {"role": "assistant", "content": "4"}]},
        {"solution": "4"},
        {"prompt": [USER], "completions": "x"},
        {"prompt": [USER], "tools": []},
        {"messages": [USER]},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    loaded = load_prompt_spec(str(path))
    found = {p.origin: p.reason for p in loaded.problems}
    assert "ends with an assistant message" in found[f"{path}:1"] and "`solution`" in found[f"{path}:1"]
    assert found[f"{path}:2"].startswith("no prompt: --task grpo reads `messages`")
    assert "field `completions` has the name of an argument TRL gives" in found[f"{path}:3"]
    assert "tool calls are not run" in found[f"{path}:4"]
    assert len(loaded.samples) == 1
    too_long = encode_prompts(tokenizer, loaded.samples, 5, None, "auto")
    assert "over --max-length 5 (a prompt is never cut)" in too_long.problems[0].reason


def grpo_config(sets=(), **flags):
    given = {"train.task": "grpo", "data.datasets": ["p.jsonl"], **flags}
    return resolve_config("cpu", None, given, list(sets))


def test_grpo_takes_beta_0_unless_given_and_counts_steps_in_completions():
    config = grpo_config(**{"grpo.rewards": ["format"]})
    assert config.train.pref_beta == 0.0 and config.sources["train.pref_beta"].startswith("--task grpo default")
    assert grpo_config(**{"grpo.rewards": ["format"], "train.pref_beta": "0.04"}).train.pref_beta == 0.04
    config = grpo_config(["grpo.num_generations=4", "train.grad_accum=2"], **{"grpo.rewards": ["format"]})
    assert count_optimizer_steps(config, 10) == 3 * 5  # 10 prompts x 4 completions / (4 x 2) a step, 3 epochs


def test_grpo_config_problems_name_the_flag_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as caught:
        grpo_config(
            ["train.grad_accum=3", "grpo.num_generations=8"],
            **{"grpo.rewards": ["format", "nope", f"{tmp_path}/none.py:f"]},
        )
    text = str(caught.value)
    assert "'nope' is neither a built-in reward (format, accuracy, length) nor PATH.py:FUNCTION." in text
    assert "none.py is not a file" in text
    assert "a step of 4 x 3 completions does not hold whole groups of 8; use --grad-accum 4" in text
    with pytest.raises(ConfigError, match="--task grpo needs a reward: --reward format"):
        grpo_config()
    with pytest.raises(ConfigError, match="scores --task grpo's completions; pass --task grpo or drop --reward"):
        resolve_config("cpu", None, {"data.datasets": ["p.jsonl"], "grpo.rewards": ["format"]}, [])


def make_reward(tmp_path, body: str) -> Reward:
    (tmp_path / "r.py").write_text(body)
    return Reward(f"{tmp_path}/r.py:score", 16)


COMPLETIONS = [[{"role": "assistant", "content": "four"}], [{"role": "assistant", "content": "4"}]]
PROMPTS = [[USER], [USER]]


def test_a_reward_of_the_wrong_shape_stops_with_the_completion(tmp_path):
    short = make_reward(tmp_path, "def score(completions, **kw):\n    return [1.0]\n")
    with pytest.raises(TrainingError, match="returned 1 for 2 completions; it must return a list with one number"):
        short(PROMPTS, COMPLETIONS, completion_ids=[[1], [2]])
    text = make_reward(tmp_path, "def score(completions, **kw):\n    return [1.0, 'yes']\n")
    with pytest.raises(TrainingError, match="returned 'yes' for completion 2 of 2") as caught:
        text(PROMPTS, COMPLETIONS, completion_ids=[[1], [2]])
    assert "completion: '4'" in str(caught.value)
    fine = make_reward(tmp_path, "def score(completions, **kw):\n    return [None, 2]\n")
    assert fine(PROMPTS, COMPLETIONS, completion_ids=[[1], [2]]) == [None, 2.0]
    assert fine.__name__ == "score"


def test_a_reward_that_raises_on_one_completion_names_that_completion_and_its_line(tmp_path):
    body = "def score(completions, **kw):\n    return [float(c[0]['content']) for c in completions]\n"
    reward = make_reward(tmp_path, body)
    with pytest.raises(TrainingError) as caught:
        reward(PROMPTS, COMPLETIONS, completion_ids=[[1], [2]])
    text = str(caught.value)
    assert f"raised at {tmp_path}/r.py:2: ValueError: could not convert string to float: 'four'" in text
    assert "completion: 'four'" in text and "prompt:     'What is 2+2?'" in text
