"""QLoRA (bitsandbytes nf4) on CPU with the tiny model; the adapter loads on the 16-bit base."""
import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.conftest import write_jsonl


def test_qlora_trains_on_cpu_and_adapter_loads_on_16bit_base(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "response": "a b c"}] * 4)
    result = CliRunner().invoke(main, [
        "run", "--model", str(tiny_model_dir), "--data", str(data), "--quantization", "nf4",
        "--max-steps", "2", "--output-dir", str(tmp_path), "--run-name", "q"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "model.quantization           = 'nf4'" in result.output
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "q" / "adapter")
    weights = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert weights and any(w.abs().sum() > 0 for w in weights)  # B starts at zero: it trained
