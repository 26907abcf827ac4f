"""gpt-oss as published: its experts stored in MXFP4 (`*_blocks`, `*_scales`) under a
`quantization_config` of quant_method mxfp4, which bitsandbytes' config cannot replace at load
(transformers refuses the pair). A tiny gpt-oss checkpoint written that way (random 4-bit codes
and scales, the layout transformers reads) loads for QLoRA with every linear layer but the output
head and every expert in nf4, each holding exactly the nf4 round trip of its de-quantized MXFP4
value, and `lora-lab run --quantization nf4 --set lora.experts=true` trains it, its adapter
loading on the 16-bit model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from lora_lab.cli import main
from tests.e2e.test_tiny_moe import ROWS, build_tiny_moe
from tests.support.tiny import write_jsonl

MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def write_mxfp4_gpt_oss(folder):
    """A tiny gpt-oss folder with its experts in MXFP4: [experts, out, in / 32, 16] bytes of two
    FP4 codes and [experts, out, in / 32] power-of-two scales (biased by 127)."""
    from safetensors.torch import load_file, save_file

    build_tiny_moe(folder, "gpt-oss-20b")
    weights = load_file(folder / "model.safetensors")
    codes = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(key).shape
        weights[f"{key}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=codes).byte()
        weights[f"{key}_scales"] = torch.randint(121, 125, (experts, outputs, inputs // 32), generator=codes).byte()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4}))
    return folder


def load(folder, quantization: str):
    from lora_lab.config import ModelArgs
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model

    args = ModelArgs(name=str(folder), quantization=quantization, attn_implementation="eager")
    return load_base_model(args, choose_precision("fp32"), LoadOptions(for_training=False))


def test_an_mxfp4_checkpoint_loads_for_qlora_with_every_linear_layer_and_expert_in_nf4(mxfp4_model):
    import bitsandbytes.functional as bnb

    from lora_lab.models.moe import EXPERT_WEIGHTS, expert_bytes, expert_modules

    plain, quantized = load(mxfp4_model, "none"), load(mxfp4_model, "nf4")
    assert expert_bytes(plain)["nf4"] == 0 and expert_bytes(quantized)["16-bit"] == 0
    reference = dict(plain.named_modules())
    linear = [(n, m) for n, m in quantized.named_modules() if isinstance(m, torch.nn.Linear)]
    assert [n for n, m in linear if not hasattr(m, "parametrizations")] == ["lm_head"]
    held = [(n, "weight") for n, m in linear if n != "lm_head"]
    held += [(n, key) for n, _ in expert_modules(quantized) for key in EXPERT_WEIGHTS]
    for name, key in held:
        value = getattr(reference[name], key).data
        round_trip = bnb.dequantize_4bit(*bnb.quantize_4bit(value, quant_type="nf4", compress_statistics=True))
        assert torch.equal(getattr(dict(quantized.named_modules())[name], key), round_trip), (name, key)


def train_with_expert_lora(model, out, preset: str = "cpu", repeats: int = 4, steps: int = 3):
    """`lora-lab run --quantization nf4 --set lora.experts=true` on `model` into out/r."""
    data = write_jsonl(out / "rows.jsonl", ROWS)
    args = ["run", "--preset", preset, "--model", model, "--data", f"{data}#{repeats}", "--max-steps", steps]
    args += ["--lr", "1e-2", "--lora-rank", 4, "--max-length", 64, "--quantization", "nf4"]
    args += ["--set", "lora.experts=true", "--lora-dropout", 0, "--output-dir", out, "--run-name", "r"]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def test_lora_lab_run_trains_gpt_oss_qlora_from_its_mxfp4_checkpoint(mxfp4_model, tmp_path):
    from peft import PeftModel

    train_with_expert_lora(mxfp4_model, tmp_path)
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    base = load(mxfp4_model, "none")
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, tmp_path / "r" / "adapter")
        assert len([m for m in tuned.modules() if type(m).__name__ == "ParamWrapper"]) == 4  # 2 layers x 2
        assert (tuned(input_ids=ids).logits - before).abs().max() > 1e-4
