"""Mixture-of-experts models with their fused experts in 4 bits (lora_lab/models/moe.py): tiny
random Qwen3-MoE, gpt-oss, Qwen3.5-MoE and Gemma 4 (26B-A4B's layout) models of transformers 5. The quantized model holds
nf4 bytes only, computes exactly what the same model with the de-quantized experts as plain
tensors computes, and gives its LoRA the same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lora_lab.architecture import expert_count
from lora_lab.models.moe import EXPERT_WEIGHTS, expert_bytes, expert_modules, quantize_experts

SHARED = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=8),
    "qwen3_5_moe_text": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    ),
    "gemma4_text": dict(  # 26B-A4B's layout: experts beside a dense MLP
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        intermediate_size=64,
        head_dim=16,
        global_head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        hidden_size_per_layer_input=0,
    ),
}


def tiny_moe(model_type: str, seed: int = 0, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **SHARED, **TINY[model_type])
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def with_plain_experts(quantized, like):
    """`like` (a copy of the model before quantizing) with the quantized model's experts,
    de-quantized, as its plain parameters."""
    for (_, q), (_, plain) in zip(expert_modules(quantized), expert_modules(like), strict=True):
        for key in EXPERT_WEIGHTS:
            plain._parameters[key] = torch.nn.Parameter(getattr(q, key).clone(), requires_grad=False)
    return like


@pytest.mark.parametrize("model_type", list(TINY))
def test_the_experts_are_held_in_4_bits_and_compute_what_their_values_do(model_type):
    model = tiny_moe(model_type)
    experts = sum(getattr(m, k).numel() for _, m in expert_modules(model) for k in EXPERT_WEIGHTS)
    assert expert_bytes(model) == {"16-bit": 2 * experts, "nf4": 0}
    reference = copy.deepcopy(model)
    held = quantize_experts(model)
    assert expert_bytes(model) == {"16-bit": 0, "nf4": held}
    packed = [m.parametrizations[k].original for _, m in expert_modules(model) for k in EXPERT_WEIGHTS]
    assert {p.dtype for p in packed} == {torch.uint8} and sum(p.numel() for p in packed) == experts // 2  # 2 a byte
    assert not [n for n, _ in model.named_parameters() if n.endswith(tuple(f"experts.{k}" for k in EXPERT_WEIGHTS))]
    assert quantize_experts(model) == 0  # quantized once
    reference = with_plain_experts(model, reference)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize(
    "model_type, experts, rank", [("qwen3_moe", False, 4), ("gpt_oss", False, 4), ("gemma4_text", False, 4),
                                  ("qwen3_moe", True, 4), ("gpt_oss", True, 4), ("gemma4_text", True, 4),
                                  ("qwen3_moe", True, 8), ("gpt_oss", True, 8)]
)  # fmt: skip
def test_lora_on_a_quantized_moe_gets_the_gradients_of_the_plain_one(model_type, experts, rank):
    """As a training run builds it: the adapter attached to the 16-bit experts, then the experts
    quantized (models/moe.py adapted_experts_to). LoRA on the attention, and with lora.experts on
    every expert tensor too, gets exactly the gradients it gets on the de-quantized values held
    as plain tensors, and the experts' adapters are laid out as on 16-bit experts; rank 8 puts
    the experts' LoRA in low rank on the grouped products, rank 4 (bf16 rows of 8 bytes, which
    torch's grouped product does not take) adds its delta to the tensors."""
    assert_lora_gradients_equal(model_type, experts, device=None, rank=rank)


