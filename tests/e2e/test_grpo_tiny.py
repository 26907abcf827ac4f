"""--task grpo on a tiny model, through the real CLI, TRL's real GRPOTrainer and real sampling:
a run continuing an SFT adapter learns the format reward; every loss trains; a user's reward
that raises stops the run with its file:line, the prompt and the completion; a resumed run
samples and trains exactly as the whole run."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lora_lab.cli import main
from tests.support.tiny import build_tiny_qwen2, write_jsonl

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
FORMATTED = "<think>two and two</think>4"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    """Hidden size 128: wide enough that its logits can single out one answer of 151,936 tokens
    (the 32-wide tiny model's cannot, and no reward could move it)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny128"), hidden_size=128)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    return write_jsonl(folder / "prompts.jsonl", [{"prompt": QUESTION, "solution": "4"}])


def rewards_of(run_dir) -> list:
    lines = (run_dir / "logs" / "train_log.jsonl").read_text().splitlines()
    return [event["reward"] for event in map(json.loads, lines) if "reward" in event]


def test_a_grpo_run_continuing_an_sft_adapter_learns_the_format_reward(tiny128, prompts, tmp_path):
    """The SFT adapter answers in the <think> format one time in six; GRPO with the built-in
    format reward makes it the answer."""
    sft_rows = [{"messages": QUESTION + [{"role": "assistant", "content": FORMATTED}]}]
    sft_rows += [{"messages": QUESTION + [{"role": "assistant", "content": "It is four."}]}] * 5
    sft_data = write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    common = ("--output-dir", tmp_path, "--lora-dropout", 0, "--logging-steps", 1)
    sft = invoke("run", "--model", tiny128, "--data", f"{sft_data}#24", "--max-steps", 30, "--lr", "1e-2",
                 "--lora-rank", 16, "--run-name", "sft", *common)  # fmt: skip
    assert sft.exit_code == 0, sft.output
    result = invoke("run", "--from-run", tmp_path / "sft", "--data", f"{prompts}#8", "--task", "grpo",
                    "--reward", "format", "--num-generations", 8, "--max-completion-length", 12,
                    "--grad-accum", 2, "--max-steps", 10, "--lr", "2e-3", "--run-name", "grpo", *common)  # fmt: skip
    assert result.exit_code == 0, result.output
    rewards = rewards_of(tmp_path / "grpo")
    assert len(rewards) == 10
    assert sum(rewards[:2]) / 2 <= 0.25, rewards
    assert sum(rewards[-3:]) / 3 >= 0.8, rewards
    assert (tmp_path / "grpo" / "adapter" / "adapter_model.safetensors").is_file()
    # lora-lab eval: the run's reward on the prompts, greedy, from the SFT policy and after GRPO
    evaluated = invoke("eval", tmp_path / "grpo", "--data", prompts)
    assert evaluated.exit_code == 0, evaluated.output
    assert "  format               0.000 -> 1.000" in evaluated.output, evaluated.output
    report = json.loads((tmp_path / "grpo" / "eval_report.json").read_text())
    assert report["rewards"] == {"format": {"before": 0.0, "after": 1.0}} and report["prompts"] == 1
    row = report["completions"][0]
    assert row["before"].startswith("It is four") and row["after"].startswith("<think>"), row


EVEN = """
def even_tokens(completions, completion_ids, solution, **kwargs):
    assert solution == ["4"] * len(completions)  # the row's other columns reach the reward
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
"""


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "bnpo", "gspo"])
def test_each_loss_trains_with_a_users_reward(tiny_model_dir, prompts, tmp_path, loss):
    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)
    result = invoke("run", "--model", tiny_model_dir, "--data", f"{prompts}#4", "--task", "grpo",
                    "--reward", f"{reward}:even_tokens", "--num-generations", 4, "--max-completion-length", 6,
                    "--grad-accum", 1, "--max-steps", 2, "--logging-steps", 1, "--beta", "0.05",
                    "--set", f"grpo.loss={loss}", "--output-dir", tmp_path, "--run-name", loss)  # fmt: skip
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in (tmp_path / loss / "logs" / "train_log.jsonl").read_text().splitlines()]
    steps = [e for e in events if "loss" in e]
    assert len(steps) == 2 and all(0 <= e["rewards/even_tokens/mean"] <= 1 for e in steps)
    assert any(e["grad_norm"] > 0 for e in steps), steps  # the policy loss reached the adapter
    assert not (tmp_path / loss / "adapter" / "ref").exists()  # TRL's reference copy stays out


def test_qlora_grpo_trains_its_adapter_on_a_4_bit_base(tiny_model_dir, prompts, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)
    result = invoke("run", "--model", tiny_model_dir, "--data", f"{prompts}#4", "--task", "grpo", "--quantization",
                    "nf4", "--reward", f"{reward}:even_tokens", "--num-generations", 4, "--max-completion-length", 6,
                    "--grad-accum", 1, "--max-steps", 2, "--logging-steps", 1, "--output-dir", tmp_path,
                    "--run-name", "q")  # fmt: skip
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (tmp_path / "q" / "logs" / "train_log.jsonl").read_text().splitlines()]
    assert any(e.get("grad_norm", 0) > 0 for e in steps), steps  # the policy loss reached the adapter
    assert "nf4" in (tmp_path / "q" / "config.yaml").read_text()
    assert (tmp_path / "q" / "adapter" / "adapter_model.safetensors").is_file()


