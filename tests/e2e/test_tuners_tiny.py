"""The tuners (--tuner lora | dora | ia3, lora.use_rslora, lora.init, train.loraplus_lr_ratio,
train.neftune_noise_alpha) end to end on the tiny Qwen2: a short real run through the real
Trainer, the adapter loaded with PeftModel.from_pretrained gives the trained model's logits, the
merge equals base + adapter, the vLLM hand-off says whether vLLM serves the adapter; and an exact
resume for dora, ia3, lora.init=pissa and LoRA+ (the kill-and-resume helpers of
test_resume_tiny.py)."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from lora_lab.cli import main
from tests.e2e import test_resume_tiny as resume
from tests.support.tiny import write_jsonl

STEPS = 3
CASES = {
    "lora": [],
    "rslora": ["--set", "lora.use_rslora=true"],
    "dora": ["--tuner", "dora"],
    "ia3": ["--tuner", "ia3", "--lr", "5e-2"],
    "gaussian": ["--set", "lora.init=gaussian"],
    "pissa": ["--set", "lora.init=pissa"],
    "olora": ["--set", "lora.init=olora"],
    "loraplus": ["--set", "train.loraplus_lr_ratio=16"],
    "neftune": ["--set", "train.neftune_noise_alpha=5"],
}
IDS = torch.tensor([[151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645]])


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Run folders, made on first use: STEPS steps of each case on the same data and seed."""
    out = tmp_path_factory.mktemp("tuners")
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(8)]
    data = write_jsonl(out / "qa.jsonl", rows)
    done = {}

    def run(name: str):
        if name not in done:
            args = [
                "run",
                "--model",
                tiny_model_dir,
                "--data",
                data,
                "--max-steps",
                STEPS,
                "--micro-batch-size",
                2,
                "--grad-accum",
                1,
                "--lr",
                "1e-2",
                "--lora-rank",
                4,
                "--lora-dropout",
                0,
                "--save-steps",
                STEPS,
                "--logging-steps",
                1,
                "--seed",
                3,
                "--output-dir",
                out,
                "--run-name",
                name,
                *CASES[name],
            ]
            result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
            assert result.exit_code == 0, result.output[-3000:]
            done[name] = out / name
        return done[name]

    return run


def logits_of(model_dir, adapter=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(IDS).logits


def adapter_config(run_dir):
    return json.loads((run_dir / "adapter" / "adapter_config.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_adapter_loads_gives_the_trained_logits_and_merges(runs, name, tiny_model_dir, tmp_path):
    from lora_lab.planning.serving import vllm_commands
    from lora_lab.use.merge import merge_adapter

    run_dir = runs(name)
    base = logits_of(tiny_model_dir)
    adapter = logits_of(tiny_model_dir, run_dir / "adapter")
    # the trained model: the last checkpoint's adapter as training held it (for pissa and olora
    # peft decomposes the base again on loading it, as the run did before its first step)
    trained = logits_of(tiny_model_dir, run_dir / f"checkpoint-{STEPS}")
    assert (adapter - base).abs().max() > 1e-2  # the adapter changes the model
    torch.testing.assert_close(adapter, trained, atol=2e-5, rtol=0)

    result = merge_adapter(run_dir, output=tmp_path / "merged", dtype="fp32")
    merged = logits_of(tmp_path / "merged")
    torch.testing.assert_close(merged, adapter, atol=1e-4, rtol=0)
    serving = vllm_commands(result)
    served = name not in ("dora", "ia3")
    assert ("adapter" in serving["commands"]) is served
    assert any("serve the merged folder" in w for w in serving["warnings"]) is not served


def test_each_option_reaches_peft(runs):
    assert adapter_config(runs("dora"))["use_dora"] is True
    ia3 = adapter_config(runs("ia3"))
    assert ia3["peft_type"] == "IA3" and ia3["feedforward_modules"] == ["down_proj"]
    assert adapter_config(runs("rslora"))["use_rslora"] is True
    assert adapter_config(runs("gaussian"))["init_lora_weights"] == "gaussian"
    for name in ("pissa", "olora"):  # converted: a plain LoRA of twice the rank on the base
        converted = adapter_config(runs(name))
        assert (converted["r"], converted["lora_alpha"]) == (8, 64)
        assert converted["init_lora_weights"] is True
        assert (runs(name) / "adapter_init" / "adapter_model.safetensors").is_file()
    assert not (runs("lora") / "adapter_init").exists()


def test_loraplus_gives_the_b_matrices_ratio_times_the_learning_rate(runs):
    state = torch.load(runs("loraplus") / f"checkpoint-{STEPS}" / "optimizer.pt", weights_only=True)
    rates = {round(g["initial_lr"], 8) for g in state["param_groups"] if g["params"]}
    assert rates == {1e-2, 0.16}
    plain = torch.load(runs("lora") / f"checkpoint-{STEPS}" / "optimizer.pt", weights_only=True)
    assert {g["initial_lr"] for g in plain["param_groups"]} == {1e-2}


def first_loss(run_dir):
    return resume.step_log(run_dir)[0]["loss"]


def test_neftune_noises_the_embeddings_of_the_same_step(runs):
    # same seed, data and initialisation (B = 0): only the noise can change the first loss
    assert first_loss(runs("neftune")) != first_loss(runs("lora"))
    assert first_loss(runs("rslora")) == first_loss(runs("lora"))  # B = 0: same first step


RESUMED = {
    "dora": ["--tuner", "dora"],
    "ia3": ["--tuner", "ia3"],
    "pissa": ["--set", "lora.init=pissa"],
    "pissa_niter": ["--set", "lora.init=pissa_niter_2"],  # randomised SVD: draws RNG
    "loraplus": ["--set", "train.loraplus_lr_ratio=16"],
}
# LoRA+'s resume takes over a minute of 2 CPU cores: make test-slow (LORA_LAB_SLOW=1); make test
# resumes the other tuners, and checks LoRA+'s optimizer groups in its saved optimizer state
# (test_loraplus_gives_the_b_matrices_ratio_times_the_learning_rate).
SLOW_RESUMES = {"loraplus"}
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="over a minute of CPU; LORA_LAB_SLOW=1 runs it"),
]


@pytest.mark.parametrize("tuner", [pytest.param(t, marks=SLOW if t in SLOW_RESUMES else []) for t in RESUMED])
def test_killed_run_resumes_exactly(tiny_model_dir, tmp_path_factory, tuner):
    out = tmp_path_factory.mktemp(f"resume-{tuner}")
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(10)]
    data = write_jsonl(out / "qa.jsonl", rows)
    setup = (
        out,
        [
            str(a)
            for a in [
                "--model",
                tiny_model_dir,
                "--data",
                data,
                "--output-dir",
                out,
                *resume.SETTINGS,
                *RESUMED[tuner],
            ]
        ],
    )
    resume.lora_lab_run(setup, "reference")
    resume.killed_run(setup, "killed", "step:5:2")
    output = resume.lora_lab_run(setup, "killed", "--resume", "auto")
    assert f"resuming from {out / 'killed' / 'checkpoint-4'} (step 4)" in output
    resume.assert_same_run(out / "killed", out / "reference")
