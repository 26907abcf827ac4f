"""The long-sequence memory means compute exactly what the plain path computes (CPU, tiny Qwen2)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lora_lab.config import LoraArgs, resolve_config
from lora_lab.models.lora import LoraOptions, apply_lora
from lora_lab.models.memory_means import CpuEmbedding, move_embedding_to_cpu
from lora_lab.planning.memory import MemoryMeans, choose_memory_means

SEQ = 24


def tiny_untied(seed: int = 0):
    """A 2-layer Qwen2 with its own output head (like 7B), fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.3,
        use_cache=False,
    )
    return Qwen2ForCausalLM(config)


def loss_and_grads(means: MemoryMeans | None, dropout: float, checkpointing: bool = True, device: str = "cpu"):
    """One forward/backward of the same LoRA model and batch; the LoRA gradients by name."""
    model = tiny_untied().to(device)
    torch.manual_seed(1)  # the LoRA initialisation
    building = LoraOptions(gradient_checkpointing=checkpointing, means=means)
    model = apply_lora(model, LoraArgs(rank=4, alpha=8, dropout=dropout), building)
    model.train()
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (2, SEQ)).to(device)
    torch.manual_seed(3)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, model


def assert_same(a, b, tol=1e-5):
    assert a[0] == pytest.approx(b[0], abs=tol)
    assert a[1].keys() == b[1].keys() and len(a[1]) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=tol, rtol=1e-4, msg=name)


def test_all_means_give_the_plain_loss_and_gradients(monkeypatch):
    import lora_lab.models.memory_means as activations

    copied = []
    real_to_host = activations._to_host
    monkeypatch.setattr(activations, "_to_host", lambda t, slab=None: copied.append(t.shape) or real_to_host(t, slab))
    plain = loss_and_grads(None, dropout=0.0)
    assert copied == []
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True, mlp_chunk_tokens=8)
    fast = loss_and_grads(means, dropout=0.0)
    assert copied == [torch.Size([2, SEQ, 32])] * 2  # each layer's input went to the host
    assert_same(plain, fast)
    model = fast[2]
    assert isinstance(model.get_input_embeddings(), CpuEmbedding)
    chunked = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    assert len(chunked) == 2 and all("_chunked" in m.forward.__qualname__ for m in chunked)


def test_offloaded_checkpoints_live_in_one_slab_of_the_planned_bytes_and_give_it_back():
    """checkpoint_tokens: every layer's input goes into one HostSlab of exactly layers x tokens x
    hidden x bytes (not torch's power-of-two pinned blocks); the backward pass gives each piece
    back, and the loss and gradients are the plain path's."""
    from lora_lab.models.memory_means import offload_slab

    plain = loss_and_grads(None, dropout=0.0)
    means = MemoryMeans(offload_checkpoints=True, checkpoint_tokens=2 * SEQ)
    loss, grads, model = loss_and_grads(means, dropout=0.0)
    assert_same(plain, (loss, grads))
    slabs = {id(offload_slab(m)): offload_slab(m) for m in model.modules() if offload_slab(m) is not None}
    assert len(slabs) == 1
    slab = next(iter(slabs.values()))
    assert slab.nbytes == 2 * 8192  # 2 layers x 48 tokens x hidden 32 x fp32 (6,144 bytes), page-aligned
    assert slab.free_bytes == slab.nbytes  # every piece back after the backward pass


def test_the_slab_of_a_4_bit_model_holds_16_bit_checkpoints():
    """QLoRA of a model without biases (Llama) with its input embedding in CPU memory: the
    first floating-point parameters are peft's fp32 LoRA weights, so model.dtype says fp32, but
    the layers' inputs are bf16, and the slab holds bf16, the bytes the planner counts (a
    65,536-token Llama-3.1-8B run once pinned twice them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_lab.models.memory_means import offload_slab
    from lora_lab.models.moe import quantize_linear_layers

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    quantize_linear_layers(model)  # 4-bit weights: no floating-point base weight in a layer
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True, checkpoint_tokens=256)
    model = apply_lora(
        model, LoraArgs(rank=4, alpha=8, dropout=0.0), LoraOptions(gradient_checkpointing=True, means=means)
    )
    assert model.dtype == torch.float32  # peft's LoRA weights come first
    slab = offload_slab(next(m for m in model.modules() if offload_slab(m) is not None))
    assert slab.nbytes == 2 * 256 * 64 * 2  # 2 layers x 256 tokens x hidden 64 x bf16, each a page


def test_a_host_slab_that_cannot_be_pinned_is_dropped_and_serves_no_gpu_copy(monkeypatch):
    """GPU copies need pinned memory: where cudaHostRegister fails the block is freed at once
    (not held unused beside torch's pinned blocks) and every copy falls back."""
    from types import SimpleNamespace

    from lora_lab.models.host_memory import ALIGN, HostSlab

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda *a: 1))
    slab = HostSlab(4 * ALIGN)
    assert not slab.serves(torch.device("cuda"))
    assert slab.buffer is None and slab.unpinnable and not slab.pinned
    assert not slab.serves(torch.device("cuda"))  # not tried again


