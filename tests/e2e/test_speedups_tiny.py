"""Training with packing and the long-sequence memory means follows the plain run's loss curve
(tiny Qwen2, real tokenizer, real Trainer). Every optimizer step holds the whole dataset, so the
order the samples are drawn in does not matter and the curves must agree step by step."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

ROWS = [{"query": f"Question {i}: {'why ' * (i % 5)}?", "response": f"Answer number {i}."} for i in range(8)]


def losses(tiny_model_dir, out, name, *extra):
    data = write_jsonl(out / "qa.jsonl", ROWS)
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--preset",
                "cpu",
                "--model",
                tiny_model_dir,
                "--data",
                data,
                "--max-steps",
                5,
                "--micro-batch-size",
                1,
                "--grad-accum",
                8,
                "--logging-steps",
                1,
                "--save-steps",
                100,
                "--lr",
                "1e-2",
                "--set",
                "lora.dropout=0",
                "--set",
                "train.gradient_checkpointing=true",
                "--output-dir",
                out,
                "--run-name",
                name,
                "--seed",
                3,
                *extra,
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    log = (out / name / "logs" / "train_log.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in log]
    return [s["loss"] for s in steps if "loss" in s and "train_runtime" not in s], result.output


def test_packing_and_memory_means_follow_the_plain_loss_curve(tiny_model_dir, tmp_path):
    plain, _ = losses(tiny_model_dir, tmp_path, "plain")
    fast, output = losses(
        tiny_model_dir,
        tmp_path,
        "fast",
        "--set",
        "data.packing=true",
        "--set",
        "data.pack_length=512",
        "--set",
        "train.offload_checkpoints=true",
        "--set",
        "train.mlp_chunk_tokens=8",
    )
    assert "packing: 8 samples per optimizer step in 1 row(s)" in output
    assert "layer checkpoints in CPU memory, MLP in chunks of 8 tokens" in output
    summary = json.loads((tmp_path / "fast" / "run_summary.json").read_text())
    assert summary["memory_means"] == "layer checkpoints in CPU memory, MLP in chunks of 8 tokens"
    assert len(plain) == len(fast) == 5
    assert plain[-1] < plain[0] - 0.5  # it learns
    assert fast == pytest.approx(plain, rel=2e-3)
    segments, _ = losses(
        tiny_model_dir,
        tmp_path,
        "segments",
        "--set",
        "data.packing=true",
        "--set",
        "data.pack_length=512",
        "--set",
        "data.packed_attention=segments",
    )
    assert segments == pytest.approx(plain, rel=2e-3)
    varlen, _ = losses(
        tiny_model_dir,
        tmp_path,
        "varlen",
        "--set",
        "data.packing=true",
        "--set",
        "data.pack_length=512",
        "--set",
        "data.packed_attention=varlen",
    )
    assert varlen == pytest.approx(plain, rel=2e-3)  # on CPU: the segments computation