def assert_lora_gradients_equal(model_type: str, experts: bool, device: str | None, rank: int = 4) -> None:
    from peft import LoraConfig, get_peft_model

    from lora_lab.models.lora import expert_parameter_names, linear_module_names
    from lora_lab.models.moe import adapted_experts_to, expert_lora_in_low_rank

    dense = ["down_proj", "gate_proj", "up_proj"] if model_type == "gemma4_text" else []  # the MLP beside
    grads, layouts = [], []
    for quantized in (True, False):
        model = tiny_moe(model_type)
        targets = linear_module_names(model)
        assert targets == sorted(["k_proj", "o_proj", "q_proj", "v_proj", *dense])  # no router, no fused experts
        extra = {"target_parameters": expert_parameter_names(model), "lora_dropout": 0} if experts else {}
        torch.manual_seed(2)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
        tuned = get_peft_model(model, config)
        expert_lora_in_low_rank(tuned)  # as the builder does for 16-bit experts (adapted_experts_to does it too)
        if quantized:
            adapted_experts_to(tuned, device)
            assert expert_bytes(tuned)["16-bit"] == 0
            plain = [getattr(m, k).clone() for _, m in expert_modules(tuned) for k in EXPERT_WEIGHTS]
        else:  # the values the 4-bit experts hold, as plain tensors
            for _, module in expert_modules(tuned):
                for key in EXPERT_WEIGHTS:
                    module._parameters[key] = torch.nn.Parameter(plain.pop(0), requires_grad=False)
        tuned.to(device or "cpu")
        tuned.gradient_checkpointing_enable({"use_reentrant": False})
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(device or "cpu")
        tuned(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in tuned.named_parameters() if p.requires_grad})
        layouts.append({n: tuple(p.shape) for n, p in tuned.named_parameters() if p.requires_grad})
    assert layouts[0] == layouts[1]
    wrapped = 2 * 2 * 2 if experts else 0  # two expert tensors a layer, lora_A and lora_B each
    assert len(grads[0]) == 2 * len(targets) * 2 + wrapped
    for name in grads[0]:
        assert grads[0][name].abs().max() > 0, name
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


class ExpertProducts(TorchDispatchMode):
    """The shapes of the tensors that peft's delta (baddbmm) and grouped products made inside it."""

    PRODUCTS = ("baddbmm", "_grouped_mm")

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("model_type", list(TINY))
def test_expert_lora_in_low_rank_computes_what_peft_computes_without_building_a_delta(model_type, device="cpu"):
    """lora.experts through expert_lora_in_low_rank (x @ W + scaling * (x @ A) @ B on the grouped
    products) gives the logits and every LoRA gradient of peft's own forward, which adds
    scaling * B @ A to the experts' tensors (fp32 on the CPU, bf16 on a GPU); no such delta (baddbmm) is built, and the
    frozen experts' weights get no gradient computed."""
    from peft import LoraConfig, get_peft_model

    from lora_lab.models.lora import expert_parameter_names
    from lora_lab.models.moe import expert_lora_in_low_rank

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for low_rank in (False, True):
        model = tiny_moe(model_type, dtype=torch.float32 if device == "cpu" else torch.bfloat16).to(device)
        torch.manual_seed(2)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False,
                            target_parameters=expert_parameter_names(model), lora_dropout=0)  # fmt: skip
        tuned = get_peft_model(model, config)
        if low_rank:
            assert expert_lora_in_low_rank(tuned) == 2  # a module a layer
        with ExpertProducts() as products:
            loss = tuned(input_ids=ids, labels=ids).loss
            loss.backward()
        tensors = [getattr(m, k) for _, m in expert_modules(tuned) for k in EXPERT_WEIGHTS]
        sizes = {tuple(t.shape) for t in tensors} | {tuple(t.transpose(-2, -1).shape) for t in tensors}
        # peft's delta (baddbmm) and the weight gradient of experts plus delta have their size
        assert bool(sizes & set(products.shapes)) is not low_rank, products.shapes
        results.append((loss.detach(), {n: p.grad for n, p in tuned.named_parameters() if p.requires_grad}))
    (peft_loss, peft_grads), (loss, grads) = results
    tolerance = dict(rtol=0, atol=1e-4 if device == "cpu" else 3e-2)  # of the largest value; GPU: bf16 sums
    torch.testing.assert_close(loss / peft_loss, torch.ones_like(loss), **tolerance)
    assert grads.keys() == peft_grads.keys() and len([n for n in grads if "experts" in n]) == 2 * 2 * 2
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        scale = peft_grads[name].abs().max()
        torch.testing.assert_close(grad / scale, peft_grads[name] / scale, **tolerance, msg=name)


