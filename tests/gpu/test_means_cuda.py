"""The memory means and packing on a CUDA GPU (pinned copies, CUDA random state, sdpa kernels):
`make test-gpu`. Skipped without a GPU."""

import pytest
import torch

from tests.unit.test_memory_means import assert_same, loss_and_grads
from tests.unit.test_packing import PAD, sample, summed_loss_and_grads, tiny_lora_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_offloaded_checkpoints_and_chunks_match_the_plain_path_on_cuda():
    from lora_lab.planning.memory import MemoryMeans

    reference = loss_and_grads(None, dropout=0.2, checkpointing=False, device="cuda")
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True)
    assert_same(reference, loss_and_grads(means, dropout=0.2, device="cuda"), tol=1e-4)
    chunked = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True, mlp_chunk_tokens=8)
    assert_same(
        loss_and_grads(None, dropout=0.0, device="cuda"), loss_and_grads(chunked, dropout=0.0, device="cuda"), tol=1e-4
    )


@pytest.mark.parametrize("attention", ["mask", "segments", "varlen"])
def test_a_packed_row_matches_its_samples_on_cuda_in_bf16(attention, monkeypatch):
    from lora_lab.data.collate import PACKED_FIELDS, PackedCollator, SupervisedDataset
    from lora_lab.data.packing import pack_samples
    from lora_lab.models.attention import flash_varlen, register_packed_attention

    samples = [sample(n, seed) for seed, n in enumerate((90, 170, 50, 120))]
    model = tiny_lora_model().cuda()
    if attention != "mask":
        model.base_model.model.set_attn_implementation(register_packed_attention(attention))
    if attention == "varlen":
        assert flash_varlen() is not None, "this PyTorch has no torch.nn.attention.varlen"
        print("varlen_attn parameters:", sorted(flash_varlen()[1]))
        kernel, params = flash_varlen()
        calls = []
        monkeypatch.setattr(
            "lora_lab.models.attention.flash_varlen",
            lambda: (lambda *a, **k: calls.append(1) or kernel(*a, **k), params),
        )
    one_by_one = [
        {"input_ids": torch.tensor([s.input_ids]).cuda(), "labels": torch.tensor([s.labels]).cuda()} for s in samples
    ]
    packed = pack_samples(samples, samples_per_step=4, pack_length=512, seed=0)
    batch = {
        k: v.cuda() if torch.is_tensor(v) else v
        for k, v in PackedCollator(PAD, attention)([SupervisedDataset(packed.rows, PACKED_FIELDS)[0]]).items()
    }
    unmasked = {k: v for k, v in batch.items() if k not in ("attention_mask", "packed_lengths")}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        alone = summed_loss_and_grads(model, one_by_one)
        together = summed_loss_and_grads(model, [batch])
        leaking = summed_loss_and_grads(model, [unmasked])
    print(
        f"{attention}: summed loss: one by one {alone[0]:.3f}, packed {together[0]:.3f}, "
        f"packed without the mask or lengths {leaking[0]:.3f}"
    )
    # transformers 5.17 isolates packed samples from their position ids alone (the run on the
    # H200 printed the same loss without the mask); 5.24 does not (tests/unit/test_packing.py),
    # which is why the collator always passes the block-diagonal mask.
    assert together[0] == pytest.approx(alone[0], rel=1e-2)
    if attention == "varlen":  # the flash kernel ran (once per layer and pass), no fallback
        assert len(calls) >= model.config.num_hidden_layers, len(calls)
    for name, grad in alone[1].items():
        error = (together[1][name] - grad).norm() / grad.norm()
        print(f"{name}: relative gradient error {error:.2e}")
        assert error < 3e-2, name


