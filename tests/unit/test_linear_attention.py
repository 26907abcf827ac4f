"""Packed rows stay exact on the new families: a packed row gives each sample the loss and LoRA
gradients it has alone, through Qwen3.5's Gated DeltaNet layers (recurrent state and causal
conv restarted at each sample: models/linear_attention.py), its full attention, and SmolLM3's
layers without rotary embeddings (tiny random models of the shipped configs, CPU, seconds)."""

from __future__ import annotations

import pytest
import torch

from lora_lab.data import EncodedSample
from lora_lab.data.collate import PACKED_FIELDS, PackedCollator, SupervisedDataset
from lora_lab.data.encode import IGNORE_INDEX
from lora_lab.data.packing import pack_samples
from lora_lab.models.linear_attention import (
    gated_delta_varlen,
    keep_samples_apart,
    lengths_from_positions,
    linear_attention_layers,
)
from lora_lab.models.lora import linear_module_names
from tests.support.families import tiny_family_config

PAD = 0
LENGTHS = (9, 17, 5, 70)  # the last sample is longer than the delta rule's 64-token chunk


def sample(length: int, seed: int) -> EncodedSample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 500, (length,), generator=g).tolist()
    labels = [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]
    return EncodedSample(input_ids=ids, labels=labels, origin=f"s{seed}")


def tiny_lora_model(config_name: str, attention: str = "sdpa"):
    """A tiny random model of the family with LoRA (B != 0) on every linear layer, as
    lora.target_modules all-linear trains it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_family_config(config_name, vocab_size=512, use_cache=False, pad_token_id=PAD, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=linear_module_names(model), init_lora_weights=False
    )
    return get_peft_model(model, lora)


def summed_loss_and_grads(model, batches):
    model.zero_grad()
    total = 0.0
    for batch in batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def packed_and_alone(attention: str = "mask"):
    samples = [sample(n, seed) for seed, n in enumerate(LENGTHS)]
    one_by_one = [{"input_ids": torch.tensor([s.input_ids]), "labels": torch.tensor([s.labels])} for s in samples]
    packed = pack_samples(samples, samples_per_step=4, pack_length=128, seed=0)
    assert len(packed.rows) == 1
    row = SupervisedDataset(packed.rows, PACKED_FIELDS)[0]
    return PackedCollator(PAD, attention)([row]), one_by_one


def differences(model, batch, one_by_one) -> tuple[float, float]:
    """(relative loss difference, largest relative gradient difference) of the packed row vs
    alone (a parameter's largest difference over its largest gradient)."""
    alone, together = summed_loss_and_grads(model, one_by_one), summed_loss_and_grads(model, [batch])
    worst = max((together[1][n] - g).abs().max().item() / g.abs().max().item() for n, g in alone[1].items())
    return abs(together[0] - alone[0]) / alone[0], worst


@pytest.mark.parametrize("config_name", ["qwen3.5-0.8b", "smollm3-3b"])
@pytest.mark.parametrize("attention", ["mask", "segments"])
def test_a_packed_row_gives_each_sample_its_loss_and_gradients_alone(config_name, attention):
    from lora_lab.models.attention import register_packed_attention, skip_masks_of_packed_rows

    name = register_packed_attention(attention) if attention != "mask" else "sdpa"
    model = tiny_lora_model(config_name, name)
    base = model.base_model.model
    if attention != "mask":
        skip_masks_of_packed_rows(base)
    wrapped = keep_samples_apart(base)
    assert wrapped == (3 if config_name.startswith("qwen3.5") else 0)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model.train()
    batch, one_by_one = packed_and_alone(attention)
    loss_gap, grad_gap = differences(model, batch, one_by_one)
    assert loss_gap < 1e-6 and grad_gap < 1e-5, (loss_gap, grad_gap)


def test_without_the_restart_a_packed_qwen35_row_mixes_its_samples():
    """The check above can fail: the same row through the unwrapped model carries each sample's
    recurrent state into the next one."""
    model = tiny_lora_model("qwen3.5-0.8b")
    batch, one_by_one = packed_and_alone("mask")
    loss_gap, grad_gap = differences(model, batch, one_by_one)
    assert loss_gap > 1e-4 and grad_gap > 1e-3


def test_sample_lengths_come_from_position_ids_that_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert lengths_from_positions(positions) == [3, 2, 4]
    assert lengths_from_positions(positions[None].expand(4, 1, -1)) == [3, 2, 4]  # Qwen3.5's 4 rows
    assert lengths_from_positions(torch.arange(5)[None]) is None  # one sample
    assert lengths_from_positions(torch.tensor([[7]])) is None  # a decoding step
    assert lengths_from_positions(torch.zeros(2, 3, dtype=torch.long)) is None  # a batch of rows


def _reference_conv(x, weight, bias, activation, cu_seqlens):
    """fla's causal_conv1d contract ([1, tokens, channels], restart at cu_seqlens), sample by
    sample with PyTorch's conv."""
    import torch.nn.functional as F

    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        part = x[:, start:end].transpose(1, 2)
        out = F.conv1d(part, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=part.shape[1])
        outs.append(F.silu(out[..., : end - start]).transpose(1, 2))
    return torch.cat(outs, dim=1), None


def _reference_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens, output_final_state):
    """fla's chunk_gated_delta_rule contract (state restarted at cu_seqlens), sample by sample
    with transformers' PyTorch rule."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        part = slice(start, end)
        out, _ = torch_chunk_gated_delta_rule(
            q[:, part], k[:, part], v[:, part], g=g[:, part], beta=beta[:, part], use_qk_l2norm_in_kernel=True
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def test_the_varlen_layer_over_a_whole_row_equals_the_layer_sample_by_sample():
    """gated_delta_varlen (the CUDA path, one call with cu_seqlens) computes what the layer
    computes alone on each sample; here with reference kernels of fla's contract on the CPU
    (tests/gpu/test_fla_packing.py runs fla's own)."""
    model = tiny_lora_model("qwen3.5-0.8b")
    layer = linear_attention_layers(model)[0]
    torch.manual_seed(1)
    hidden = torch.randn(1, sum(LENGTHS), 64)
    ends = torch.tensor(LENGTHS).cumsum(0)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), ends])
    with torch.no_grad():
        whole = gated_delta_varlen(layer, hidden, cu_seqlens, _reference_conv, _reference_rule)
        alone = torch.cat([layer(part) for part in torch.split(hidden, list(LENGTHS), dim=1)], dim=1)
    torch.testing.assert_close(whole, alone, atol=1e-5, rtol=1e-4)


