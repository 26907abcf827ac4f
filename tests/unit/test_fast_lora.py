"""models/fast_lora computes what peft computes: loss and LoRA gradients (CPU, tiny Qwen2)."""

from __future__ import annotations

import pytest
import torch

from lora_lab.config import LoraArgs, resolve_config
from lora_lab.models.fast_lora import FastLoraOptions, LoraMLP, LoraProjection
from lora_lab.models.lora import LoraOptions, apply_lora
from lora_lab.planning.memory import MemoryMeans
from lora_lab.planning.policies import resolve_fast_lora
from tests.unit.test_memory_means import SEQ, assert_same, tiny_untied


def loss_and_grads(
    fast: bool,
    means=None,
    dropout: float = 0.0,
    checkpointing: bool = True,
    device: str = "cpu",
    dtype=torch.float32,
    model_fn=tiny_untied,
    chunk_tokens: int = 0,
    options: FastLoraOptions | None = None,
):
    """options: the fast path's (FastLoraOptions with chunk_tokens where not given)."""
    model = model_fn()
    if not getattr(model, "is_loaded_in_4bit", False):
        model = model.to(device=device, dtype=dtype)
    torch.manual_seed(1)
    building = LoraOptions(
        gradient_checkpointing=checkpointing,
        means=means,
        fast=(options or FastLoraOptions(chunk_tokens=chunk_tokens)) if fast else None,
        offload_copy_stream=device == "cuda",
    )
    model = apply_lora(model, LoraArgs(rank=4, alpha=8, dropout=dropout), building)
    model.train()
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (2, SEQ)).to(device)
    torch.manual_seed(3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, model


def give_adapters_an_effect(model) -> None:
    """B starts at zero, so the adapters change nothing until B is drawn at random."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)


def count_calls(monkeypatch):
    calls = {"mlp": 0, "projection": 0}
    for name, cls in (("mlp", LoraMLP), ("projection", LoraProjection)):
        real = cls.apply

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(cls, "apply", counted)
    return calls


@pytest.mark.parametrize("checkpointing", [True, False])
def test_fast_lora_gives_peft_loss_and_gradients(checkpointing, monkeypatch):
    plain = loss_and_grads(False, checkpointing=checkpointing)
    calls = count_calls(monkeypatch)
    fast = loss_and_grads(True, checkpointing=checkpointing)
    passes = 2 if checkpointing else 1  # checkpointing runs each layer again in backward
    # two layers: one MLP, and two projection calls (q, k and v together; o alone) each
    assert calls == {"mlp": 2 * passes, "projection": 2 * 2 * passes}
    assert all(p.grad.dtype == torch.float32 for p in fast[2].parameters() if p.requires_grad)
    assert_same(plain, fast)


def test_fast_lora_with_every_memory_means():
    means = MemoryMeans(embedding_on_cpu=True, offload_checkpoints=True, mlp_chunk_tokens=8)
    assert_same(loss_and_grads(False), loss_and_grads(True, means))


def test_mlp_backward_in_chunks_gives_the_same_loss_and_gradients(monkeypatch):
    """Chunks of 10 tokens (2 rows x SEQ 24: five chunks, the last one short): the same
    gradients as one pass over all tokens, up to the order of the sums over tokens."""
    calls = count_swiglu(monkeypatch)
    whole = loss_and_grads(True)
    whole_calls = len(calls)
    calls.clear()
    chunked = loss_and_grads(True, chunk_tokens=10)
    # two layers, five backward chunks each (transformers' checkpoint runs its first pass with
    # autograd on: the MLP runs whole there)
    assert len(calls) == whole_calls + 2 * (5 - 1)
    assert_same(whole, chunked)


def test_offloaded_checkpoints_with_mlp_chunks_give_the_whole_mlp_result(monkeypatch):
    """lora-lab's offloaded checkpoint runs a layer's first pass without autograd and its
    recomputation for the backward pass: with chunks of 10 tokens (48 tokens: 10, 10, 10, 10,
    8) both run the MLP a chunk at a time, no SwiGLU sees all 48 tokens, and the loss and
    gradients are the whole MLP's."""
    from lora_lab.models.fast_lora import mlp

    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=True, mlp_chunk_tokens=0)
    rows, real = [], mlp._swiglu
    monkeypatch.setattr(mlp, "_swiglu", lambda g, u, **kw: rows.append(g.shape[0]) or real(g, u, **kw))
    whole = loss_and_grads(True, means)
    assert rows == [48] * 4  # two layers: the first pass, the backward pass
    rows.clear()
    chunked = loss_and_grads(True, means, chunk_tokens=10)
    assert rows == [10, 10, 10, 10, 8] * 4
    assert_same(whole, chunked)


