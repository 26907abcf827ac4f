"""`lora-lab run --gpus 2` on CPU: two gloo processes launched through accelerate, the same path
a two-GPU run takes. Both ranks must end with the same adapter, the loss must match one process
at the same effective batch, and only rank 0 may write into the run folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.training.checkpoint import checkpoint_problems
from tests.e2e.test_run_tiny import ADAPTER_FILES, CHECKPOINT_FILES
from tests.support.runs import assert_same_training, step_losses
from tests.support.tiny import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
# micro-batch 2 x 2 processes = micro-batch 4 in one process; no dropout, so the two runs see the
# same samples in the same order and compute the same updates (up to float summation order).
COMMON = [
    "--data",
    None,
    "--max-steps",
    "4",
    "--grad-accum",
    "2",
    "--save-steps",
    "2",
    "--logging-steps",
    "1",
    "--lora-rank",
    "4",
    "--lora-dropout",
    "0",
    "--seed",
    "7",
    "--lr",
    "1e-3",
]


def _args(data: Path, out: Path, name: str, micro_batch: int, *extra) -> list:
    args = [str(data) if a is None else a for a in COMMON]
    return args + ["--micro-batch-size", str(micro_batch), "--output-dir", str(out), "--run-name", name, *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi")
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(24)]
    data = write_jsonl(out / "qa.jsonl", rows)
    weights = out / "weights.jsonl"
    env = {**os.environ, "LORA_LAB_TEST_WEIGHTS": str(weights), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_lab",
            "run",
            "--model",
            str(tiny_model_dir),
            *_args(data, out, "two", 2, "--gpus", "2"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = CliRunner().invoke(
        main, ["run", "--model", str(tiny_model_dir), *_args(data, out, "one", 4)], catch_exceptions=False
    )
    assert one.exit_code == 0, one.output
    return {
        "two": out / "two",
        "one": out / "one",
        "weights": weights,
        "output": two.stdout,
        "env": env,
        "data": data,
        "out": out,
        "model": tiny_model_dir,
    }


def test_launched_through_accelerate_with_two_gloo_processes(runs):
    assert "launching 2 CPU processes (gloo) with engine ddp" in runs["output"]
    assert "accelerate.commands.launch" in runs["output"] and "--num_processes 2" in runs["output"]
    launch = yaml.safe_load((runs["two"] / "launch" / "accelerate.yaml").read_text())
    assert launch["num_processes"] == 2 and launch["mixed_precision"] == "no"


def test_both_ranks_trained_the_same_adapter(runs):
    lines = [json.loads(line) for line in runs["weights"].read_text().splitlines()]
    two = [line for line in lines if line["world_size"] == 2]
    assert sorted(line["rank"] for line in two) == [0, 1]
    assert two[0]["sha256"] == two[1]["sha256"]


def test_loss_and_adapter_match_one_process_at_the_same_effective_batch(runs):
    assert_same_training(runs["one"], runs["two"], [1, 2, 3, 4])


def test_only_rank_0_wrote_the_run_folder(runs):
    run_dir = runs["two"]
    assert {p.name for p in run_dir.iterdir()} == {
        "config.yaml",
        "adapter",
        "logs",
        "launch",
        "plots",
        "run_summary.json",
        "checkpoint-2",
        "checkpoint-4",
    }
    assert {p.name for p in (run_dir / "adapter").iterdir()} == ADAPTER_FILES
    per_rank = CHECKPOINT_FILES - {"rng_state.pth"} | {"rng_state_0.pth", "rng_state_1.pth"}
    for step in (2, 4):
        assert {p.name for p in (run_dir / f"checkpoint-{step}").iterdir()} == per_rank
        assert checkpoint_problems(run_dir / f"checkpoint-{step}") == []
    assert {p.name for p in (run_dir / "launch").iterdir()} == {"accelerate.yaml", "run_config.yaml"}
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert [n for n in logs if not n.startswith("events.out.tfevents")] == ["data_problems.jsonl", "train_log.jsonl"]
    assert len(logs) == 3  # one TensorBoard file: rank 1 wrote none
    steps = [json.loads(line)["step"] for line in (run_dir / "logs" / "train_log.jsonl").open()]
    assert steps == sorted(steps) and len([s for s in step_losses(run_dir)]) == 4  # no duplicates


def test_run_config_keeps_where_values_came_from(runs):
    saved = yaml.safe_load((runs["two"] / "config.yaml").read_text())
    assert saved["train"]["gpus"] == 2 and saved["train"]["engine"] == "ddp"
    assert saved["train"]["micro_batch_size"] == 2
    assert saved["resolved_from"]["train.gpus"] == "--gpus"
    assert saved["resolved_from"]["data.max_length"] == "preset cpu"
    summary = json.loads((runs["two"] / "run_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["train_samples"] == 24
    # every process's memory figures, in rank order: on CPU only the resident memory peak
    performance = summary["performance"]
    rss = performance["cpu_peak_rss_gib_per_gpu"]
    assert len(rss) == 2 and all(0.1 < r < 8 for r in rss)
    assert performance["cpu_peak_rss_gib"] == max(rss)
    assert performance["peak_reserved_gib"] is None


def test_a_killed_two_process_run_resumes_exactly(runs):
    """Both ranks are killed before step 3; --resume auto continues from checkpoint-2 (both
    ranks' RNG states) and ends with the losses of the run that was never interrupted."""
    command = [
        sys.executable,
        "-m",
        "lora_lab",
        "run",
        "--model",
        str(runs["model"]),
        *_args(runs["data"], runs["out"], "killed", 2, "--gpus", "2"),
    ]
    killed = subprocess.run(
        command,
        cwd=ROOT,
        env={**runs["env"], "LORA_LAB_TEST_KILL": "step:3:1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert killed.returncode == 2 and "the launched run failed" in killed.stderr
    run_dir = runs["out"] / "killed"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    resumed = subprocess.run(
        command + ["--resume", "auto"], cwd=ROOT, env=runs["env"], capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert step_losses(run_dir) == step_losses(runs["two"])


# a minute of 2 CPU cores: opt-in (make test-slow); the one-process SIGTERM and this file's
# two-process kill -9 resume stay in make test
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="minutes of CPU; LORA_LAB_SLOW=1 runs it")
def test_a_sigterm_stops_both_processes_at_one_checkpoint(runs):
    """One rank receives SIGTERM before step 2 (a scheduler's notice): both ranks finish step 2,
    write checkpoint-2 and exit; lora-lab exits 143 and says how to continue, which gives the
    uninterrupted run's losses."""
    command = [
        sys.executable,
        "-m",
        "lora_lab",
        "run",
        "--model",
        str(runs["model"]),
        *_args(runs["data"], runs["out"], "sigterm", 2, "--gpus", "2"),
    ]
    stopped = subprocess.run(
        command,
        cwd=ROOT,
        env={**runs["env"], "LORA_LAB_TEST_KILL": "term:step:2:1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "stopped by SIGTERM after step 2" in stopped.stderr
    run_dir = runs["out"] / "sigterm"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (run_dir / "adapter").exists()
    resumed = subprocess.run(
        command + ["--resume", "auto"], cwd=ROOT, env=runs["env"], capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert step_losses(run_dir) == step_losses(runs["two"])
