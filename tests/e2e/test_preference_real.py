"""DPO on the real Qwen2.5-Coder-0.5B-Instruct: a few steps on 32 pairs whose chosen answer
spells a sum in words ("Ten.") and whose rejected answer writes digits ("10."), then
`lora-lab eval` on 4 held-out sums: the reward margin and preference accuracy rise from the
reference's 0, and the model itself now prefers the spelled answers the base did not."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.paths import bundled_data_dir

pytestmark = pytest.mark.real_model
TRAIN = bundled_data_dir() / "number_words_pairs.jsonl"
HELD_OUT = bundled_data_dir() / "number_words_pairs_heldout.jsonl"


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_dpo_raises_the_held_out_margin_and_accuracy(real_model_gguf, tmp_path):
    held_out = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    trained = {json.loads(line)["prompt"] for line in TRAIN.read_text().splitlines()}
    assert len(trained) == 32 and not trained & {row["prompt"] for row in held_out}
    invoke(
        "run",
        "--preset",
        "cpu",
        "--task",
        "dpo",
        "--model",
        real_model_gguf,
        "--data",
        TRAIN,
        "--max-steps",
        2,
        "--micro-batch-size",
        2,
        "--lr",
        "1e-3",
        "--max-length",
        64,
        "--system",
        "Be brief.",
        "--logging-steps",
        1,
        "--output-dir",
        tmp_path,
        "--run-name",
        "dpo",
    )
    steps = [json.loads(line) for line in (tmp_path / "dpo" / "logs" / "train_log.jsonl").read_text().splitlines()]
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference
    shown = invoke("eval", tmp_path / "dpo", "--data", HELD_OUT)
    report = json.loads((tmp_path / "dpo" / "eval_report.json").read_text())
    assert report["pairs"] == 4 and "preference accuracy" in shown.output
    # before training the policy is the reference: margin 0, no pair preferred
    assert report["reward_margin"] > 0.5 and report["preference_accuracy"] == 1.0
    assert report["logp_accuracy"] > report["reference_logp_accuracy"]
