"""Packing: a packed row computes what its samples compute one by one, and no token attends
across a sample boundary (CPU, tiny Qwen2 with the real tokenizer's ids)."""

from __future__ import annotations

import pytest
import torch

from lora_lab.data import EncodedSample
from lora_lab.data.collate import PACKED_FIELDS, PackedCollator, SupervisedDataset
from lora_lab.data.encode import IGNORE_INDEX
from lora_lab.data.packing import pack_samples
from lora_lab.errors import DataError

PAD = 151643


def sample(length: int, seed: int) -> EncodedSample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (length,), generator=g).tolist()
    labels = [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]  # the "reply" half trains
    return EncodedSample(input_ids=ids, labels=labels, origin=f"s{seed}")


def tiny_lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        use_cache=False,
    )
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )  # B != 0: LoRA shapes the loss
    return get_peft_model(model, lora)


def summed_loss_and_grads(model, batches):
    """Sum of token losses over all batches (what the Trainer's num_items_in_batch
    normalisation divides), and the LoRA gradients of that sum."""
    model.zero_grad()
    total = 0.0
    for batch in batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        shifted = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), shifted.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def packed_and_alone(model, attention: str = "mask"):
    """(batch of one packed row, its samples one by one, the packing) for 4 samples."""
    samples = [sample(n, seed) for seed, n in enumerate((9, 17, 5, 12))]
    one_by_one = [{"input_ids": torch.tensor([s.input_ids]), "labels": torch.tensor([s.labels])} for s in samples]
    packed = pack_samples(samples, samples_per_step=4, pack_length=64, seed=0)
    row = SupervisedDataset(packed.rows, PACKED_FIELDS)[0]
    return PackedCollator(PAD, attention)([row]), one_by_one, packed


def assert_same_loss_and_gradients(model, batch, one_by_one):
    alone = summed_loss_and_grads(model, one_by_one)
    together = summed_loss_and_grads(model, [batch])
    assert together[0] == pytest.approx(alone[0], rel=1e-5)
    for name, grad in alone[1].items():
        torch.testing.assert_close(together[1][name], grad, atol=1e-5, rtol=1e-4)


def test_a_packed_row_gives_the_loss_and_gradients_of_its_samples_one_by_one():
    model = tiny_lora_model()
    batch, one_by_one, packed = packed_and_alone(model)
    assert packed.rows_per_step == 1 and packed.longest_row == 43
    assert batch["position_ids"][0].tolist()[: packed.rows[0].lengths[0] + 1][-1] == 0
    assert_same_loss_and_gradients(model, batch, one_by_one)


@pytest.mark.parametrize("attention", ["segments", "varlen"])
def test_attention_from_sample_lengths_gives_the_loss_and_gradients_one_by_one(attention):
    """data.packed_attention=segments|varlen: no mask, the lengths and their cumulative sums
    (varlen's flash kernel is CUDA-only: on CPU it computes the segments way; the same check on
    the GPU is tests/gpu/test_means_cuda.py)."""
    from lora_lab.models.attention import register_packed_attention, skip_masks_of_packed_rows

    model = tiny_lora_model()
    model.base_model.model.set_attn_implementation(register_packed_attention(attention))
    skip_masks_of_packed_rows(model.base_model.model)
    masks = []
    for layer in model.base_model.model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
        )
    batch, one_by_one, packed = packed_and_alone(model, attention)
    lengths = packed.rows[0].lengths
    assert "attention_mask" not in batch and batch["packed_lengths"] == lengths
    assert batch["packed_cu_seqlens"].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert batch["packed_cu_seqlens"].dtype == torch.int32
    assert_same_loss_and_gradients(model, batch, one_by_one)
    masks.clear()
    with torch.no_grad():
        model(**batch)
    assert masks == [None, None]  # the packed row's two layers: no [tokens x tokens] mask
    padded = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    masks.clear()
    with torch.no_grad():
        model(**padded)
    assert masks[0] is not None and masks[0].shape[-2:] == (4, 4)  # evaluation's padding


def test_no_token_attends_across_a_sample_boundary():
    """Changing the first sample leaves the second sample's logits exactly as they were."""
    model = tiny_lora_model().eval()
    first, second = sample(8, 1), sample(6, 2)
    other_first = sample(8, 99)

    def logits_of_second(head):
        rows = pack_samples([head, second], 2, 32, seed=0).rows
        row = {"input_ids": rows[0].input_ids, "labels": rows[0].labels, "lengths": rows[0].lengths}
        batch = PackedCollator(PAD)([row])
        start = rows[0].lengths[0] if rows[0].input_ids[:8] == head.input_ids else 0
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]
        ).logits[0]
        return out[start : start + 6] if start else out[:6]

    with torch.no_grad():
        a, b = logits_of_second(first), logits_of_second(other_first)
        alone = model(input_ids=torch.tensor([second.input_ids])).logits[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a, alone, atol=1e-5, rtol=0)