RAISES = """
def score(completions, **kwargs):
    return [len(c[0]["content"]) / 0 for c in completions]
"""


def test_a_reward_that_raises_stops_the_run_with_its_file_line_prompt_and_completion(
    tiny_model_dir, prompts, tmp_path
):
    reward = tmp_path / "bad_reward.py"
    reward.write_text(RAISES)
    result = invoke("run", "--model", tiny_model_dir, "--data", prompts, "--task", "grpo", "--reward",
                    f"{reward}:score", "--num-generations", 4, "--max-completion-length", 4, "--max-steps", 1,
                    "--output-dir", tmp_path, "--run-name", "bad")  # fmt: skip
    assert result.exit_code != 0
    assert f"reward {reward}:score raised at {reward}:3: ZeroDivisionError: division by zero" in result.output
    assert "prompt:     'What is 2+2?'" in result.output and "completion: '" in result.output
    assert "Traceback" not in result.output


def test_a_grpo_run_resumed_from_a_checkpoint_samples_and_trains_as_the_whole_run(tiny_model_dir, prompts, tmp_path):
    """The folder a crash after checkpoint-2 leaves, resumed: the same completions (their
    rewards), the same steps and the same adapter, bit for bit."""
    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)
    data = write_jsonl(tmp_path / "four.jsonl", [{"prompt": f"Say {w}.", "solution": "4"} for w in "abcd"])

    def run(name, *more):
        return invoke("run", "--model", tiny_model_dir, "--data", data, "--task", "grpo", "--reward",
                      f"{reward}:even_tokens", "--num-generations", 4, "--max-completion-length", 6,
                      "--grad-accum", 1, "--max-steps", 4, "--save-steps", 2, "--logging-steps", 1,
                      "--output-dir", tmp_path, "--run-name", name, *more)  # fmt: skip

    assert run("whole").exit_code == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for name in ("checkpoint-4", "adapter"):
        shutil.rmtree(tmp_path / "resumed" / name)
    (tmp_path / "resumed" / "run_summary.json").unlink()
    result = run("resumed", "--resume", "auto")
    assert result.exit_code == 0, result.output
    keys = ("step", "loss", "grad_norm", "reward", "rewards/even_tokens/std")

    def steps(name):
        lines = (tmp_path / name / "logs" / "train_log.jsonl").read_text().splitlines()
        return [[e[k] for k in keys] for e in map(json.loads, lines) if "loss" in e]

    assert steps("resumed") == steps("whole") and len(steps("whole")) == 4
    a, b = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_static_cache_samples_the_same_completions_and_trains_the_same_adapter(tiny_model_dir, prompts, tmp_path):
    """grpo.static_cache changes where the keys and values wait, not what is sampled (on the CPU
    transformers does not compile the decoding step, so this holds the cache itself)."""
    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)

    def run(static):
        result = invoke("run", "--model", tiny_model_dir, "--data", f"{prompts}#4", "--task", "grpo", "--reward",
                        f"{reward}:even_tokens", "--num-generations", 4, "--max-completion-length", 6,
                        "--grad-accum", 1, "--max-steps", 2, "--logging-steps", 1, "--set",
                        f"grpo.static_cache={static}", "--output-dir", tmp_path, "--run-name", static)  # fmt: skip
        assert result.exit_code == 0, result.output
        lines = (tmp_path / static / "logs" / "train_log.jsonl").read_text().splitlines()
        steps = [[e["loss"], e["reward"], e["rewards/even_tokens/std"]] for e in map(json.loads, lines) if "loss" in e]
        return steps, load_file(tmp_path / static / "adapter" / "adapter_model.safetensors")

    (growing, a), (static, b) = run("false"), run("true")
    assert static == growing and len(growing) == 2 and any(step[2] > 0 for step in growing), growing
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_out_of_memory_while_sampling_halves_the_generation_batch_and_trains_the_same(
    tiny_model_dir, prompts, tmp_path, monkeypatch
):
    """generate raising CUDA's out-of-memory error above 2 sequences: the run samples its 4
    completions 2 at a time, says so, and logs the same steps and adapter as the run without."""
    from transformers.generation.utils import GenerationMixin

    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)

    def run(name):
        result = invoke("run", "--model", tiny_model_dir, "--data", f"{prompts}#4", "--task", "grpo", "--reward",
                        f"{reward}:even_tokens", "--num-generations", 4, "--max-completion-length", 6,
                        "--grad-accum", 1, "--max-steps", 2, "--logging-steps", 1, "--output-dir", tmp_path,
                        "--run-name", name)  # fmt: skip
        assert result.exit_code == 0, result.output
        lines = (tmp_path / name / "logs" / "train_log.jsonl").read_text().splitlines()
        steps = [[e["loss"], e["reward"], e["rewards/even_tokens/std"]] for e in map(json.loads, lines) if "loss" in e]
        return steps, load_file(tmp_path / name / "adapter" / "adapter_model.safetensors"), result.output

    whole, a, _ = run("whole")
    own = GenerationMixin.generate

    def generate(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return own(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    parted, b, output = run("parted")
    assert "sampling 4 completions at once ran out of GPU memory; sampling 2 at a time from now on" in output
    assert parted == whole and len(whole) == 2 and any(step[2] > 0 for step in whole), whole
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