def test_a_host_slab_lends_pieces_and_joins_them_when_they_come_back():
    import gc

    from lora_lab.models.host_memory import ALIGN, HostSlab, host_copy

    slab = HostSlab(4 * ALIGN)
    assert slab.buffer is None and slab.serves(torch.device("cpu"))  # made at the first ask
    a = slab.take((ALIGN // 4,), torch.float32)  # one page
    b = slab.take((3, 5), torch.bfloat16)  # 30 bytes: one page
    c = slab.take((2 * ALIGN,), torch.uint8)  # two pages
    assert a.shape == (ALIGN // 4,) and b.dtype == torch.bfloat16 and slab.free_bytes == 0
    assert slab.take((1,), torch.uint8) is None  # full: the caller falls back
    fallback = host_copy(torch.zeros(3), slab)
    assert slab.buffer is not None
    assert fallback.shape == (3,) and fallback.untyped_storage().data_ptr() != slab.buffer.data_ptr()
    b.fill_(1.5)
    assert a.untyped_storage().data_ptr() == slab.buffer.data_ptr()  # views of the one buffer
    del b
    gc.collect()
    assert slab.starts == [ALIGN] and slab.ends == [2 * ALIGN]
    del a
    gc.collect()
    assert slab.starts == [0] and slab.ends == [2 * ALIGN]  # joined with the piece before
    del c
    gc.collect()
    assert slab.starts == [0] and slab.ends == [4 * ALIGN] and slab.free_bytes == 4 * ALIGN
    again = slab.take((4 * ALIGN,), torch.uint8)
    assert again is not None and slab.free_bytes == 0


def test_offloaded_checkpoints_replay_the_dropout_masks():
    """Recomputation restores the random state: with dropout the gradients equal those of a
    run without any checkpointing."""
    reference = loss_and_grads(None, dropout=0.2, checkpointing=False)
    offloaded = loss_and_grads(MemoryMeans(offload_checkpoints=True), dropout=0.2)
    assert_same(reference, offloaded)
    other_seed = loss_and_grads(None, dropout=0.5, checkpointing=False)  # the check can fail:
    name = next(n for n in reference[1] if "lora_B" in n)  # B's gradient sees the dropout
    assert not torch.allclose(other_seed[1][name], reference[1][name], atol=1e-4)


def test_cpu_embedding_is_not_moved_by_model_to_and_tied_tables_stay():
    model = tiny_untied()
    table = model.get_input_embeddings().weight.detach().clone()
    assert move_embedding_to_cpu(model)
    embedding = model.get_input_embeddings()
    assert "embed" not in " ".join(n for n, _ in model.named_parameters())
    model.to(torch.float64)  # a .to() of the whole model leaves the table alone
    assert embedding.weight.dtype == torch.float32 and torch.equal(embedding.weight, table)
    ids = torch.tensor([[0, 5, 511]])
    assert torch.equal(embedding(ids), table[ids])
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tied = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    assert not move_embedding_to_cpu(tied)
    assert isinstance(tied.get_input_embeddings(), torch.nn.Embedding)


def config_for(**sets):
    flags = {"data.datasets": ["x"], "model.name": "qwen2.5-7b", **sets}
    return resolve_config("24gb", flags=flags)


def test_auto_means_on_one_gpu_only_and_on_is_refused_where_they_cannot_work():
    from lora_lab.errors import ConfigError

    auto = choose_memory_means(config_for(), on_gpu=True, tied_embeddings=False, row_tokens=16384)
    assert auto == MemoryMeans(
        embedding_on_cpu=True, offload_checkpoints=True, mlp_chunk_tokens=4096, checkpoint_tokens=16384
    )
    short = choose_memory_means(config_for(), on_gpu=True, tied_embeddings=True, row_tokens=900)
    assert short == MemoryMeans(offload_checkpoints=True, checkpoint_tokens=900)
    assert choose_memory_means(config_for(), on_gpu=False, tied_embeddings=False, row_tokens=16384) == MemoryMeans(
        mlp_chunk_tokens=4096
    )
    two_gpus = choose_memory_means(
        config_for(**{"train.gpus": 2}), on_gpu=True, tied_embeddings=False, row_tokens=16384
    )
    assert two_gpus == MemoryMeans()
    with pytest.raises(ConfigError, match="train.offload_checkpoints"):
        config_for(**{"train.gpus": 2, "train.offload_checkpoints": True})


def test_mlp_chunks_only_when_the_run_would_not_fit_without_them():
    """Chunks cost a third MLP pass: with a GPU budget they are kept only where the plan needs
    them (Qwen2.5-7B on the fast path: a packed row of 16384 tokens, its mask counted, 16.71 GiB
    planned without chunks, 16.56 with; one unpacked 16384-token sample 15.96 and 15.81)."""
    from lora_lab.planning.memory import plan_memory

    config = config_for(**{"model.name": "qwen2.5-7b"})
    roomy = choose_memory_means(config, on_gpu=True, tied_embeddings=False, row_tokens=16384, budget_gib=23.5)
    assert roomy == MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True, checkpoint_tokens=16384)
    tight = choose_memory_means(config, on_gpu=True, tied_embeddings=False, row_tokens=16384, budget_gib=16.6)
    assert tight.mlp_chunk_tokens == 4096
    config = config.with_changes({"data.packing": False, "data.max_length": 16384}, "test")
    assert "MLP in chunks" not in plan_memory(config, 24).means
    assert "MLP in chunks of 4096 tokens" in plan_memory(config, 16.4).means  # 15.9 usable
    assert plan_memory(config, 16.4).total_gib < plan_memory(config, 24).total_gib


def test_cudnn_attention_lets_sdpa_pick_cudnn_only_when_true():
    """auto (the default) keeps cuDNN to the varlen path's equal-length rows; sdpa's own choice
    gets it only with true."""
    import torch

    from lora_lab.device import use_cudnn_attention

    assert config_for().model.cudnn_attention == "auto"  # the default (docs/training.md)
    assert config_for(**{"model.cudnn_attention": "false"}).model.cudnn_attention is False
    assert config_for(**{"model.cudnn_attention": "true"}).model.cudnn_attention is True
    try:
        for setting, picked in (("auto", False), (False, False), (True, True)):
            use_cudnn_attention(setting)
            assert torch.backends.cuda.cudnn_sdp_enabled() is picked, setting
            assert torch.backends.cuda.flash_sdp_enabled()  # the others stay allowed
    finally:
        use_cudnn_attention(True)


def test_generation_inside_a_grpo_step_keeps_the_offloaded_checkpoints_and_the_kept_layers():
    """TRL's unwrap_model_for_generation (GRPOTrainer's sampling) switches a checkpointing model
    off and on again through transformers, which puts torch's checkpoint on every layer and turns
    the layers lora-lab left uncheckpointed back on. Inside checkpointing_paused (the GRPO
    trainer's sampling) it leaves both as they were, and generation still uses its cache."""
    from accelerate import Accelerator
    from trl.models import unwrap_model_for_generation

    from lora_lab.models.memory_means import checkpointing_paused, keep_last_layers, offloads_checkpoint

    def sample(model, paused: bool):
        layers = model.base_model.model.model.layers
        pause = checkpointing_paused(model) if paused else contextlib.nullcontext()
        with pause, unwrap_model_for_generation(model, Accelerator(cpu=True)) as unwrapped, torch.no_grad():
            ids = unwrapped.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, use_cache=True)
        return ids, [(offloads_checkpoint(layer), layer.gradient_checkpointing) for layer in layers]

    model = apply_lora(
        tiny_untied(),
        LoraArgs(rank=4, alpha=8),
        LoraOptions(gradient_checkpointing=True, means=MemoryMeans(offload_checkpoints=True)),
    )
    assert keep_last_layers(model, 1) == 1
    before = [(True, True), (True, False)]
    ids, after = sample(model, paused=True)
    assert after == before and ids.shape == (1, 7)
    plain = tiny_untied()
    plain.config.use_cache = True
    torch.testing.assert_close(
        ids[:, 3:], plain.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)[:, 3:]
    )
    _, replaced = sample(model, paused=False)  # what TRL alone leaves: torch's checkpoint, both layers on
    assert replaced == [(False, True), (False, True)]