def test_a_config_json_says_how_many_experts():
    assert expert_count({"model_type": "qwen3_moe", "num_experts": 128}) == 128
    assert expert_count({"model_type": "gpt_oss", "num_local_experts": 32}) == 32
    assert expert_count({"model_type": "qwen3_5_moe", "text_config": {"num_experts": 256}}) == 256
    assert expert_count({"model_type": "qwen2", "hidden_size": 896}) == 0


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_a_packed_row_on_the_models_own_attention_gives_each_sample_its_logits_alone(model_type):
    """Eager attention (gpt-oss's on the CPU) over a packed row: the collator's `positions` batch
    (position ids only) gives each sample the logits it has alone, across gpt-oss's sliding
    window too (its decoder builds no mask from the position ids: masks_from_positions does),
    and the load-balancing loss counts every token of the row (no padding)."""
    from lora_lab.data.collate import PackedCollator
    from lora_lab.models.attention import masks_from_positions
    from lora_lab.registry import family_of

    model = tiny_moe(model_type).float()
    model.config._attn_implementation = "eager"
    model.config.output_router_logits, model.config.use_cache = True, False
    if family_of(model_type).masks_without_positions:
        masks_from_positions(model)
    lengths = [5, 13, 11]  # over the sliding window of 8
    samples = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    row = torch.cat(samples).tolist()
    batch = PackedCollator(0, "positions")([{"input_ids": row, "labels": row, "lengths": lengths}])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    out = model(**batch)
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    torch.testing.assert_close(out.logits[0], alone, rtol=0, atol=1e-5)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_the_planner_counts_the_experts_lora_as_peft_makes_it(model_type):
    """lora.experts: the planner's count of the fused experts' LoRA parameters (ModelShape
    expert_lora_per_rank) equals what peft's target_parameters adds to the model."""
    from peft import LoraConfig, get_peft_model

    from lora_lab.models.lora import expert_parameter_names
    from lora_lab.planning.shape import ModelShape

    model = tiny_moe(model_type)
    shape = ModelShape.from_config(model.config.to_dict())
    names = expert_parameter_names(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=[], target_parameters=names))
    counted = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert counted == shape.expert_lora_per_rank * 4 > 0


@pytest.mark.parametrize("experts", [False, True])
def test_the_plan_holds_a_second_copy_of_a_layers_experts_only_through_ligers_fused_moe(experts):
    """Qwen3-30B-A3B QLoRA: through liger's fused MoE (model.liger_experts true) the recomputed
    layer holds two bf16 copies of one layer's experts, else one: lora.experts then
    runs in low rank on the grouped products (the 24gb preset's rank 8), and at a rank that
    cannot (4) holds the weights with their delta and its gradient, two more; gpt-oss has no
    fused MoE."""
    from lora_lab.config import resolve_config
    from lora_lab.planning.memory import plan_memory
    from lora_lab.planning.shape import ModelShape
    from lora_lab.registry import model_config_of

    layer = 2 * ModelShape.from_config(model_config_of("qwen3-30b-a3b")).layer_experts / 2**30
    sets = ["model.quantization=nf4", f"lora.experts={str(experts).lower()}"]

    def planned(name, *more):
        flags = {"model.name": name, "data.datasets": ["x"]}
        return plan_memory(resolve_config("24gb", flags=flags, sets=[*sets, *more])).total_gib

    fused, plain = (
        planned("qwen3-30b-a3b", "model.liger_experts=true"),
        planned("qwen3-30b-a3b", "model.liger_experts=false"),
    )
    assert fused - plain == pytest.approx(layer, abs=1e-6)
    assert planned("qwen3-30b-a3b") == (plain if experts else fused)  # auto: liger's fused MoE without lora.experts
    delta = planned("qwen3-30b-a3b", "model.liger_experts=false", "lora.rank=4") - planned(
        "qwen3-30b-a3b", "model.liger_experts=false", "lora.rank=8"
    )
    fewer_adapter_weights = planned("qwen3-30b-a3b", "model.liger_experts=true", "lora.rank=8") - planned(
        "qwen3-30b-a3b", "model.liger_experts=true", "lora.rank=4"
    )
    assert delta + fewer_adapter_weights == pytest.approx(2 * layer if experts else 0, abs=1e-6)
    assert planned("gpt-oss-20b") == planned("gpt-oss-20b", "model.liger_experts=false")
