"""models/fast_lora/ and the streamed checkpoint copies on a CUDA GPU in bf16 (autocast, like the
Trainer): loss and LoRA gradients as close to an fp32 reference as peft's own bf16 path is.
`make test-gpu`; skipped without a GPU."""

import pytest
import torch

from lora_lab.planning.memory import MemoryMeans
from tests.unit.test_fast_lora import loss_and_grads
from tests.unit.test_fast_lora import test_adamw_steps_make_the_casts_again as adamw_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _in_bf16(fast: bool, means=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return loss_and_grads(fast, means, device="cuda", dtype=torch.bfloat16)


def _relative(result, reference) -> float:
    worst = abs(result[0] - reference[0]) / abs(reference[0])
    for name, grad in reference[1].items():
        error = (result[1][name].float() - grad).norm() / grad.norm().clamp_min(1e-12)
        worst = max(worst, float(error))
    return worst


def test_fast_lora_in_bf16_is_as_close_to_fp32_as_peft():
    reference = loss_and_grads(False, device="cuda")  # fp32 weights, no autocast
    plain = _in_bf16(False)
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True)
    fast = _in_bf16(True, means)
    plain_error, fast_error = _relative(plain, reference), _relative(fast, reference)
    print(f"relative error to fp32: peft bf16 {plain_error:.2e}, fast bf16 {fast_error:.2e}")
    assert fast_error <= 1.25 * plain_error + 1e-3


def test_streamed_offload_gives_the_plain_checkpoint_result():
    means = MemoryMeans(offload_checkpoints=True)
    plain = loss_and_grads(True, means, device="cuda")
    from tests.unit.test_memory_means import assert_same

    assert_same(loss_and_grads(True, None, device="cuda"), plain, tol=1e-4)


def test_streamed_checkpoints_with_mlp_chunks_match_the_whole_mlp():
    """The first pass without autograd and the recomputation in chunks of 10 tokens (liger's
    SwiGLU kernels on CUDA): the loss and gradients of the MLP run on all tokens at once."""
    from tests.unit.test_memory_means import assert_same

    means = MemoryMeans(offload_checkpoints=True)
    assert_same(
        loss_and_grads(True, means, device="cuda"),
        loss_and_grads(True, means, device="cuda", chunk_tokens=10),
        tol=1e-4,
    )


def test_saved_mlp_backward_in_chunks_matches_the_whole_row():
    """The backward pass through down and SwiGLU from saved gate and up in chunks of 10 tokens
    (model.fast_lora_down_backward_tokens; liger's SwiGLU backward writing into row slices of the saved
    gate and up) and the first pass's SwiGLU written over gate: the whole row's loss and
    gradients."""
    from lora_lab.models.fast_lora import FastLoraOptions
    from tests.unit.test_memory_means import assert_same

    means = MemoryMeans(offload_checkpoints=True)
    whole = loss_and_grads(True, means, device="cuda", options=FastLoraOptions(down_backward_tokens=0))
    chunked = loss_and_grads(True, means, device="cuda", options=FastLoraOptions(down_backward_tokens=10))
    assert_same(whole, chunked, tol=1e-4)


def test_streamed_checkpoints_with_the_last_layer_kept_match_every_layer_recomputed():
    """train.uncheckpointed_layers 1 of 2 with the streamed copies (the first layer's input
    is fetched back past a layer that was never offloaded)."""
    from tests.unit.test_memory_means import assert_same

    every = loss_and_grads(True, MemoryMeans(offload_checkpoints=True), device="cuda", chunk_tokens=10)
    kept = loss_and_grads(
        True, MemoryMeans(offload_checkpoints=True, uncheckpointed_layers=1), device="cuda", chunk_tokens=10
    )
    assert_same(every, kept, tol=1e-4)


def test_chunked_mlp_in_bf16_is_as_close_to_fp32_as_peft():
    """bf16 autocast, offloaded checkpoints, the MLP recomputed in chunks of 10 tokens: as close
    to the fp32 reference as peft's bf16 path."""
    reference = loss_and_grads(False, device="cuda")
    plain = _in_bf16(False)
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        chunked = loss_and_grads(True, means, device="cuda", dtype=torch.bfloat16, chunk_tokens=10)
    plain_error, chunked_error = _relative(plain, reference), _relative(chunked, reference)
    print(f"relative error to fp32: peft bf16 {plain_error:.2e}, chunked bf16 {chunked_error:.2e}")
    assert chunked_error <= 1.25 * plain_error + 1e-3


def test_fast_lora_on_nf4_weights_matches_peft(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from lora_lab.models.load import Precision, nf4_config
    from lora_lab.models.lora import prepare_quantized_for_training
    from tests.unit.test_memory_means import tiny_untied

    tiny_untied().to(torch.bfloat16).save_pretrained(tmp_path)

    def quantized():
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path,
            dtype=torch.bfloat16,
            device_map={"": 0},
            quantization_config=nf4_config(Precision("bf16", bf16=True)),
        )
        return prepare_quantized_for_training(model)

    def run(fast, **more):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_and_grads(fast, device="cuda", dtype=torch.bfloat16, model_fn=quantized, **more)

    plain, fast = run(False), run(True)
    # offloaded checkpoints: the MLP recomputed in chunks of 10 tokens, each weight
    # de-quantized once per backward pass
    chunked = run(True, means=MemoryMeans(offload_checkpoints=True), chunk_tokens=10)
    error, chunked_error = _relative(fast, plain), _relative(chunked, plain)
    print(f"nf4: fast vs peft relative difference {error:.2e}, chunked {chunked_error:.2e}")
    assert error < 3e-2 and chunked_error < 3e-2


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_adamw_steps_make_the_casts_again_on_cuda(implementation):
    adamw_case(implementation, "cuda")


def test_offloaded_checkpoints_in_the_pinned_slab_match_torchs_pinned_blocks_step_after_step():
    """models/host_memory.py on CUDA: the slab is pinned, each layer's checkpoint is a piece of
    it (none falls back to torch's allocator), three steps on the streamed copies (a piece
    reused each step after its copy back) give the gradients of torch's pinned blocks, and every
    piece comes back."""
    from lora_lab.models.memory_means import offload_slab
    from tests.unit.test_fast_lora import SEQ

    def steps(means):
        _, _, model = loss_and_grads(True, means, device="cuda")
        grads = []
        for step in range(3):
            model.zero_grad()
            torch.manual_seed(10 + step)
            ids = torch.randint(0, 512, (2, SEQ), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        return grads, model

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    slabbed, model = steps(MemoryMeans(offload_checkpoints=True, checkpoint_tokens=2 * SEQ))
    slab = next(offload_slab(m) for m in model.modules() if offload_slab(m) is not None)
    assert slab.pinned and slab.buffer.is_pinned()
    # no checkpoint in torch's pinned blocks (each is 2 x 24 x 32 x 4 bytes)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before < 2 * SEQ * 32 * 4
    torch.cuda.synchronize()
    assert slab.free_bytes == slab.nbytes
    blocks, _ = steps(MemoryMeans(offload_checkpoints=True))
    for ours, theirs in zip(slabbed, blocks, strict=True):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0, msg=name)
