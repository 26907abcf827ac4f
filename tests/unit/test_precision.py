"""--dtype auto: bf16 where the GPU has it, fp16 (fp32 LoRA weights, loss scaling) where it does
not, fp32 on CPU; impossible requests are refused naming the flag."""

import pytest
import torch

from lora_lab.config import LoraArgs, ModelArgs
from lora_lab.errors import ModelError
from lora_lab.models.load import Precision, choose_precision, load_base_model
from lora_lab.models.lora import apply_lora


def fake_gpu(monkeypatch, bf16: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_auto_on_cpu_is_fp32():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    assert choose_precision("auto") == Precision("fp32", bf16=False, fp16=False)


def test_auto_on_a_bf16_gpu_is_bf16(monkeypatch):
    fake_gpu(monkeypatch, bf16=True)
    assert choose_precision("auto") == Precision("bf16", bf16=True, fp16=False)


def test_auto_on_an_old_gpu_is_fp16_with_a_warning(monkeypatch):
    fake_gpu(monkeypatch, bf16=False)
    with pytest.warns(UserWarning, match="Qwen2.5 activations can overflow fp16"):
        assert choose_precision("auto") == Precision("fp16", bf16=False, fp16=True)


def test_impossible_requests_are_refused(monkeypatch):
    fake_gpu(monkeypatch, bf16=False)
    with pytest.raises(ModelError, match="--dtype bf16: this GPU has no bf16 support"):
        choose_precision("bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="--dtype fp16: mixed precision training needs a GPU"):
        choose_precision("fp16")


def test_fp16_base_gets_fp32_lora_weights(tiny_model_dir):
    model = load_base_model(ModelArgs(name=str(tiny_model_dir), kernels="none"), Precision("fp16", fp16=True))
    model = apply_lora(model, LoraArgs(rank=4))
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert lora == {torch.float32} and base == {torch.float16}
