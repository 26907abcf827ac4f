"""Preference tasks on the tiny model, through the real CLI and TRL's real trainers: every task
trains; DPO starts at ln 2 (policy == reference), also from an SFT run's adapter; every task
resumes exactly; `lora-lab eval` computes the trainer's own reward margin; the NaN guard and the
out-of-memory back-off hold; bad rows are reported by line."""

import json
import math
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from lora_lab.cli import main
from lora_lab.training.trainer import LoraLabMixin
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
    "--lora-dropout",
    0,
    "--max-length",
    64,
    "--lr",
    "5e-3",
]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pref")
    pairs = [{"prompt": f"Question {i}?", "chosen": f"Yes, {i}.", "rejected": f"No! {i} never."} for i in range(8)]
    labelled = [
        {"prompt": f"Question {i}?", "completion": f"Yes, {i}." if i % 2 else "No!", "label": bool(i % 2)}
        for i in range(8)
    ]
    chosen_only = [
        {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}]}
        for p in pairs
    ]
    return {
        "pairs": write_jsonl(folder / "pairs.jsonl", pairs),
        "labelled": write_jsonl(folder / "labelled.jsonl", labelled),
        "sft": write_jsonl(folder / "sft.jsonl", chosen_only),
    }


def run(model, data, out, name, *extra):
    return invoke("run", "--model", model, "--data", data, "--output-dir", out, "--run-name", name, *COMMON, *extra)


def logged(run_dir) -> list:
    lines = (run_dir / "logs" / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]


METRICS = {"dpo": "rewards/margins", "kto": "kl", "simpo": "rewards/margins", "orpo": "log_odds_ratio"}


@pytest.mark.parametrize("task", ["dpo", "orpo", "simpo", "kto"])
def test_each_task_trains_through_trls_trainer(tiny_model_dir, files, tmp_path, task):
    data = files["labelled" if task == "kto" else "pairs"]
    result = run(tiny_model_dir, data, tmp_path, task, "--task", task, "--max-steps", 2, "--save-steps", 2)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / task
    assert (run_dir / "checkpoint-2" / "manifest.json").is_file()
    assert not (run_dir / "adapter" / "ref").exists()  # TRL's frozen reference copy stays out
    weights = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in weights.items())
    steps = logged(run_dir)
    assert [s["step"] for s in steps] == [1, 2] and METRICS[task] in steps[0]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["task"] == task
    if task == "dpo":  # a new adapter starts at zero: policy == reference, loss ln 2
        assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert steps[0]["rewards/margins"] == 0 and steps[1]["rewards/margins"] > 0
        assert "the reference model is the base model" in result.output


def test_dpo_from_an_sft_run_takes_the_sft_policy_as_reference(tiny_model_dir, files, tmp_path):
    from lora_lab.use.evaluate import evaluate_run

    sft = run(tiny_model_dir, files["sft"], tmp_path, "sft", "--max-steps", 4, "--lr", "2e-2", "--lora-rank", 8)
    assert sft.exit_code == 0, sft.output
    moved = evaluate_run(tmp_path / "sft", [str(files["pairs"])])  # SFT adapter vs the base
    assert abs(moved["reward_margin"]) > 1e-3
    result = invoke(
        "run",
        "--task",
        "dpo",
        "--from-run",
        tmp_path / "sft",
        "--data",
        files["pairs"],
        "--output-dir",
        tmp_path,
        "--run-name",
        "dpo",
        "--micro-batch-size",
        2,
        "--grad-accum",
        1,
        "--logging-steps",
        1,
        "--max-steps",
        2,
        "--max-length",
        64,
    )
    assert result.exit_code == 0, result.output
    assert "the reference model is a frozen copy of the --from-run adapter" in result.output
    first = logged(tmp_path / "dpo")[0]
    # the policy starts as the SFT adapter and the reference is that same adapter: ln 2 (were
    # the reference the base, the margin above would make the loss differ from ln 2)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == 0
    saved = yaml.safe_load((tmp_path / "dpo" / "config.yaml").read_text())
    assert saved["lora"]["rank"] == 8 and saved["model"]["name"] == str(tiny_model_dir)
    assert saved["resolved_from"]["lora.rank"] == f"--from-run {tmp_path / 'sft'}"
    after = evaluate_run(tmp_path / "dpo", [str(files["pairs"])])  # against the SFT adapter
    assert after["reward_margin"] > 0 and after["preference_accuracy"] == 1.0