def test_a_stateful_layer_kind_lora_lab_cannot_restart_refuses_packed_rows():
    """A model whose config names a layer kind that carries a state along the sequence (neither
    attention nor Gated DeltaNet; here a tiny Llama whose config is told so) refuses a packed row
    with one message, and still trains on rows of one sample."""
    from lora_lab.errors import ModelError

    model = tiny_lora_model("llama-3.2-1b").base_model.model
    model.config.layer_types = ["recurrent", "full_attention"]
    assert keep_samples_apart(model) == 0
    batch, one_by_one = packed_and_alone("mask")
    with pytest.raises(ModelError, match=r"recurrent layers carry a state .* --set data.packing=false"):
        model(**{k: v for k, v in batch.items() if k != "labels"})
    model(**{k: v for k, v in one_by_one[0].items() if k != "labels"})


def test_where_fla_refuses_its_backward_transformers_layers_take_the_torch_delta_rule(monkeypatch):
    """On a Hopper GPU where fla refuses its gated backward, transformers' own Gated DeltaNet
    layers would call fla's kernel anyway (their wrapped function takes fla wherever it is
    installed): inside run_settings' context the modeling module calls the torch delta rule, the
    same computation, and gets its wrapped function back on exit. (The GPU check: a Qwen3.5-MoE
    QLoRA run trains on an H100 with fla installed, tests/gpu/test_moe_cuda.py.)"""
    import contextlib
    import importlib.util
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from lora_lab.models import linear_attention

    wrapped = modeling_qwen3_5.torch_chunk_gated_delta_rule
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(linear_attention, "fla_kernels", lambda: None)  # fla refuses to train here
    model = tiny_lora_model("qwen3.5-0.8b", "sdpa")
    ids = torch.tensor([[3, 9, 27, 81, 5, 17, 40, 2] * 9])
    with torch.no_grad(), contextlib.ExitStack() as stack:
        before = model(input_ids=ids).logits
        with monkeypatch.context() as on_cuda:  # entered as on a CUDA GPU; the model runs on the CPU
            on_cuda.setattr(torch.cuda, "is_available", lambda: True)
            stack.enter_context(linear_attention.torch_delta_rule_where_fla_refuses("qwen3_5_text"))
        torch_rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
        assert inspect.isfunction(torch_rule) and not hasattr(torch_rule, "__wrapped__") and torch_rule is not wrapped
        assert (
            torch_rule.__module__ == modeling_qwen3_5.__name__
            and torch_rule.__name__ == "torch_chunk_gated_delta_rule"
        )
        inside = model(input_ids=ids).logits
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is wrapped
    torch.testing.assert_close(inside, before, rtol=0, atol=0)
    with linear_attention.torch_delta_rule_where_fla_refuses("qwen3"):  # no delta rule: nothing changes
        assert modeling_qwen3_5.torch_chunk_gated_delta_rule is wrapped
