"""`lora-lab run --tuner full` on the tiny model: every weight trains, lr 1e-5 unless given, and
the run folder holds a model that from_pretrained loads (no adapter)."""

import json

import pytest
import yaml
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.training.checkpoint import checkpoint_problems
from tests.support.tiny import write_jsonl

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "chat_template.jinja",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    data = write_jsonl(
        out / "qa.jsonl", [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(8)]
    )
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--tuner",
            "full",
            "--max-steps",
            "3",
            "--save-steps",
            "3",
            "--output-dir",
            str(out),
            "--run-name",
            "full",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out / "full", result.output


def test_full_run_writes_a_from_pretrained_model_and_no_adapter(full_run, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    run_dir, output = full_run
    assert {p.name for p in run_dir.iterdir()} == {
        "config.yaml",
        "model",
        "logs",
        "plots",
        "run_summary.json",
        "checkpoint-3",
    }
    assert {p.name for p in (run_dir / "model").iterdir()} == MODEL_FILES
    assert checkpoint_problems(run_dir / "checkpoint-3") == []
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [
        name for name, p in trained.named_parameters() if not torch.equal(p, dict(base.named_parameters())[name])
    ]
    assert len(changed) == len(list(base.parameters()))  # every weight trained
    assert "model (from_pretrained):" in output and "full fine-tuning: all" in output


def test_full_run_uses_the_lower_learning_rate_unless_given(full_run):
    run_dir, output = full_run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["tuner"] == "full" and saved["train"]["lr"] == 1e-5
    assert saved["resolved_from"]["train.lr"] == "--tuner full default"
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["adapter_dir"] is None and summary["model_dir"].endswith("model")


def test_infer_eval_and_merge_of_a_full_run(full_run, tmp_path):
    """infer and eval read the run's own model/; merge says there is nothing to merge."""
    run_dir, _ = full_run
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"query": "Question 1?"}])
    out = tmp_path / "answers.jsonl"
    invoke = CliRunner().invoke
    result = invoke(
        main,
        [
            "infer",
            "--run",
            str(run_dir),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--greedy",
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 1
    data = write_jsonl(tmp_path / "qa.jsonl", [{"query": "Question 1?", "response": "Answer number 1."}])
    result = invoke(main, ["eval", str(run_dir), "--data", str(data), "--samples", "1"])
    assert result.exit_code == 0, result.output
    assert "loss" in result.output
    result = invoke(main, ["merge", str(run_dir)])
    assert result.exit_code != 0 and "nothing to merge" in result.output
    assert "Traceback" not in result.output
