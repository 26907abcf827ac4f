"""The tuners' parts that need no training run: refused combinations, the fast-path decision,
PiSSA / OLoRA conversion onto the original base (real peft, tiny Qwen2), and the planner's
DoRA and IA3 arithmetic."""

from __future__ import annotations

import pytest
import torch

from lora_lab.config import LoraArgs, resolve_config
from lora_lab.errors import ConfigError
from lora_lab.models.fast_lora import FastLoraOptions
from lora_lab.models.lora import LoraOptions, apply_lora, save_converted_adapter, save_initial_adapter
from lora_lab.planning.memory import plan_memory
from lora_lab.planning.policies import resolve_fast_lora
from lora_lab.planning.shape import ModelShape
from lora_lab.planning.tuners import adapter_params, dora_parts
from lora_lab.registry import known_model_config
from tests.unit.test_fast_lora import count_calls
from tests.unit.test_memory_means import SEQ, tiny_untied

DATA = {"data.datasets": ["x"], "model.name": "qwen2.5-0.5b"}


def problems_of(*sets, preset="24gb"):
    with pytest.raises(ConfigError) as refused:
        resolve_config(preset, flags=DATA, sets=list(sets))
    return refused.value.problems


@pytest.mark.parametrize(
    "sets,expected",
    [
        (("train.tuner=ia3", "model.quantization=nf4"), "--set train.tuner=ia3: IA3 trains on a 16-bit base only"),
        (
            ("train.tuner=dora", "model.fast_lora=true"),
            "--set model.fast_lora=True: true computes plain LoRA layers; --tuner dora needs peft's "
            "forward. Use --set model.fast_lora=auto (or false).",
        ),
        (
            ("train.tuner=full", "train.loraplus_lr_ratio=16"),
            "--set train.loraplus_lr_ratio=16: applies to --tuner lora and dora (LoRA's A and B "
            "matrices); --tuner full has none. Drop it, or use --tuner lora.",
        ),
        (("train.tuner=ia3", "lora.use_rslora=true"), "--set lora.use_rslora=True: applies to --tuner lora and dora"),
        (
            ("lora.init=pissa", "model.quantization=nf4"),
            "--set lora.init=pissa: pissa rewrites the base weights as the residual of their "
            "decomposition, which 4-bit weights cannot hold exactly. Drop --quantization nf4, or use "
            "lora.init default (QLoRA).",
        ),
        (("lora.init=olora", "train.tuner=dora"), "--set lora.init=olora: olora starts plain LoRA"),
        (
            ("lora.init=pissa_niter_4", "train.gpus=2", "train.engine=deepspeed-zero3"),
            "--set lora.init=pissa_niter_4: pissa_niter_4 decomposes each whole base weight",
        ),
        (("lora.init=svd",), "--set lora.init=svd: must be one of default, gaussian, pissa, olora or pissa_niter_N"),
        (
            ("train.tuner=ia3", "lora.trainable_tokens=true"),
            "--set lora.trainable_tokens=True: true trains token rows beside a LoRA or DoRA adapter",
        ),
    ],
)
def test_a_combination_that_cannot_work_is_refused_with_its_fix(sets, expected):
    problems = problems_of(*sets)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize(
    "sets",
    [
        ("train.tuner=dora", "lora.init=gaussian", "lora.use_rslora=true", "train.loraplus_lr_ratio=16"),
        ("train.tuner=ia3", "train.neftune_noise_alpha=5"),
        ("lora.init=pissa_niter_16", "train.gpus=2", "train.engine=fsdp"),
        ("lora.init=olora", "train.neftune_noise_alpha=5"),
    ],
)
def test_combinations_that_work_resolve(sets):
    resolve_config("24gb", flags=DATA, sets=list(sets))


def test_fast_path_is_off_for_dora_and_ia3_and_on_for_pissa():
    def fast(*sets):
        return resolve_fast_lora(resolve_config("24gb", flags=DATA, sets=["lora.dropout=0", *sets]))

    assert fast() and fast("lora.init=pissa") and fast("lora.use_rslora=true")
    assert not fast("train.tuner=dora") and not fast("train.tuner=ia3")


