"""The warm-up's first optimizer step trains: after step 1 of a 30-step run with warm-up, the
adapter is no longer the one it started from (LoRA's B matrices start at zero)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.tiny import write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_the_adapter_changes_on_step_one_of_a_warm_up(tiny_model_dir, tmp_path):
    """SIGTERM during step 1 (tests/support/faults.py) writes checkpoint-1: the adapter after
    exactly one step of a 30-step run whose first 3 steps warm up."""
    from safetensors.torch import load_file

    data = write_jsonl(
        tmp_path / "qa.jsonl", [{"query": f"Question {i}?", "response": f"Answer {i}."} for i in range(8)]
    )
    command = [sys.executable, "-m", "lora_lab", "run", "--model", str(tiny_model_dir), "--data", str(data)]
    command += [
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "warm",
        "--max-steps",
        "30",
        "--set",
        "train.warmup_ratio=0.1",
    ]
    env = {**os.environ, "LORA_LAB_TEST_KILL": "term:step:1:1"}
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 143, result.stderr[-3000:]
    run = tmp_path / "warm"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]
    (first,) = [json.loads(line) for line in (run / "logs" / "train_log.jsonl").open() if '"loss"' in line]
    assert first["step"] == 1 and first["learning_rate"] == 3e-4 / 4  # the cpu preset's lr / (3 + 1)
    weights = load_file(run / "checkpoint-1" / "adapter_model.safetensors")
    b_matrices = [t for name, t in weights.items() if "lora_B" in name]
    assert b_matrices and all(t.abs().max() > 0 for t in b_matrices)