def test_steps_keep_their_sample_count_and_rows_are_balanced():
    samples = [sample(n, i) for i, n in enumerate([30, 10, 10, 10, 25, 5, 5, 40, 8])]
    packed = pack_samples(samples, samples_per_step=4, pack_length=50, seed=3)
    # steps of 4, 4 and 1 samples; the largest step needs 2 rows of <= 50 tokens
    assert packed.rows_per_step == 2 and len(packed.rows) == 6
    counts = [len(r.lengths) for r in packed.rows]
    assert [counts[i] + counts[i + 1] for i in (0, 2, 4)] == [4, 4, 1]
    assert all(len(r.input_ids) <= 50 for r in packed.rows)
    assert sorted(n for r in packed.rows for n in r.lengths) == sorted(len(s.input_ids) for s in samples)
    empty = PackedCollator(PAD)([{"input_ids": [], "labels": [], "lengths": []}])
    assert empty["input_ids"].tolist() == [[PAD]] and empty["labels"].tolist() == [[-100]]
    alone = PackedCollator(PAD)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "lengths": [3]}])
    assert "attention_mask" not in alone  # a row of one sample keeps the flash/causal path
    assert alone["position_ids"].tolist() == [[0, 1, 2]]
    for row in packed.rows:  # the first token of every sample carries no loss
        starts = [sum(row.lengths[:i]) for i in range(len(row.lengths))]
        assert all(row.labels[s] == IGNORE_INDEX for s in starts)


def test_steps_of_one_row_are_packed_as_the_balancing_packs_them():
    import random

    from lora_lab.data.packing import _balance

    rng = random.Random(7)
    lengths = [rng.choice([3, 5, 5, 8, 13]) for _ in range(40)]
    samples = [sample(n, i) for i, n in enumerate(lengths)]
    packed = pack_samples(samples, samples_per_step=5, pack_length=80, seed=2)
    assert packed.rows_per_step == 1
    order = list(range(len(samples)))
    random.Random(2).shuffle(order)
    steps = [order[start : start + 5] for start in range(0, len(order), 5)]
    # ties in length keep the shuffled order, as _balance's stable sort keeps them
    assert packed.rows.plan == [_balance(step, 1, lengths)[0] for step in steps]
    assert packed.row_tokens == [sum(lengths[i] for i in step) for step in steps]


def test_a_sample_longer_than_the_row_is_refused_with_the_knob():
    with pytest.raises(DataError, match="data.pack_length=40"):
        pack_samples([sample(40, 0)], 1, 32, seed=0)


def test_packed_attention_keeps_a_sliding_window_within_each_sample():
    """Sliding-window layers (Gemma 3, Mistral): each token of a packed row sees itself and the
    window - 1 tokens before it, of its own sample only."""
    from types import SimpleNamespace

    from lora_lab.models.attention import segments_attention, varlen_attention

    torch.manual_seed(0)
    lengths, window = [10, 6, 3], 4
    q, k, v = torch.randn(1, 4, 19, 8), torch.randn(1, 2, 19, 8), torch.randn(1, 2, 19, 8)
    allowed = torch.zeros(19, 19, dtype=torch.bool)
    start = 0
    for n in lengths:
        for i in range(n):
            allowed[start + i, start + max(0, i - window + 1) : start + i + 1] = True
        start += n
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(
        1, 2
    )
    module = SimpleNamespace(training=False)
    for attend in (segments_attention, varlen_attention):  # varlen falls back to it on CPU
        out, _ = attend(
            module,
            q,
            k,
            v,
            None,
            packed_lengths=lengths,
            sliding_window=window,
            packed_cu_seqlens=torch.tensor([0, 10, 16, 19]),
        )
        torch.testing.assert_close(out, expected)
    unwindowed, _ = segments_attention(module, q, k, v, None, packed_lengths=lengths)
    assert not torch.allclose(unwindowed, expected)


def tiny_family_model(family: str):
    """A 2-layer model of `family` with LoRA on every linear layer, random B (a real effect)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    shape = dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
        # a sliding window shorter than the samples: its layers attend within a band
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {"head_dim": 8, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
        ),
    }[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape, **extra)
    model = getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora)


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "qwen3", "gemma3"])
def test_every_family_passes_the_sample_lengths_to_its_attention(family):
    """The packed attentions build no mask for a packed row (skip_masks_of_packed_rows), so each
    family's decoder must hand the collator's sample lengths down to its attention: a packed row
    gives the loss and gradients of its samples one by one (with no mask and no lengths the
    samples would attend to each other)."""
    from lora_lab.models.attention import register_packed_attention, skip_masks_of_packed_rows

    model = tiny_family_model(family)
    model.base_model.model.set_attn_implementation(register_packed_attention("segments"))
    skip_masks_of_packed_rows(model.base_model.model)
    batch, one_by_one, _ = packed_and_alone(model, "segments")
    assert_same_loss_and_gradients(model, batch, one_by_one)


def test_a_decoder_that_drops_the_sample_lengths_is_refused_not_attended_whole():
    """Where a decoder took the lengths but its attention got none (a model's own code that does
    not pass them on), the row has no mask either: the attention refuses, naming the setting."""
    from lora_lab.errors import ModelError
    from lora_lab.models.attention import register_packed_attention, skip_masks_of_packed_rows

    model = tiny_family_model("llama")
    model.base_model.model.set_attn_implementation(register_packed_attention("segments"))
    skip_masks_of_packed_rows(model.base_model.model)
    for layer in model.base_model.model.model.layers:

        def without_lengths(*args, _forward=layer.self_attn.forward, **kwargs):
            kwargs.pop("packed_lengths", None)
            return _forward(*args, **kwargs)

        layer.self_attn.forward = without_lengths
    batch, _, _ = packed_and_alone(model, "segments")
    with pytest.raises(ModelError, match="data.packed_attention=mask"):
        model(**batch)