@pytest.mark.parametrize("task", ["dpo", "orpo", "simpo", "kto"])
def test_resume_from_a_checkpoint_is_exact(tiny_model_dir, files, tmp_path, task):
    data = files["labelled" if task == "kto" else "pairs"]
    args = ("--task", task, "--max-steps", 4, "--save-steps", 2, "--lora-dropout", 0.1)
    assert run(tiny_model_dir, data, tmp_path, "whole", *args).exit_code == 0
    # the folder a crash after checkpoint-2 leaves: no later checkpoint, no final adapter
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for name in ("checkpoint-4", "adapter"):
        shutil.rmtree(tmp_path / "resumed" / name)
    (tmp_path / "resumed" / "run_summary.json").unlink()
    result = run(tiny_model_dir, data, tmp_path, "resumed", *args, "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert "resuming from" in result.output and "(step 2)" in result.output
    keys = ("step", "loss", "grad_norm", "learning_rate", METRICS[task])
    whole, resumed = logged(tmp_path / "whole"), logged(tmp_path / "resumed")
    assert [[s[k] for k in keys] for s in resumed] == [[s[k] for k in keys] for s in whole]
    a, b = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_reports_the_trainers_reward_margin(tiny_model_dir, tmp_path):
    pairs = [
        {"prompt": f"Say {w}.", "chosen": f"{w}.", "rejected": f"Not {w}!"} for w in ("red", "green", "blue", "gold")
    ]
    data = write_jsonl(tmp_path / "four.jsonl", pairs)
    result = run(
        tiny_model_dir,
        data,
        tmp_path,
        "r",
        "--task",
        "dpo",
        "--max-steps",
        2,
        "--save-steps",
        1,
        "--micro-batch-size",
        4,
    )
    assert result.exit_code == 0, result.output
    step2 = logged(tmp_path / "r")[1]  # computed on all four pairs with checkpoint-1's weights
    shown = invoke("eval", tmp_path / "r" / "checkpoint-1", "--data", data)
    assert shown.exit_code == 0, shown.output
    report = json.loads((tmp_path / "r" / "eval_report.json").read_text())
    assert report["pairs"] == 4 and report["beta"] == 0.1
    assert report["reward_margin"] == pytest.approx(step2["rewards/margins"], rel=1e-4)
    assert report["preference_accuracy"] == step2["rewards/accuracies"]
    assert f"reward margin {report['reward_margin']:.4f}" in shown.output
    assert "preference accuracy" in shown.output


def test_nan_guard_and_out_of_memory_back_off_hold(tiny_model_dir, files, tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_TEST_NAN_STEP", "2")
    nan = run(tiny_model_dir, files["pairs"], tmp_path, "nan", "--task", "dpo", "--max-steps", 3, "--save-steps", 1)
    assert nan.exit_code == 2 and "error: step 2: the loss is nan. The update was not applied" in nan.output
    assert sorted(p.name for p in (tmp_path / "nan").glob("checkpoint-*")) == ["checkpoint-1"]
    monkeypatch.delenv("LORA_LAB_TEST_NAN_STEP")
    original = LoraLabMixin.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.state.global_step >= 1 and inputs["input_ids"].shape[0] > 2:  # two pairs
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, model, inputs, num_items_in_batch)

    monkeypatch.setattr(LoraLabMixin, "training_step", training_step)
    oom = run(tiny_model_dir, files["pairs"], tmp_path, "oom", "--task", "dpo", "--max-steps", 3, "--save-steps", 1)
    assert oom.exit_code == 0, oom.output
    assert "retrying with micro-batch 1 x grad-accum 2 (same effective batch of 2)" in oom.output
    assert [s["step"] for s in logged(tmp_path / "oom")] == [1, 2, 3]


def test_bad_rows_are_listed_and_sft_names_the_task(tiny_model_dir, files, tmp_path):
    good = json.loads(files["pairs"].read_text().splitlines()[0])
    data = write_jsonl(tmp_path / "mixed.jsonl", [good, {"prompt": "q", "chosen": "a"}, good, {**good, "chosen": ""}])
    result = run(tiny_model_dir, data, tmp_path, "bad", "--task", "dpo", "--max-steps", 1)
    assert result.exit_code == 0, result.output
    problems = [
        json.loads(line) for line in (tmp_path / "bad" / "logs" / "data_problems.jsonl").read_text().splitlines()
    ]
    assert [(p["origin"], p["reason"]) for p in problems] == [
        (f"{data}:2", "missing field `rejected`"),
        (f"{data}:4", "the chosen answer is empty"),
    ]
    sft = run(tiny_model_dir, files["pairs"], tmp_path, "sft", "--max-steps", 1)
    assert sft.exit_code != 0 and "Traceback" not in sft.output
    assert "train it with `--task dpo`" in sft.output


def test_loraplus_reaches_the_preference_trainers(tiny_model_dir, files, tmp_path):
    """train.loraplus_lr_ratio is not dropped for a preference task: the B matrices get the
    ratio times the learning rate in TRL's trainer too."""
    import torch

    result = run(
        tiny_model_dir,
        files["pairs"],
        tmp_path,
        "dpo-loraplus",
        "--task",
        "dpo",
        "--max-steps",
        1,
        "--save-steps",
        1,
        "--lr",
        "1e-2",
        "--set",
        "train.loraplus_lr_ratio=16",
    )
    assert result.exit_code == 0, result.output
    state = torch.load(tmp_path / "dpo-loraplus" / "checkpoint-1" / "optimizer.pt", weights_only=True)
    assert {round(g["initial_lr"], 8) for g in state["param_groups"] if g["params"]} == {1e-2, 0.16}
