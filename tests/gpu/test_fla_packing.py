"""Qwen3.5's Gated DeltaNet layers on a packed row with flash-linear-attention's varlen kernels
(models/linear_attention.py: one call with cu_seqlens) compute what the layers compute sample by
sample: `make test-gpu` on a machine with fla-core installed (pip install fla-core==0.6.0).
Skipped without a GPU or without fla."""

import pytest
import torch

from tests.unit.test_linear_attention import LENGTHS, packed_and_alone, summed_loss_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_bf16_model():
    """A tiny Qwen3.5 (4 layers, three of them Gated DeltaNet with 64-wide heads: fla's kernels
    take head dims of 16 and more) with LoRA on every linear layer, in bf16 on the GPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_lab.models.lora import linear_module_names
    from tests.support.families import tiny_family_config

    torch.manual_seed(0)
    config = tiny_family_config(
        "qwen3.5-0.8b",
        vocab_size=512,
        hidden_size=128,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        initializer_range=0.05,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=linear_module_names(model), init_lora_weights=False
    )
    return get_peft_model(model, lora)


def test_fla_varlen_kernels_restart_each_sample_of_a_packed_row(monkeypatch):
    pytest.importorskip("fla")
    from lora_lab.models import linear_attention

    assert linear_attention.fla_kernels() is not None, "fla is installed but its kernels do not import"
    calls = []
    original = linear_attention.gated_delta_varlen

    def counted(*args):
        calls.append(args[2].tolist())
        return original(*args)

    monkeypatch.setattr(linear_attention, "gated_delta_varlen", counted)
    results = {}
    for use_fla in (False, True):  # the same weights: the per-sample path, then fla's varlen path
        model = tiny_bf16_model()
        linear_attention.keep_samples_apart(model.base_model.model, use_fla=use_fla)
        batch, one_by_one = packed_and_alone("mask")
        cuda = [{k: v.cuda() if hasattr(v, "cuda") else v for k, v in b.items()} for b in [batch, *one_by_one]]
        results[use_fla] = summed_loss_and_grads(model, cuda[:1]), summed_loss_and_grads(model, cuda[1:])
    ends = [sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)]
    assert calls and all(c == ends for c in calls), calls  # fla ran, once per layer, on the samples
    (fla_packed, _), (per_sample_packed, alone) = results[True], results[False]
    for packed in (fla_packed, per_sample_packed):
        assert packed[0] == pytest.approx(alone[0], rel=2e-2)
        for name, grad in alone[1].items():
            scale = grad.float().abs().max().item()
            assert (packed[1][name].float() - grad.float()).abs().max().item() <= 5e-2 * scale, name