@pytest.mark.parametrize("offload, chunk_tokens", [(False, 0), (False, 10), (True, 10)])
def test_swiglu_gradient_is_written_over_its_output(offload, chunk_tokens, monkeypatch):
    """The backward pass through the down projection writes d(silu(gate) * up) over
    silu(gate) * up (read before, by dA_down alone): a chunk holds one [tokens x intermediate]
    tensor fewer. Saved gate and up (whole or in chunks), and the chunked recomputation."""
    from lora_lab.models.fast_lora import mlp

    made, given = [], []
    real_forward, real_backward = mlp._swiglu, mlp._swiglu_backward
    monkeypatch.setattr(mlp, "_swiglu", lambda g, u, **kw: made.append(real_forward(g, u, **kw)) or made[-1])
    monkeypatch.setattr(mlp, "_swiglu_backward", lambda g, u, grad: given.append(grad) or real_backward(g, u, grad))
    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=offload, mlp_chunk_tokens=0)
    whole = loss_and_grads(True, means)
    made.clear(), given.clear()
    result = loss_and_grads(True, means, chunk_tokens=chunk_tokens)
    assert len(given) == 2 * (5 if chunk_tokens else 1)  # two layers
    outputs = {h.data_ptr() for h in made}
    assert all(grad.data_ptr() in outputs for grad in given)
    assert_same(whole, result)


def test_saved_mlp_backward_goes_down_and_swiglu_a_chunk_at_a_time(monkeypatch):
    """Without model.fast_lora_chunk_tokens, the backward pass through down and SwiGLU from the
    saved gate and up still runs on at most model.fast_lora_down_backward_tokens at a time (10 of 48
    here: 10, 10, 10, 10, 8), so no silu(gate) * up of the whole row is made there; the first
    pass (no autograd) writes silu(gate) * up over gate. The loss and gradients are those of
    one pass over all tokens."""
    from lora_lab.models.fast_lora import mlp

    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=True, mlp_chunk_tokens=0)
    calls, real = [], mlp._swiglu

    def swiglu(gate, up, over_gate=False):
        h = real(gate, up, over_gate=over_gate)
        calls.append((gate.shape[0], over_gate, h.data_ptr() == gate.data_ptr()))
        return h

    monkeypatch.setattr(mlp, "_swiglu", swiglu)
    whole = loss_and_grads(True, means, options=FastLoraOptions(down_backward_tokens=0))
    assert calls == [(48, True, True)] * 2 + [(48, False, False)] * 2  # two layers
    calls.clear()
    chunked = loss_and_grads(True, means, options=FastLoraOptions(down_backward_tokens=10))
    assert calls == [(48, True, True)] * 2 + [(rows, False, False) for rows in (10, 10, 10, 10, 8)] * 2
    assert_same(whole, chunked)


def test_the_cpu_step_tries_no_gpu_kernel_import(monkeypatch):
    """liger's SwiGLU kernels run on CUDA only: a CPU step does not try to import them (where
    liger is not installed, each failed import searches the whole path again)."""
    import builtins

    tried, real = [], builtins.__import__

    def recording(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            tried.append(name)
        return real(name, *args, **kwargs)

    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=True, mlp_chunk_tokens=0)
    monkeypatch.setattr(builtins, "__import__", recording)
    _, grads, _ = loss_and_grads(True, means)
    assert tried == [] and grads


