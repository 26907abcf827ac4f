"""LoRA on the fused experts of a mixture-of-experts model (lora.experts: peft target_parameters):
a tiny Qwen3-MoE and gpt-oss train their experts' adapters beside the attention's through
`lora-lab run` on the CPU, the run says what it adapts, the saved adapter holds each expert
tensor's LoRA factors under peft's names, loads with peft, and merges into the base exactly;
with 4-bit experts (QLoRA) the adapter is laid out as on 16-bit ones; another tuner and dropout
are refused with the fix."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lora_lab.cli import main
from tests.e2e.test_tiny_moe import ROWS, build_tiny_moe
from tests.support.tiny import write_jsonl

IDS = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])


def run(out, name: str, *more):
    model_dir = out / "model"
    if not model_dir.is_dir():
        build_tiny_moe(model_dir, name)
    data = write_jsonl(out / "rows.jsonl", ROWS)
    args = ["run", "--preset", "cpu", "--model", model_dir, "--data", f"{data}#4", "--max-steps", 3]
    args += ["--lr", "1e-2", "--lora-rank", 4, "--max-length", 64, "--output-dir", out, "--run-name", "r"]
    return CliRunner().invoke(main, [str(a) for a in args + list(more)])


@pytest.mark.parametrize(
    "name, quantization", [("qwen3-30b-a3b", "none"), ("gpt-oss-20b", "none"), ("qwen3-30b-a3b", "nf4")]
)
def test_lora_on_the_experts_trains_saves_loads_and_merges(name, quantization, tmp_path):
    """16-bit experts, and 4-bit ones (QLoRA): the adapter is laid out the same either way."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_lab.planning.serving import vllm_commands
    from lora_lab.use.merge import merge_adapter

    more = ["--quantization", quantization, "--set", "lora.experts=true", "--lora-dropout", 0]
    result = run(tmp_path, name, *more)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "r"
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}  # routers stay frozen
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    experts = 8
    for layer in (0, 1):  # gate_up (64 -> 2 x 32) wrapped first, down (32 -> 64) around it, per expert
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        assert saved[f"{prefix}.base_layer.lora_A.weight"].shape == (4 * experts, 64)
        assert saved[f"{prefix}.base_layer.lora_B.weight"].shape == (64, 4 * experts)
        assert saved[f"{prefix}.lora_A.weight"].shape == (4 * experts, 32)
        assert saved[f"{prefix}.lora_B.weight"].shape == (64, 4 * experts)
        assert saved[f"{prefix}.lora_B.weight"].abs().max() > 0  # trained from zero
    attention = {"attn_implementation": "eager"} if name == "gpt-oss-20b" else {}
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, **attention)
        before = base(input_ids=IDS).logits
        tuned = PeftModel.from_pretrained(base, run_dir / "adapter")
        expected = tuned(input_ids=IDS).logits
        wrappers = [m for m in tuned.modules() if type(m).__name__ == "ParamWrapper"]
        assert len(wrappers) == 4 and (expected - before).abs().max() > 1e-4
        for wrapper in wrappers:  # the experts' adapters take part: without them the logits move
            wrapper.lora_B["default"].weight.zero_()
        assert (tuned(input_ids=IDS).logits - expected).abs().max() > 1e-5
        tuned = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, **attention),
            run_dir / "adapter",
        )
        torch.testing.assert_close(tuned(input_ids=IDS).logits, expected, rtol=0, atol=0)
    result = merge_adapter(run_dir, output=tmp_path / "merged", dtype="fp32")
    merged = result.output_dir
    hand_off = vllm_commands(result)  # vLLM is handed the merged folder only
    assert set(hand_off["commands"]) == {"merged"} and "the fused experts" in hand_off["warnings"][0]
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **attention)(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_run_says_what_it_adapts(tmp_path):
    from lora_lab.training.builder import adapted_modules

    class Config:
        target_modules = {"v_proj", "q_proj"}
        target_parameters = ["experts.gate_up_proj", "experts.down_proj"]

    assert (
        adapted_modules(Config) == "adapts q_proj, v_proj; the fused experts' experts.gate_up_proj, experts.down_proj"
    )


@pytest.mark.parametrize(
    "more, message",
    [
        (["--tuner", "dora", "--lora-dropout", 0], "which --tuner dora does not have: pass --tuner lora"),
        ([], "peft's LoRA on parameters takes no dropout: pass --lora-dropout 0 with lora.experts."),
    ],
)
def test_lora_on_the_experts_with_another_tuner_or_dropout_is_refused_with_the_fix(tmp_path, more, message):
    result = run(tmp_path, "qwen3-30b-a3b", "--set", "lora.experts=true", *more)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_lora_experts_on_a_dense_model_is_refused(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = CliRunner().invoke(main, ["run", "--preset", "cpu", "--model", str(tiny_model_dir), "--data", str(data),
                                       "--max-steps", "1", "--set", "lora.experts=true", "--lora-dropout", "0",
                                       "--output-dir", str(tmp_path)])  # fmt: skip
    assert result.exit_code != 0
    assert "lora.experts: this model has no fused expert weights in 16 bits to adapt" in result.output
