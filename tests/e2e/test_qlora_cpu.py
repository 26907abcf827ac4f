"""QLoRA (bitsandbytes nf4) on CPU with the tiny model; the adapter loads on the 16-bit base."""

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl


@pytest.mark.parametrize("tuner", ["lora", "dora"])  # dora on nf4: peft's QDoRA
def test_qlora_trains_on_cpu_and_adapter_loads_on_16bit_base(tiny_model_dir, tmp_path, tuner):
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "response": "a b c"}] * 4)
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--quantization",
            "nf4",
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "q",
            "--tuner",
            tuner,
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "model.quantization           = 'nf4'" in result.output
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "q" / "adapter")
    weights = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert weights and any(w.abs().sum() > 0 for w in weights)  # B starts at zero: it trained
    magnitudes = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]
    assert bool(magnitudes) is (tuner == "dora")


def test_qlora_adapter_merges_onto_the_16bit_base(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    import json

    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "response": "a b c"}] * 4)
    CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--quantization",
            "nf4",
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "q",
        ],
        catch_exceptions=False,
    )
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "q"), "--dtype", "fp32"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "merged onto the 16-bit base, not into 4-bit weights" in result.output
    report = json.loads((tmp_path / "q" / "merged" / "merge_report.json").read_text())
    assert report["trained_with_quantization"] == "nf4" and report["max_abs_logit_diff"] < 1e-4
    config = json.loads((tmp_path / "q" / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "q" / "merged")
    assert {type(m).__name__ for m in merged.modules()} >= {"Linear"}
    assert not any("4bit" in type(m).__name__ for m in merged.modules())