@pytest.mark.parametrize("chunk_tokens, rows", [(10, [10, 10, 10, 10, 8]), (0, [48])])
def test_mlp_without_gradients_runs_a_chunk_at_a_time(monkeypatch, chunk_tokens, rows):
    """Where no gradient is taken (an evaluation, a checkpointed layer's first pass) the MLP's
    [tokens x intermediate] temporaries are a chunk's (all tokens without chunks), and the
    logits are those of the autograd function."""
    from lora_lab.models.fast_lora import mlp

    model = loss_and_grads(True, chunk_tokens=chunk_tokens)[2]
    give_adapters_an_effect(model)
    ids = torch.randint(0, 512, (2, SEQ))
    seen, real = [], mlp._swiglu
    monkeypatch.setattr(mlp, "_swiglu", lambda g, u, **kw: seen.append(g.shape[0]) or real(g, u, **kw))
    model.eval()
    with torch.no_grad():
        chunked = model(input_ids=ids).logits
    assert seen == rows * 2  # 48 tokens, two layers
    with torch.enable_grad():
        whole = model(input_ids=ids).logits  # the autograd function, all tokens at once
    assert seen[2 * len(rows) :] == [48, 48]
    torch.testing.assert_close(chunked, whole.detach(), atol=1e-5, rtol=1e-5)


def test_gradients_over_chunks_are_summed_in_fp32():
    """bf16 parts of a gradient are summed in fp32 from the second chunk on: 300 parts of 1
    give 300 (a bf16 sum stops at 256, where adding 1 rounds back down); one part stays as it
    is."""
    from lora_lab.models.fast_lora.mlp import _sum_into

    one = torch.ones(3, dtype=torch.bfloat16)
    assert _sum_into(None, one) is one
    total = None
    for _ in range(300):
        total = _sum_into(total, one)
    assert total.dtype == torch.float32 and total.tolist() == [300.0] * 3


def count_swiglu(monkeypatch) -> list:
    from lora_lab.models.fast_lora import mlp

    calls, real = [], mlp._swiglu
    monkeypatch.setattr(mlp, "_swiglu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("chunk_tokens, chunks", [(0, 1), (10, 5)])
def test_recomputed_layer_skips_the_mlp_output_and_keeps_every_gradient(monkeypatch, chunk_tokens, chunks):
    """A recomputed Qwen2 layer's MLP stops after gate and up (silu(gate) * up runs once per
    chunk in the first pass and in the backward pass, not also in the recomputation) and the
    gradients are the same: bit for bit in one chunk; in chunks, gate and up are recomputed
    chunk by chunk in the backward pass instead of back-propagated over all tokens at once."""

    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=True, mlp_chunk_tokens=0)
    calls = count_swiglu(monkeypatch)
    skipped = loss_and_grads(True, means, chunk_tokens=chunk_tokens)
    assert len(calls) == 2 * (chunks + chunks)  # two layers: first pass, backward
    calls.clear()
    full = loss_and_grads(True, means, options=FastLoraOptions(chunk_tokens=chunk_tokens, residual_skip=False))
    assert len(calls) == 2 * (chunks + 1 + chunks)
    assert skipped[0] == full[0]
    assert skipped[1].keys() == full[1].keys()
    if chunks > 1:
        assert_same(skipped, full)
        return
    for name, grad in skipped[1].items():
        assert torch.equal(grad, full[1][name]), name


def test_dropout_falls_back_to_peft(monkeypatch):
    calls = count_calls(monkeypatch)
    plain, fast = loss_and_grads(False, dropout=0.3), loss_and_grads(True, dropout=0.3)
    assert calls == {"mlp": 0, "projection": 0}
    assert_same(plain, fast)


def test_merged_or_disabled_adapters_fall_back():
    model = loss_and_grads(True)[2]
    give_adapters_an_effect(model)
    ids = torch.randint(0, 512, (1, SEQ))
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=ids).logits
        on = model(input_ids=ids).logits
        model.merge_adapter()
        merged = model(input_ids=ids).logits
        model.unmerge_adapter()
    assert not torch.allclose(on, off)
    torch.testing.assert_close(merged, on, atol=1e-4, rtol=1e-4)


