"""models/load.py's kernels: RMSNorm layers through torch.rms_norm compute what the model's own
layers compute (CPU here; tests/gpu/test_means_cuda.py with liger's kernels on a GPU)."""

import copy

import torch

from lora_lab.models.kernels import NATIVE_RMS_NORMS, _native_rms_norm, use_native_rms_norm


def qwen2(dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    model = Qwen2ForCausalLM(config)
    for module in model.modules():
        if type(module).__name__ == "Qwen2RMSNorm":
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
    return model.to(dtype)


def test_native_rms_norm_gives_the_models_logits_and_gradients():
    model = qwen2()
    native = copy.deepcopy(model)
    assert use_native_rms_norm(native) == 2 * 2 + 1  # two per layer and the final one
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    outputs = [m(input_ids=ids, labels=ids) for m in (model, native)]
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-5, atol=1e-5)
    for out in outputs:
        out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_native_rms_norm_keeps_the_models_types():
    """bf16 in, bf16 weight: bf16 out within one rounding; an fp32 weight (a k-bit model's
    norms): the normalized bf16 input times the weight in fp32, as the model computes it."""
    norm = qwen2(torch.bfloat16).model.norm
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    own, native = type(norm).forward(norm, x), _native_rms_norm(norm, x)
    assert native.dtype == own.dtype == torch.bfloat16
    torch.testing.assert_close(native, own, rtol=1e-2, atol=1e-2)
    norm.weight.data = norm.weight.data.float()
    own, native = type(norm).forward(norm, x), _native_rms_norm(norm, x)
    assert native.dtype == own.dtype == torch.float32
    assert torch.equal(native, own)


def test_only_the_listed_norms_are_routed():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    gemma = Gemma3ForCausalLM(config)  # (1 + weight): not torch.rms_norm's arithmetic
    assert "Gemma3RMSNorm" not in NATIVE_RMS_NORMS
    assert use_native_rms_norm(gemma) == 0


def test_the_loss_gradients_are_scaled_in_place_on_their_device():
    from lora_lab.models.kernels import scale_on_device

    grad_input, grad_weight = torch.randn(6, 4).bfloat16(), torch.randn(5, 4)
    kept = grad_input.clone()
    assert scale_on_device(torch.tensor(1.0), grad_input, None, None)[0] is grad_input
    assert torch.equal(grad_input, kept)  # times 1: bit for bit
    scaled = scale_on_device(torch.tensor(0.25), grad_input, grad_weight.clone(), None)
    assert torch.equal(scaled[0], (kept.float() * 0.25).bfloat16())
    assert torch.equal(scaled[1], grad_weight * 0.25) and scaled[2] is None
