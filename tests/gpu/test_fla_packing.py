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


def packed_row_on_fla(monkeypatch, linear_attention, backward: bool):
    """(calls of the varlen path, {use_fla: (packed, alone)}) with the same weights through the
    per-sample path and fla's varlen path; losses only (no_grad) where backward is False."""
    calls = []
    original = linear_attention.gated_delta_varlen

    def counted(*args):
        calls.append(args[2].tolist())
        return original(*args)

    monkeypatch.setattr(linear_attention, "gated_delta_varlen", counted)
    if not backward:  # the forward kernels alone, where fla refuses its backward
        monkeypatch.setattr(linear_attention, "fla_backward_refusal", lambda: None)
        linear_attention.fla_kernels.cache_clear()
    results = {}
    for use_fla in (False, True):  # the same weights: the per-sample path, then fla's varlen path
        model = tiny_bf16_model()
        linear_attention.keep_samples_apart(model.base_model.model, use_fla=use_fla)
        batch, one_by_one = packed_and_alone("mask")
        cuda = [{k: v.cuda() if hasattr(v, "cuda") else v for k, v in b.items()} for b in [batch, *one_by_one]]
        if backward:
            results[use_fla] = summed_loss_and_grads(model, cuda[:1]), summed_loss_and_grads(model, cuda[1:])
        else:
            with torch.no_grad():
                results[use_fla] = summed_loss(model, cuda[:1]), summed_loss(model, cuda[1:])
    linear_attention.fla_kernels.cache_clear()
    return calls, results


def lengths_of(cu_seqlens: list) -> list:
    """The sample lengths of a packed row's cu_seqlens, in order of size (the packer orders them)."""
    return sorted(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))


def summed_loss(model, batches) -> float:
    total = 0.0
    for batch in batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        total += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum", ignore_index=-100
        ).item()
    return total


def test_fla_varlen_forward_restarts_each_sample_of_a_packed_row(monkeypatch):
    pytest.importorskip("fla")
    from lora_lab.models import linear_attention

    calls, results = packed_row_on_fla(monkeypatch, linear_attention, backward=False)
    assert calls and all(lengths_of(c) == sorted(LENGTHS) for c in calls), calls  # fla ran on the samples
    for packed, alone in results.values():
        assert packed == pytest.approx(alone, rel=2e-2)


def test_fla_is_not_used_where_it_refuses_its_backward():
    pytest.importorskip("fla")
    from lora_lab.models import linear_attention

    linear_attention.fla_kernels.cache_clear()
    why = linear_attention.fla_backward_refusal()
    if why is None:
        pytest.skip("fla trains on this GPU and Triton")
    assert linear_attention.fla_kernels() is None  # packed rows take the exact per-sample path


def test_fla_varlen_kernels_restart_each_sample_of_a_packed_row(monkeypatch):
    pytest.importorskip("fla")
    from lora_lab.models import linear_attention

    linear_attention.fla_kernels.cache_clear()
    why = linear_attention.fla_backward_refusal()
    if why:
        pytest.skip(why)
    calls, results = packed_row_on_fla(monkeypatch, linear_attention, backward=True)
    assert calls and all(lengths_of(c) == sorted(LENGTHS) for c in calls), calls  # fla ran on the samples
    (fla_packed, _), (per_sample_packed, alone) = results[True], results[False]
    for packed in (fla_packed, per_sample_packed):
        assert packed[0] == pytest.approx(alone[0], rel=2e-2)
        for name, grad in alone[1].items():
            scale = grad.float().abs().max().item()
            assert (packed[1][name].float() - grad.float()).abs().max().item() <= 5e-2 * scale, name
