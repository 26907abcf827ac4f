"""Guards on the tiny model: non-finite updates, out of memory, settings drift, unsafe files."""

import json
import pickle
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from lora_lab.cli import main
from lora_lab.training.checkpoint import write_manifest
from lora_lab.training.trainer import LoraLabTrainer
from tests.support.tiny import write_jsonl

COMMON = [
    "--micro-batch-size",
    2,
    "--grad-accum",
    1,
    "--logging-steps",
    1,
    "--lora-rank",
    4,
    "--lr",
    "1e-2",
    "--set",
    "train.lr_scheduler=constant",
    "--set",
    "train.warmup_ratio=0",
]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(12)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "qa.jsonl", rows)


def run(tiny_model_dir, data, out, name, *extra):
    return invoke(
        "run", "--model", tiny_model_dir, "--data", data, "--output-dir", out, "--run-name", name, *COMMON, *extra
    )


def saved_tensors(run_dir):
    """Every tensor a run wrote: adapters (checkpoints and final) and optimizer states."""
    tensors = []
    for path in run_dir.rglob("adapter_model.safetensors"):
        tensors += list(load_file(path).values())
    for path in run_dir.rglob("optimizer.pt"):
        state = torch.load(path, weights_only=True)["state"]
        tensors += [t for entry in state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    return tensors


def adapter_at(run_dir, step):
    return load_file(run_dir / f"checkpoint-{step}" / "adapter_model.safetensors")


# ----------------------------------------------------------------------------- non-finite


def test_a_nan_loss_stops_the_run_before_the_update(tiny_model_dir, data, tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_TEST_NAN_STEP", "3")
    result = run(tiny_model_dir, data, tmp_path, "nan", "--max-steps", 5, "--save-steps", 1)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: step 3: the loss is nan. The update was not applied" in result.output
    assert "Likely cause:" in result.output and "--on-nonfinite skip" in result.output
    run_dir = tmp_path / "nan"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not (run_dir / "adapter").exists()
    assert all(torch.isfinite(t).all() for t in saved_tensors(run_dir))


def test_skip_drops_the_bad_update_and_counts_it(tiny_model_dir, data, tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_TEST_NAN_STEP", "3")
    result = run(
        tiny_model_dir,
        data,
        tmp_path,
        "skip",
        "--max-steps",
        5,
        "--save-steps",
        1,
        "--on-nonfinite",
        "skip",
        "--set",
        "train.save_total_limit=10",
    )
    assert result.exit_code == 0, result.output
    assert "warning: step 3: the loss is nan; update skipped (1 skipped so far)" in result.output
    assert "skipped 1 update(s) with a NaN or inf loss or gradient, at steps [3]" in result.output
    run_dir = tmp_path / "skip"
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["nonfinite_skipped_steps"] == [3] and summary["global_step"] == 5
    before, skipped, after = (adapter_at(run_dir, s) for s in (2, 3, 4))
    assert all(torch.equal(before[k], skipped[k]) for k in before)  # step 3 changed nothing
    assert not all(torch.equal(skipped[k], after[k]) for k in skipped)  # step 4 trained
    tensors = saved_tensors(run_dir)
    assert len(tensors) > 50 and all(torch.isfinite(t).all() for t in tensors)


# ----------------------------------------------------------------------------- out of memory


def simulate_oom(monkeypatch, largest_fitting_batch: int, from_step: int = 3):
    """From `from_step` on, micro-batches larger than `largest_fitting_batch` "do not fit"."""
    original = LoraLabTrainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        too_big = inputs["input_ids"].shape[0] > largest_fitting_batch
        if self.state.global_step + 1 >= from_step and too_big:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, model, inputs, num_items_in_batch)

    monkeypatch.setattr(LoraLabTrainer, "training_step", training_step)


def test_out_of_memory_halves_the_micro_batch_and_resumes(tiny_model_dir, data, tmp_path, monkeypatch):
    simulate_oom(monkeypatch, largest_fitting_batch=1)
    args = ("--max-steps", 6, "--save-steps", 2, "--micro-batch-size", 4)
    result = run(tiny_model_dir, data, tmp_path, "oom", *args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "oom"
    assert (
        "out of GPU memory at step 3 with micro-batch 4 x grad-accum 1; retrying with "
        "micro-batch 2 x grad-accum 2 (same effective batch of 4)"
    ) in result.output
    assert "retrying with micro-batch 1 x grad-accum 4" in result.output
    assert result.output.count(f"resuming from {run_dir / 'checkpoint-2'}") == 2
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["train"]["micro_batch_size"], saved["train"]["grad_accum"]) == (1, 4)
    assert saved["resolved_from"]["train.micro_batch_size"] == "out-of-memory retry"
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "logs" / "train_log.jsonl").open()
        if "loss" in json.loads(line)
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    # Resuming later with the original flags continues at the micro-batch that fits.
    again = run(tiny_model_dir, data, tmp_path, "oom", *args, "--max-steps", 7, "--resume", "auto")
    assert again.exit_code == 0, again.output
    assert "resuming with micro-batch 1 x grad-accum 4, as the run did after running out of memory" in again.output


def test_out_of_memory_at_micro_batch_1_says_what_to_change(tiny_model_dir, data, tmp_path, monkeypatch):
    simulate_oom(monkeypatch, largest_fitting_batch=0, from_step=1)
    result = run(tiny_model_dir, data, tmp_path, "oom1", "--max-steps", 2, "--micro-batch-size", 2)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: out of GPU memory at step 1 even with --micro-batch-size 1" in result.output
    for fix in ("Lower --max-length", "smaller GPU or a smaller model", "--quantization nf4"):
        assert fix in result.output


def test_out_of_memory_without_retry_says_how_to_continue(tiny_model_dir, data, tmp_path, monkeypatch):
    simulate_oom(monkeypatch, largest_fitting_batch=1, from_step=1)
    result = run(tiny_model_dir, data, tmp_path, "noretry", "--max-steps", 2, "--no-oom-retry")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        "out of GPU memory at step 1 with --micro-batch-size 2. Continue with "
        "--micro-batch-size 1 --grad-accum 2 --resume auto"
    ) in result.output


