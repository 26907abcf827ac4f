"""model.kernels liger on a CUDA GPU: liger's kernels with the RMSNorm layers on torch's fused
kernel give the plain model's loss and gradients within bf16 rounding. `make test-gpu`."""

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_same_loss_and_gradients(plain, fast):
    """One step of both models on the same ids under bf16 autocast, and of the plain model in
    fp32: the loss within 1%, and each parameter's gradient as close to the fp32 one as the
    plain bf16 model's is (twice its relative error, or 5%)."""
    reference = copy.deepcopy(plain)
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    losses = []
    for model in (plain, fast):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    reference(input_ids=ids, labels=ids).loss.backward()
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    named = zip(reference.named_parameters(), plain.parameters(), fast.parameters())
    for (name, r), p, q in named:
        if r.grad is not None:
            scale = r.grad.norm().clamp_min(1e-12)
            plain_error, fast_error = (p.grad - r.grad).norm() / scale, (q.grad - r.grad).norm() / scale
            assert fast_error < max(2 * plain_error, 5e-2), (name, float(fast_error), float(plain_error))


def test_liger_with_native_norms_matches_the_plain_model():
    pytest.importorskip("liger_kernel")
    from lora_lab.models.kernels import apply_kernels, native_rms_norm_available
    from tests.unit.test_kernels import qwen2

    plain = qwen2().cuda()
    fast = copy.deepcopy(plain)
    assert apply_kernels(fast, "liger") == "liger"
    norms = [m for m in fast.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    assert norms and all(("_native_rms_norm" in str(m.forward)) == native_rms_norm_available() for m in norms)
    assert_same_loss_and_gradients(plain, fast)


@pytest.mark.parametrize("config_name", ["qwen3.5-0.8b", "smollm3-3b"])
def test_liger_on_the_new_families_matches_the_plain_model(config_name):
    """Qwen3.5 (hybrid linear attention, offset RMSNorm) and SmolLM3: liger's patches for their
    model_type (registry.FAMILIES) give the plain model's loss and LoRA-free gradients within
    bf16 rounding; the fused loss never builds the 248,320-column logits."""
    pytest.importorskip("liger_kernel")
    from transformers import AutoModelForCausalLM

    from lora_lab.models.kernels import apply_kernels
    from tests.support.families import tiny_family_config

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_family_config(config_name), dtype=torch.float32).cuda()
    fast = copy.deepcopy(plain)
    assert apply_kernels(fast, "liger") == "liger"
    assert_same_loss_and_gradients(plain, fast)


def test_the_loss_gradient_is_scaled_on_the_device_as_liger_scales_it():
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    from lora_lab.models.kernels import apply_kernels, restored_kernel_patches, scale_on_device
    from tests.unit.test_kernels import qwen2

    liger_own = flce.fused_linear_cross_entropy_backward
    model = qwen2().cuda()
    twin = copy.deepcopy(model)
    grads = []
    with restored_kernel_patches("liger", "qwen2"):
        apply_kernels(model, "liger")
        apply_kernels(twin, "liger")
        assert flce.fused_linear_cross_entropy_backward is scale_on_device
        ids = torch.randint(0, 512, (2, 64), device="cuda")
        for candidate, backward in ((model, scale_on_device), (twin, liger_own)):
            flce.fused_linear_cross_entropy_backward = backward
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = candidate(input_ids=ids, labels=ids).loss
            (loss * 0.25).backward()  # as with gradient accumulation: not 1
            grads.append([p.grad for p in candidate.parameters()])
        flce.fused_linear_cross_entropy_backward = scale_on_device
    assert flce.fused_linear_cross_entropy_backward is liger_own  # the context put it back
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


def test_a_long_unpacked_row_attends_through_cudnn_as_sdpa_does():
    """model.cudnn_attention true: one unpacked causal sample of LONG_ROW_TOKENS goes to cuDNN's
    kernel with grouped-query heads (no repeated k/v), and gives sdpa's output and gradients."""
    from types import SimpleNamespace

    from lora_lab.models import attention

    tokens, heads, kv_heads, dim = attention.LONG_ROW_TOKENS, 8, 2, 128
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, h, tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    module = SimpleNamespace(training=True)
    attention._cudnn_shapes.clear()
    out, _ = attention.sdpa_long_rows(module, q, k, v, None, scaling=dim**-0.5)
    assert attention.cudnn_shapes_taken() == [(1, tokens, heads, kv_heads, dim)]  # cuDNN took it
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected.transpose(1, 2).float().square().sum().backward()
    assert torch.allclose(out.float(), expected.transpose(1, 2).float(), atol=2e-2, rtol=0)
    for got, t in zip(grads, (q, k, v), strict=True):
        error = (got.float() - t.grad.float()).norm() / t.grad.float().norm()
        assert error < 2e-2, error  # bf16 kernels: the same gradients to rounding