def test_fast_lora_setting():
    def config(*sets):
        return resolve_config("24gb", flags={"model.name": "qwen2.5-0.5b", "data.datasets": ["x"]}, sets=list(sets))

    assert resolve_fast_lora(config())  # the GPU presets train with dropout 0
    assert resolve_fast_lora(config("lora.dropout=0"))
    assert not resolve_fast_lora(config("lora.dropout=0.05"))
    assert resolve_fast_lora(config("lora.dropout=0.05", "model.fast_lora=true"))
    assert not resolve_fast_lora(config("lora.dropout=0", "model.fast_lora=false"))
    assert not resolve_fast_lora(config("lora.dropout=0", "train.tuner=full"))
    assert not resolve_fast_lora(config("lora.dropout=0", "train.gpus=2", "train.engine=deepspeed-zero3"))


def test_fast_lora_in_bf16_autocast_is_as_close_to_fp32_as_peft():
    """bf16 weights under CPU autocast (what the Trainer does on a GPU): both paths round."""
    from tests.gpu.test_fast_lora_cuda import _relative

    def in_bf16(fast):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_and_grads(fast, dtype=torch.bfloat16)

    reference = loss_and_grads(False)
    plain, fast = _relative(in_bf16(False), reference), _relative(in_bf16(True), reference)
    assert fast <= 1.25 * plain + 1e-3, (plain, fast)


def test_shared_input_projections_match_peft_called_in_any_order():
    """q_proj, k_proj and v_proj of one input are one call; a sibling handed another input, or
    called first, computes its own output: every output is peft's."""
    model = loss_and_grads(True)[2]
    attention = next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "v_proj"))
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    torch.manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    x, y = (torch.randn(2, SEQ, projections[0].in_features), torch.randn(2, SEQ, projections[0].in_features))

    def peft(module, inputs):
        return type(module).forward(module, inputs)

    with torch.no_grad():
        assert [p.forward.__qualname__ for p in projections] == ["_SharedInput.forward_of.<locals>.forward"] * 3
        for order in ([0, 1, 2], [2, 0, 1]):
            outputs = {i: projections[i](x) for i in order}
            for i, out in outputs.items():
                torch.testing.assert_close(out, peft(projections[i], x))
        projections[0](x)
        torch.testing.assert_close(projections[1](y), peft(projections[1], y))
        torch.testing.assert_close(projections[2](x), peft(projections[2], x))


