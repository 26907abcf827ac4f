"""`lora-lab run` end to end on a tiny random Qwen2 with the real tokenizer: files, logs, learning."""

import json

import pytest
import yaml
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

ADAPTER_FILES = {
    "README.md",
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "tokenizer.json",
    "tokenizer_config.json",
}
CHECKPOINT_FILES = ADAPTER_FILES | {
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.json",
    "manifest.json",
}


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(24)]
    data = write_jsonl(out / "qa.jsonl", rows)
    result = run_cli(
        "run",
        "--preset",
        "cpu",
        "--model",
        tiny_model_dir,
        "--data",
        data,
        "--val-ratio",
        "0.25",
        "--max-steps",
        6,
        "--micro-batch-size",
        2,
        "--grad-accum",
        2,
        "--save-steps",
        2,
        "--logging-steps",
        1,
        "--eval-steps",
        3,
        "--output-dir",
        out,
        "--run-name",
        "tiny",
        "--lora-rank",
        4,
        "--seed",
        7,
    )
    assert result.exit_code == 0, result.output
    return out / "tiny", result.output


def test_run_writes_exactly_the_documented_files(finished_run):
    run_dir, _ = finished_run
    assert {p.name for p in run_dir.iterdir()} == {
        "config.yaml",
        "adapter",
        "logs",
        "plots",
        "run_summary.json",
        "checkpoint-4",
        "checkpoint-6",
    }
    assert {p.name for p in (run_dir / "adapter").iterdir()} == ADAPTER_FILES
    for step in (4, 6):
        assert {p.name for p in (run_dir / f"checkpoint-{step}").iterdir()} == CHECKPOINT_FILES
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"train_log.jsonl", "data_problems.jsonl"} <= logs
    assert any(name.startswith("events.out.tfevents") for name in logs)


def test_resolved_config_is_saved_with_sources(finished_run, tiny_model_dir):
    run_dir, output = finished_run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["name"] == str(tiny_model_dir)
    assert saved["lora"]["rank"] == 4 and saved["train"]["grad_accum"] == 2
    assert saved["resolved_from"]["lora.rank"] == "--lora-rank"
    assert saved["resolved_from"]["data.max_length"] == "preset cpu"
    assert "lora.rank                    = 4" in output and "(preset cpu)" in output


def test_adapter_loads_with_peft_and_changes_the_model(finished_run, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = finished_run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    before = base(ids).logits
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    after = model(ids).logits
    assert not torch.allclose(before, after)


def test_tensorboard_has_loss_lr_grad_norm_and_eval_loss(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = finished_run
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("eval/loss")][:2] == [3, 6]


def test_summary_and_step_log(finished_run):
    run_dir, _ = finished_run
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["global_step"] == 6 and summary["train_samples"] == 18
    assert summary["eval_loss"] is not None
    performance = summary["performance"]
    assert performance["timed_steps"] == 4 and len(performance["first_step_seconds"]) == 2
    # the run trained in this process: its recorded CPU peak is this process's peak up to then
    import resource

    peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert 0.1 < performance["cpu_peak_rss_gib"] <= peak_now + 1e-3
    assert performance["peak_reserved_gib"] is None  # no CUDA here
    assert "cpu_peak_rss_gib_per_gpu" not in performance  # one process: no per-GPU lists
    steps = [json.loads(line) for line in (run_dir / "logs" / "train_log.jsonl").open()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3, 4, 5, 6]


def test_existing_run_folder_is_not_overwritten(finished_run, tiny_model_dir):
    run_dir, _ = finished_run
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            "self-cognition",
            "--model-name",
            "A",
            "--model-author",
            "B",
            "--output-dir",
            str(run_dir.parent),
            "--run-name",
            "tiny",
            "--max-steps",
            "1",
        ],
    )
    assert result.exit_code == 2
    assert "already holds a run" in result.output and "Traceback" not in result.output