# ----------------------------------------------------------------------------- drift


def test_resuming_with_other_settings_is_refused_with_the_list(tiny_model_dir, data, tmp_path):
    own = shutil.copy(data, tmp_path / "qa.jsonl")
    first = run(tiny_model_dir, own, tmp_path, "drift", "--max-steps", 2, "--save-steps", 1, "--resume", "auto")
    assert first.exit_code == 0, first.output
    assert f"no complete checkpoint in {tmp_path / 'drift'}; starting a new run" in first.output
    with open(own, "a") as handle:
        handle.write(json.dumps({"query": "New?", "response": "New row."}) + "\n")
    other_model = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
    result = invoke(
        "run",
        "--model",
        other_model,
        "--data",
        own,
        "--output-dir",
        tmp_path,
        "--run-name",
        "drift",
        *COMMON,
        "--max-steps",
        3,
        "--resume",
        "auto",
        "--lora-rank",
        8,
        "--max-length",
        256,
        "--micro-batch-size",
        1,
        "--grad-accum",
        2,
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    listed = [line[4:].split(":")[0] for line in result.output.splitlines() if line.startswith("  - ")]
    assert listed == [
        "model.name (--model)",
        "lora.rank (--lora-rank)",
        "data.max_length (--max-length)",
        "train.micro_batch_size (--micro-batch-size)",
        "train.grad_accum (--grad-accum)",
        "training data",
    ]
    assert "lora.rank (--lora-rank): 4 in the run, 8 now" in result.output
    assert "12 samples (sha256" in result.output and "13 samples" in result.output
    assert "--allow-config-change" in result.output
    allowed = run(
        tiny_model_dir, own, tmp_path, "drift", "--max-steps", 3, "--resume", "auto", "--allow-config-change"
    )
    assert allowed.exit_code == 0, allowed.output
    assert "warning: --allow-config-change: training data: 12 samples" in allowed.output


# ----------------------------------------------------------------------------- safe loading


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_planted_pickle_payload_never_runs_on_resume(tiny_model_dir, data, tmp_path):
    first = run(tiny_model_dir, data, tmp_path, "planted", "--max-steps", 2, "--save-steps", 1)
    assert first.exit_code == 0, first.output
    checkpoint, marker = tmp_path / "planted" / "checkpoint-2", tmp_path / "pwned"
    with open(checkpoint / "rng_state.pth", "wb") as handle:
        pickle.dump({"python": _Payload(marker)}, handle)
    write_manifest(checkpoint, 2, None)  # checksums match: only weights_only stands in the way
    result = run(tiny_model_dir, data, tmp_path, "planted", "--max-steps", 3, "--resume", checkpoint)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{checkpoint / 'rng_state.pth'} was refused by torch.load(weights_only=True)" in result.output
    auto = run(tiny_model_dir, data, tmp_path, "planted", "--max-steps", 3, "--resume", "auto")
    assert auto.exit_code == 0, auto.output
    assert "not resuming from checkpoint-2" in auto.output and "(step 1)" in auto.output
    assert not marker.exists()


def test_remote_code_is_refused_without_the_flag(tiny_model_dir, data, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "pwned"
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    result = invoke("run", "--model", model, "--data", data, "--output-dir", tmp_path, "--max-steps", 1)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "ships its own Python code (auto_map in config.json)" in result.output
    assert "--trust-remote-code" in result.output
    assert not marker.exists() and not list(tmp_path.glob("remote-*"))