def test_the_cpu_embedding_takes_ids_on_the_cpu_without_changing_the_result():
    """LoraLabTrainer leaves input ids on the CPU for a CpuEmbedding: same loss and gradients
    as with the ids on the GPU (whose lookup first copies them back)."""
    from lora_lab.config import LoraArgs
    from lora_lab.models.lora import LoraOptions, apply_lora
    from lora_lab.models.memory_means import CpuEmbedding, uses_cpu_embedding
    from lora_lab.planning.memory import MemoryMeans
    from tests.unit.test_memory_means import SEQ, tiny_untied

    results = []
    for ids_device in ("cuda", "cpu"):
        model = tiny_untied()
        torch.manual_seed(1)
        model = apply_lora(
            model,
            LoraArgs(rank=4, alpha=8, dropout=0.0),
            LoraOptions(
                gradient_checkpointing=True, means=MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True)
            ),
        )
        model = model.cuda().train()
        assert uses_cpu_embedding(model)
        assert isinstance(model.get_input_embeddings(), CpuEmbedding)
        torch.manual_seed(2)
        ids = torch.randint(0, 512, (2, SEQ))
        loss = model(input_ids=ids.to(ids_device), labels=ids.cuda()).loss
        loss.backward()
        results.append(
            (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, model)
        )
    assert_same(results[0], results[1], tol=0)


@pytest.mark.parametrize("lengths", [[512, 512], [256] * 4, [1024]])
def test_equal_length_rows_take_cudnn_and_match_flash_varlen(lengths):
    """varlen_attention on a row of samples of one length: the cuDNN batch path runs and gives
    flash varlen's output and input gradients within bf16 tolerance (7B's heads: 28 query, 4
    key/value, dim 128)."""
    from types import SimpleNamespace

    from lora_lab.models import attention
    from lora_lab.models.attention import varlen_attention

    torch.manual_seed(0)
    total, module = sum(lengths), SimpleNamespace(training=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def make(heads):
        return torch.randn(1, heads, total, 128, device="cuda", dtype=torch.bfloat16)

    leaves = [make(28), make(4), make(4)]
    grad = torch.randn(1, total, 28, 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for allowed in (False, True):
        q, k, v = (t.clone().requires_grad_(True) for t in leaves)
        out, _ = varlen_attention(
            module, q, k, v, None, scaling=128**-0.5, packed_lengths=lengths, packed_cu_seqlens=cu, on_cudnn=allowed
        )
        out.backward(grad)
        results[allowed] = [out, q.grad, k.grad, v.grad]
    shape = (len(lengths), lengths[0], 28, 4, 128)
    assert attention._cudnn_shapes.get(shape) is True, attention._cudnn_shapes
    for name, flash, cudnn in zip(("out", "dq", "dk", "dv"), results[False], results[True]):
        assert flash.shape == cudnn.shape, name
        error = (cudnn.float() - flash.float()).norm() / flash.float().norm()
        print(f"{lengths}: {name} relative error cuDNN against flash {error:.2e}")
        assert error < 1e-2, name


def test_varlen_keeps_a_sliding_window_within_each_sample_on_cuda():
    """flash varlen with window_size on sliding-window layers equals the per-sample banded sdpa
    (the CPU reference, tests/unit/test_packing.py)."""
    from types import SimpleNamespace

    from lora_lab.models.attention import segments_attention, varlen_attention

    torch.manual_seed(0)
    lengths, window = [700, 300, 24], 256

    def make(heads):
        return torch.randn(1, heads, sum(lengths), 64, device="cuda", dtype=torch.bfloat16)

    q, k, v, module = make(8), make(2), make(2), SimpleNamespace(training=False)
    cu = torch.tensor([0, 700, 1000, 1024])
    flash, _ = varlen_attention(
        module, q, k, v, None, packed_lengths=lengths, packed_cu_seqlens=cu, sliding_window=window
    )
    banded, _ = segments_attention(module, q, k, v, None, packed_lengths=lengths, sliding_window=window)
    error = (flash.float() - banded.float()).norm() / banded.float().norm()
    print(f"sliding window: relative error flash varlen against banded sdpa {error:.2e}")
    assert error < 1e-2