def test_adapters_of_several_types_get_gradients_of_their_own_types(monkeypatch):
    """One call's adapters need not share a type: each gradient comes back in its weight's."""
    calls = count_calls(monkeypatch)
    model = tiny_untied()
    torch.manual_seed(1)
    model = apply_lora(
        model, LoraArgs(rank=4, alpha=8, dropout=0.0), LoraOptions(gradient_checkpointing=True, fast=FastLoraOptions())
    )
    attention = next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "v_proj"))
    mlp = next(m for m in model.modules() if hasattr(m, "gate_proj"))
    for layer in (attention.k_proj, mlp.up_proj):
        layer.lora_B["default"].weight.data = layer.lora_B["default"].weight.data.double()
    model.train()
    ids = torch.randint(0, 512, (2, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == {"mlp": 2 * 2, "projection": 2 * 2 * 2}  # the fast path, checkpointed
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert {p.dtype for _, p in trained} == {torch.float32, torch.float64}
    assert all(p.grad is not None and p.grad.dtype == p.dtype for _, p in trained), [
        (n, p.dtype, None if p.grad is None else p.grad.dtype) for n, p in trained
    ]


def test_gradients_cast_in_one_copy_accumulate_per_parameter():
    """Under bf16 autocast each call's adapter gradients are views of one fp32 buffer: a second
    micro-batch adds to every parameter's own .grad (2 x its first gradient, exactly)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, first, model = loss_and_grads(True, dtype=torch.bfloat16)
        torch.manual_seed(2)
        ids = torch.randint(0, 512, (2, SEQ))
        torch.manual_seed(3)
        model(input_ids=ids, labels=ids).loss.backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(p.grad.dtype == torch.float32 for p in trained.values())
    for name, param in trained.items():
        assert torch.equal(param.grad, 2 * first[name]), name


def test_adapter_casts_are_made_once_until_the_weights_change(monkeypatch):
    """Under bf16 autocast each call site casts its adapter weights once: the checkpoint's
    recomputation reuses the forward pass's copy; an optimizer step (an in-place update) makes a
    new one, so the step after it computes exactly what casting at every call computes."""
    from lora_lab.models.fast_lora import products

    casts = []
    real = products._adapter_weights
    monkeypatch.setattr(products, "_adapter_weights", lambda *args: casts.append(1) or real(*args))
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(5))

    def two_steps(options=None):
        # the update outside autocast, as the Trainer's (autocast keeps its own copies of the
        # weights until its context ends)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, _, model = loss_and_grads(True, dtype=torch.bfloat16, options=options)
            before = model(input_ids=ids, labels=ids).loss.item()
        first = len(casts)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return first, len(casts) - first, before, loss.item(), grads

    first, second, before, loss, grads = two_steps()
    # two layers, three call sites each (q, k and v; o; the MLP), checkpointed: one cast each
    assert (first, second) == (6, 6)
    assert loss != before  # the step changed the weights the next forward pass reads
    casts.clear()
    every_first, every_second, _, every_call_loss, every_call_grads = two_steps(FastLoraOptions(cast_cache=False))
    assert every_first > first and every_second > second  # model.fast_lora_cast_cache false: every call
    assert loss == every_call_loss
    for name, grad in every_call_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_adamw_steps_make_the_casts_again(implementation, device="cpu"):
    """After a step of any AdamW implementation (fused AdamW leaves the version counter where it
    was) the next call casts the updated weights. tests/gpu runs it on CUDA too."""
    from lora_lab.models.fast_lora import StepCounter, _Casts

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 16, device=device))
    b = torch.nn.Parameter(torch.randn(16, 8, device=device))
    steps = StepCounter()
    casts = _Casts(steps)
    first = casts.get([a], [b], torch.bfloat16)
    assert casts.get([a], [b], torch.bfloat16) is first
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    options = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[implementation]
    torch.optim.AdamW([a, b], lr=0.1, **options).step()
    second = casts.get([a], [b], torch.bfloat16)
    assert second is not first
    assert torch.equal(second[0][0], a.detach().to(torch.bfloat16))
    assert torch.equal(second[1][0], b.detach().to(torch.bfloat16))
    steps.remove()


@pytest.mark.parametrize("offload", [False, True])
def test_uncheckpointed_last_layers_are_not_recomputed_and_give_the_same_gradients(offload, monkeypatch):
    """train.uncheckpointed_layers 1 (of 2): the last layer keeps its activations (its MLP runs
    once), the first is still recomputed; loss and gradients are those of recomputing both."""
    import lora_lab.models.fast_lora as fast_lora

    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=offload)
    every = loss_and_grads(True, means)
    calls = count_calls(monkeypatch)
    first_passes, real = [], fast_lora._mlp_without_graph
    monkeypatch.setattr(fast_lora, "_mlp_without_graph", lambda *a: first_passes.append(1) or real(*a))
    kept = loss_and_grads(
        True, MemoryMeans(embedding_on_cpu=False, offload_checkpoints=offload, uncheckpointed_layers=1)
    )
    # the first layer: a first pass (without autograd in lora-lab's offloaded checkpoint, with
    # it in transformers'), then its recomputation; the last: one pass with autograd
    assert (len(first_passes), calls["mlp"]) == ((1, 2) if offload else (0, 3))
    assert_same(every, kept)


def test_more_uncheckpointed_layers_than_the_model_has_is_refused():
    from lora_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.uncheckpointed_layers 3: the model has 2 "):
        loss_and_grads(True, MemoryMeans(uncheckpointed_layers=3))


def test_a_compiled_forward_computes_through_peft_and_gives_the_eager_logits(monkeypatch):
    """Inside torch.compile (transformers' compiled decoding step, grpo.static_cache) the fast
    path's stateful calls (its cast cache keys on data pointers, which Dynamo does not trace)
    step aside for peft's own forward; eager calls keep the fast path, and both give the same
    logits."""
    _, _, model = loss_and_grads(True)
    give_adapters_an_effect(model)
    calls = count_calls(monkeypatch)
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        assert calls["projection"] == 2 * 2  # q, k, v together and o, two layers; the MLP without a graph
        compiled = torch.compile(model.base_model.model, backend="eager")(input_ids=ids).logits
    assert calls["projection"] == 2 * 2
    torch.testing.assert_close(compiled, eager)