def test_tiny_model_learns_the_answer(tiny_model_dir, tmp_path):
    from lora_lab.use.infer import ask, load_adapter_model

    data = write_jsonl(
        tmp_path / "one.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Who are you?"},
                    {"role": "assistant", "content": "I am Aurora."},
                ]
            }
        ],
    )
    result = run_cli(
        "run",
        "--model",
        tiny_model_dir,
        "--data",
        f"{data}#8",
        "--max-steps",
        40,
        "--lr",
        "1e-2",
        "--lora-rank",
        16,
        "--lora-dropout",
        0,
        "--output-dir",
        tmp_path,
        "--run-name",
        "learn",
    )
    assert result.exit_code == 0, result.output
    model, tokenizer = load_adapter_model(tmp_path / "learn")
    assert ask(model, tokenizer, "Who are you?", max_new_tokens=10) == "I am Aurora."


def test_the_api_trains_twice_in_one_process(tiny_model_dir, tmp_path):
    """lora_lab.train stays the API function after the training package has been imported."""
    import lora_lab

    data = write_jsonl(tmp_path / "qa.jsonl", [{"query": f"Q{i}?", "response": f"A{i}."} for i in range(4)])
    results = []
    for name in ("first", "second"):
        config = lora_lab.resolve_config(
            "cpu",
            flags={
                "model.name": str(tiny_model_dir),
                "data.datasets": [str(data)],
                "train.max_steps": "1",
                "train.grad_accum": "1",
                "train.output_dir": str(tmp_path),
                "train.run_name": name,
            },
        )
        results.append(lora_lab.train(config))
    assert [r.run_dir.name for r in results] == ["first", "second"]
    assert all((r.adapter_dir / "adapter_model.safetensors").is_file() for r in results)
    assert callable(lora_lab.train) and lora_lab.train.__module__ == "lora_lab"
    from safetensors.torch import load_file

    # one optimizer step changed the adapter: warm-up did not take the only step (lr 0)
    weights = load_file(results[0].adapter_dir / "adapter_model.safetensors")
    assert any(bool(t.abs().sum() > 0) for k, t in weights.items() if "lora_B" in k)


@pytest.mark.parametrize(
    "damage,expected",
    [
        ("no-weights", "adapter_model.safetensors is missing: the adapter is damaged"),
        ("cut-weights", "adapter_model.safetensors is cut short"),
        ("bad-config", "config.yaml: not readable (line 4)"),
    ],
)
def test_a_broken_run_folder_is_one_clean_message(finished_run, tmp_path, damage, expected):
    import shutil

    run_dir = tmp_path / "broken"
    shutil.copytree(finished_run[0], run_dir)
    weights = run_dir / "adapter" / "adapter_model.safetensors"
    if damage == "no-weights":
        weights.unlink()
    elif damage == "cut-weights":
        weights.write_bytes(weights.read_bytes()[:-64])
    else:
        (run_dir / "config.yaml").write_text("preset: cpu\nmodel:\n  name: [unclosed\n")
    for command in (
        ["merge", run_dir, "--output", tmp_path / "merged"],
        ["chat", "--run", run_dir],
        ["eval", run_dir, "--data", "self-cognition"],
    ):
        result = CliRunner().invoke(main, [str(c) for c in command], input="/quit\n")
        assert result.exit_code == 2, result.output
        assert expected in result.output and "Traceback" not in result.output


def test_broken_model_files_are_one_clean_message(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    data = write_jsonl(tmp_path / "qa.jsonl", [{"query": "Q?", "response": "A."}])
    for spec, expected in ((model, f"{weights} is cut short"), (junk, "not a GGUF file")):
        result = CliRunner().invoke(
            main, ["run", "--model", str(spec), "--data", str(data), "--output-dir", str(tmp_path / "out")]
        )
        assert result.exit_code == 2 and expected in result.output, result.output
        assert "Traceback" not in result.output


def test_a_folder_without_config_json_is_refused_before_the_data_are_read(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    result = CliRunner().invoke(
        main, ["run", "--model", str(tmp_path / "not-a-model"), "--data", str(tmp_path / "missing.jsonl")]
    )
    assert result.exit_code == 2 and "has no config.json" in result.output, result.output
    assert "missing.jsonl" not in result.output.split("error:")[-1]  # the data come later


def test_merge_says_the_output_exists_before_loading_anything(finished_run, tmp_path):
    import subprocess
    import sys

    (tmp_path / "merged").mkdir()
    code = (
        "import sys\nfrom lora_lab.use.merge import merge_adapter\n"
        f"try:\n    merge_adapter({str(finished_run[0])!r}, output={str(tmp_path / 'merged')!r})\n"
        "except Exception as exc:\n    print(type(exc).__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "CheckpointError False"