def loss_and_grads(tuner: str, fast: bool, init: str = "default"):
    model = tiny_untied()
    torch.manual_seed(1)
    building = LoraOptions(gradient_checkpointing=True, fast=FastLoraOptions() if fast else None, tuner=tuner)
    model = apply_lora(model, LoraArgs(rank=4, alpha=8, dropout=0, init=init), building)
    with torch.no_grad():  # B starts at zero (PiSSA's does not): give every adapter an effect
        for name, param in model.named_parameters():
            if "lora_B" in name and init == "default":
                param.normal_(0, 0.1)
    model.train()
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "tuner,init,routed", [("dora", "default", False), ("lora", "pissa", True), ("lora", "olora", True)]
)
def test_fast_path_falls_back_for_dora_and_computes_pissa_as_peft(tuner, init, routed, monkeypatch):
    plain = loss_and_grads(tuner, False, init)
    calls = count_calls(monkeypatch)
    fast = loss_and_grads(tuner, True, init)
    assert (calls["mlp"] > 0 and calls["projection"] > 0) is routed
    assert calls == {"mlp": 0, "projection": 0} or routed
    assert fast[0] == pytest.approx(plain[0], rel=1e-5)
    for name, grad in plain[1].items():
        torch.testing.assert_close(fast[1][name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "init,rslora", [("pissa", False), ("olora", False), ("pissa", True), ("pissa_niter_4", False)]
)
def test_converted_adapter_on_the_original_base_is_the_trained_model(init, rslora, tmp_path):
    """PiSSA / OLoRA train on the residual base; the saved adapter/ must give the trained
    model's logits on the original base (peft path_initial_model_for_weight_conversion)."""
    from peft import PeftModel

    model = apply_lora(tiny_untied(), LoraArgs(rank=4, alpha=8, dropout=0, init=init, use_rslora=rslora))
    save_initial_adapter(model, tmp_path / "adapter_init")
    assert model.peft_config["default"].init_lora_weights == init  # left as it was
    with torch.no_grad():  # "training": move every adapter weight
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        trained = model.eval()(ids).logits
    save_converted_adapter(model, tmp_path / "adapter", tmp_path / "adapter_init")
    original = tiny_untied()
    with torch.no_grad():
        base = original(ids).logits
        loaded = PeftModel.from_pretrained(original, tmp_path / "adapter").eval()(ids).logits
    assert (trained - base).abs().max() > 1e-2
    torch.testing.assert_close(loaded, trained, atol=1e-4, rtol=0)


def seven_b() -> ModelShape:
    return ModelShape.from_config(known_model_config("7b"))


def test_dora_and_ia3_parameters_are_counted_per_channel():
    shape = seven_b()  # Qwen2.5-7B: hidden 3584, intermediate 18944, 4 KV heads of 128, 28 layers
    outputs = 3584 + 512 + 512 + 3584 + 18944 + 18944 + 3584
    assert sum(o for _, o in shape.linears) == outputs == 49664
    lora = shape.trained_params("lora", 8)
    assert lora == shape.lora_params_per_rank * 8 == 20_185_088
    assert shape.trained_params("dora", 8) == lora + 28 * outputs
    # IA3 scales the outputs of q k v o gate up and the input (intermediate) of down_proj
    assert shape.trained_params("ia3", 8) == 28 * (outputs - 3584 + 18944) == 1_820_672
    assert adapter_params("lora", shape.linears, 28, 8) == lora


def test_dora_activations_are_counted_from_its_forward():
    shape = seven_b()
    parts = dora_parts(shape.linears, shape.layers, 2048, True, 2)
    saved, dense, blocks = parts.values()
    assert saved == 2048 * 2 * 49664 * 2  # base and scaled LoRA output, bf16, one layer
    # down_proj: an fp32 identity of 18944^2, its dense LoRA weight in fp32 and bf16, W + s BA
    assert dense == 18944**2 * 4 + 18944 * 3584 * (4 + 3 * 2)
    assert blocks == int(0.9 * 18944**2 * 4)  # fitted: 1.27 / 1.16 GiB measured at 7B
    quantized = dora_parts(shape.linears, shape.layers, 2048, True, 2, quantized=True)
    assert quantized["DoRA's dequantized 4-bit weight (fitted)"] == 16 * 18944 * 3584
    unchecked = dora_parts(shape.linears, 28, 2048, False, 2)
    assert unchecked["DoRA outputs kept for backward (counted)"] == 28 * saved


def test_the_plan_grows_by_exactly_the_dora_terms():
    def plan(*sets):
        return plan_memory(
            resolve_config("24gb", flags={**DATA, "model.name": "qwen2.5-7b"}, sets=["data.max_length=2048", *sets])
        )

    # LoRA on peft's layers, as DoRA's run (the fast path's working memory is its own)
    lora, dora, ia3 = (plan("model.fast_lora=false"), plan("train.tuner=dora"), plan("train.tuner=ia3"))
    magnitudes = 28 * 49664 * 16 / 2**30
    added = dora.total_gib - lora.total_gib
    extra = sum(v for k, v in dora.parts_gib.items() if "DoRA" in k and "Adam" not in k)
    assert extra > sum(v for k, v in dora.parts_gib.items() if "(counted)" in k and "DoRA" in k)
    assert added == pytest.approx(magnitudes + extra, rel=1e-9)
    assert dora.parts_gib["DoRA A, B, magnitudes + grads + Adam (fp32)"] == pytest.approx(
        lora.parts_gib["LoRA weights + gradients + Adam state (fp32)"] + magnitudes
    )
    assert ia3.parts_gib["IA3 vectors + gradients + Adam state (fp32)"] == pytest.approx(1_820_672 * 16 / 2**30)
    assert ia3.total_gib < lora.total_gib < dora.total_gib
    assert dora.quantization == "16-bit DoRA" and "DoRA dense" in dora.report()


def test_vllm_serves_lora_rslora_and_converted_adapters_not_dora_or_ia3(tmp_path):
    from types import SimpleNamespace

    from lora_lab.planning.serving import vllm_commands

    def result(kind, rank=8):
        return SimpleNamespace(
            output_dir=tmp_path / "merged",
            base_model="qwen2.5-7b",
            adapter_dir=tmp_path / "adapter",
            lora_rank=rank,
            target_modules=["q_proj"],
            adapter_kind=kind,
        )

    assert "--max-lora-rank 8" in vllm_commands(result("lora"))["commands"]["adapter"]
    for kind, says in (("dora", "does not serve DoRA"), ("ia3", "not IA3")):
        serving = vllm_commands(result(kind, None))
        assert list(serving["commands"]) == ["merged"]
        assert says in serving["warnings"][0] and "merged folder" in serving["warnings"][0]


def test_disk_plan_counts_the_converted_and_initial_adapters():
    from lora_lab.planning.disk import checkpoint_sizes

    def sizes(*sets):
        config = resolve_config("24gb", flags={**DATA, "model.name": "qwen2.5-7b"}, sets=list(sets))
        return checkpoint_sizes(config, known_model_config("7b"))

    weights, optimizer, final = sizes()
    assert sizes("lora.init=pissa") == (weights, optimizer, 3 * final)  # 2 x rank + initial
    assert sizes("train.tuner=dora")[0] == weights + 28 * 49664 * 4  # fp32 magnitudes
