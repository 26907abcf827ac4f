"""Families beyond Qwen2.5: the planner's shape from config.json, the family table, base-model
detection."""

from pathlib import Path

import pytest

from lora_lab.config import resolve_config
from lora_lab.errors import LoraLabError
from lora_lab.planning.memory import plan_memory
from lora_lab.planning.shape import ModelShape
from lora_lab.registry import (
    FAMILIES,
    GENERIC,
    OTHER_MODELS,
    family_of,
    is_base_model,
    missing_fast_paths,
    model_config_of,
)

# Parameter counts the model cards and safetensors index files publish (exact where known).
PUBLISHED_PARAMS = {
    "qwen2.5-7b": (7_615_616_512, 0),
    "llama-3.1-8b": (8_030_261_248, 0),
    "llama-3.2-1b": (1_235_814_400, 0),
    "mistral-7b": (7_248_023_552, 0),
    "smollm2-135m": (134_515_008, 0),
    "qwen3-8b": (8.19e9, 0.01),
    "qwen3-0.6b": (0.596e9, 0.01),
    "gemma-3-270m": (268e6, 0.01),
    "phi-4-mini": (3.84e9, 0.01),
    # llama.cpp's count of the Qwen3.5-9B GGUF (its language model: no vision tower, no MTP layer)
    "qwen3.5-9b": (8.95e9, 0.001),
    # the language model of Qwen3.5-2B's 2,274,069,824 (vision tower 331,416,576, MTP 60,828,160)
    "qwen3.5-2b": (1_881_825_088, 0),
    "smollm3-3b": (3.08e9, 0.01),
}


@pytest.mark.parametrize("alias", sorted(PUBLISHED_PARAMS))
def test_the_shape_from_config_json_counts_the_published_parameters(alias):
    count, tolerance = PUBLISHED_PARAMS[alias]
    params = ModelShape.from_config(model_config_of(alias)).params
    assert params == count if tolerance == 0 else abs(params - count) / count < tolerance


def test_every_shipped_model_is_planned_with_its_own_name_and_family():
    for alias, (hub, _) in OTHER_MODELS.items():
        config = resolve_config("24gb", flags={"model.name": alias, "data.datasets": ["x"]})
        plan = plan_memory(config, gpu_memory_gib=24)
        assert plan.model == hub.rsplit("/", 1)[-1] and plan.total_gib > 0
        assert family_of(model_config_of(alias)["model_type"]) is not GENERIC, alias
    # a local folder's config.json serves too, for a family the registry does not know
    assert family_of("some_new_arch") is GENERIC
    assert missing_fast_paths(GENERIC) and not missing_fast_paths(FAMILIES["qwen3"])


def test_wider_attention_than_hidden_is_counted_from_head_dim():
    """Qwen3-0.6B: 16 heads of 128 = 2048-wide q_proj on a 1024 hidden state."""
    shape = ModelShape.from_config(model_config_of("qwen3-0.6b"))
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    assert shape.linear_params == 28 * per_layer


def test_an_8b_in_16_bits_does_not_fit_a_16_gb_card_and_qlora_does():
    for alias in ("qwen3-8b", "llama-3.1-8b"):
        flags = {"model.name": alias, "data.datasets": ["x"], "data.max_length": 2048}
        bf16 = resolve_config("16gb", flags=flags, sets=["model.quantization=none"])
        nf4 = resolve_config("16gb", flags=flags, sets=["model.quantization=nf4"])
        assert plan_memory(bf16, gpu_memory_gib=16).fits is False
        assert plan_memory(nf4, gpu_memory_gib=16).fits is True


@pytest.mark.parametrize(
    "spec, base",
    [
        ("qwen2.5-7b-base", True),
        ("Qwen/Qwen2.5-7B", True),
        ("qwen2.5-7b", False),
        ("Qwen/Qwen3-8B-Base", True),
        ("qwen3-8b", False),
        ("meta-llama/Llama-3.2-1B", True),
        ("llama-3.2-1b", False),
        ("Qwen/Qwen2.5-Coder-7B-Instruct", False),
        ("google/gemma-3-270m", True),
        ("google/gemma-3-4b-pt", True),
        ("gemma-3-270m", False),
        ("google/gemma-3-1b-it", False),
        ("mistralai/Mistral-7B-v0.3", True),
        ("mistral-7b", False),
        ("microsoft/Phi-4-mini-instruct", False),
        ("HuggingFaceTB/SmolLM2-135M", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", False),
        ("Qwen/Qwen3-4B", False),
        ("HuggingFaceTB/SmolLM3-3B", False),
        ("smollm3-3b", False),
        ("smollm3-3b-base", True),
        ("Qwen/Qwen3.5-9B", False),
        ("Qwen/Qwen3.5-9B-Base", True),
    ],
)
def test_base_checkpoints_are_told_from_instruct_ones(spec, base):
    assert is_base_model(spec) is base


def test_the_families_page_names_every_family_of_the_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "families.md").read_text()
    for model_type in FAMILIES:
        assert f"(`{model_type}`)" in text, model_type
    for alias in OTHER_MODELS:
        assert alias.removesuffix("-base").split("-")[0] in text, alias


@pytest.mark.parametrize(
    "model, size, tier_16gb",
    [
        ("qwen3-8b", "7b", "nf4"),
        ("llama-3.1-8b", "7b", "nf4"),
        ("mistral-7b", "7b", "nf4"),
        ("phi-4-mini", "3b", "none"),
        ("gemma-3-4b", "3b", "none"),
        ("qwen3-1.7b", "1.5b", "none"),
        ("qwen2.5-7b", "7b", "nf4"),
    ],
)
def test_presets_choose_by_the_models_parameter_count(model, size, tier_16gb):
    """A model that is not a Qwen2.5 size takes the preset block of its parameter count's class,
    and the resolved config says so."""
    from lora_lab.config import resolve_config
    from lora_lab.registry import size_class

    found, why = size_class(model)
    assert found == size
    assert (why == "") == model.startswith("qwen2.5"), why
    config = resolve_config("16gb", flags={"model.name": model, "data.datasets": ["x"]})
    assert config.model.quantization == tier_16gb
    if tier_16gb == "nf4":
        assert "sizes.7b" in config.sources["model.quantization"]
    eight = resolve_config("8gb", flags={"model.name": model, "data.datasets": ["x"]})
    assert eight.model.quantization == ("nf4" if size in ("3b", "7b") else "none")


def meta_model(config: dict):
    """transformers' model of a shipped config.json on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    skip = ("model_type", "quantization_config")
    values = {k: v for k, v in config.items() if not k.startswith("_") and k not in skip}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))


NEW_FAMILIES = ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.6-27b", "smollm3-3b"]


@pytest.mark.parametrize("alias", NEW_FAMILIES)
def test_the_planner_counts_every_parameter_transformers_builds(alias):
    """The shape from the shipped config.json equals transformers' own model of it (on the meta
    device: no memory), parameter for parameter; the planner's LoRA count equals peft's at r=1."""
    import torch

    config = model_config_of(alias)
    model = meta_model(config)
    shape = ModelShape.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert shape.linear_params == sum(m.weight.numel() for m in linears)
    assert shape.lora_params_per_rank == sum(m.in_features + m.out_features for m in linears)


# what lora.target_modules all-linear trains, per family (a tiny model's named modules)
ALL_LINEAR = {
    "qwen3.5-0.8b": {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    },
    "smollm3-3b": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
}  # fmt: skip


@pytest.mark.parametrize("config_name", sorted(ALL_LINEAR))
def test_all_linear_layers_include_the_linear_attention_projections(config_name):
    from transformers import AutoModelForCausalLM

    from lora_lab.models.lora import linear_module_names
    from lora_lab.registry import LINEAR_ATTENTION_PROJECTIONS
    from tests.support.families import tiny_family_config

    model = AutoModelForCausalLM.from_config(tiny_family_config(config_name, vocab_size=256, pad_token_id=0))
    assert set(linear_module_names(model)) == ALL_LINEAR[config_name]
    if config_name.startswith("qwen3.5"):
        assert set(LINEAR_ATTENTION_PROJECTIONS) <= ALL_LINEAR[config_name]


@pytest.mark.parametrize(
    "alias, size, tier_16gb, tier_8gb",
    [
        ("qwen3.5-0.8b", "0.5b", "none", "none"),
        ("qwen3.5-2b", "1.5b", "none", "none"),
        ("qwen3.5-4b", "3b", "none", "nf4"),
        ("qwen3.5-9b", "7b", "nf4", "nf4"),
        ("smollm3-3b", "3b", "none", "nf4"),
    ],
)
def test_the_new_families_take_the_presets_of_their_size_and_are_planned(alias, size, tier_16gb, tier_8gb):
    """Each new alias resolves on every tier by its parameter count's class and gets a plan with
    its layers counted by kind (Qwen3.5's Gated DeltaNet state and conv) that fits the 16gb card:
    liger-kernel patches these families, so the loss is fused and the 248,320-column logits of
    Qwen3.5 are never built; with model.kernels=none they are counted."""
    from lora_lab.registry import size_class

    assert size_class(alias)[0] == size
    flags = {"model.name": alias, "data.datasets": ["x"]}
    sixteen = resolve_config("16gb", flags=flags)
    assert sixteen.model.quantization == tier_16gb
    assert resolve_config("8gb", flags=flags).model.quantization == tier_8gb
    plan = plan_memory(sixteen, gpu_memory_gib=16)
    linear = plan.parts_gib.get("linear attention state and conv (counted + fitted)", 0)
    assert (linear > 0) == alias.startswith("qwen3.5")
    assert "full logits for the loss (estimate)" not in plan.parts_gib and plan.fits
    unfused = plan_memory(sixteen.with_changes({"model.kernels": "none"}, "test"), gpu_memory_gib=16)
    vocab = model_config_of(alias)["vocab_size"]
    assert unfused.parts_gib["full logits for the loss (estimate)"] == pytest.approx(
        unfused.tokens_per_micro_batch * vocab * 10 / 2**30
    )
    family = family_of(model_config_of(alias)["model_type"])
    assert plan.longest_max_length and family is not GENERIC
    assert family.liger == f"apply_liger_kernel_to_{'qwen3_5' if alias.startswith('qwen') else 'smollm3'}"


@pytest.mark.parametrize("alias", ["qwen3.5-27b", "qwen3.6-27b"])
def test_the_27b_dense_qwen_trains_in_4_bits_on_the_24gb_tier_and_is_refused_on_16gb(alias):
    """26.9B parameters in the language model (the vision tower and the MTP layer are not
    trained): QLoRA on a 24 GB card; a 16 GB card cannot hold its 4-bit weights and activations."""
    from lora_lab.registry import size_class

    assert size_class(alias) == ("large", "26.9B parameters")
    flags = {"model.name": alias, "data.datasets": ["x"]}
    plans = {
        tier: plan_memory(resolve_config(tier, flags=flags), gpu_memory_gib=int(tier[:2])) for tier in ("24gb", "16gb")
    }
    assert plans["24gb"].fits and plans["24gb"].model == f"Qwen{alias[4:7]}-27B"
    assert not plans["16gb"].fits


MOE = ["qwen3-30b-a3b", "qwen3.5-35b-a3b", "gpt-oss-20b"]


@pytest.mark.parametrize("alias", MOE)
def test_the_planner_counts_a_mixture_of_experts_as_transformers_builds_it(alias):
    """Every parameter of transformers' model of the shipped config.json (on the meta device),
    within 0.001% (the small norms and gpt-oss's sinks are not counted); its fused experts among
    the 4-bit weights of a QLoRA plan; LoRA's count that of peft at r=1 on every linear layer but
    the routers."""
    import torch

    from lora_lab.models.lora import ROUTERS

    config = model_config_of(alias)
    model = meta_model(config)
    shape = ModelShape.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - built) / built < 1e-5
    experts = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )
    linears = [
        m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head" and n.rsplit(".", 1)[-1] not in ROUTERS
    ]
    assert shape.layers * shape.layer_experts == experts
    assert shape.linear_params - experts == sum(m.weight.numel() for m in linears)
    assert shape.lora_params_per_rank == sum(m.in_features + m.out_features for m in linears)


def test_qlora_of_a_mixture_of_experts_plans_the_ram_its_loading_takes():
    """QLoRA of an MXFP4 checkpoint (gpt-oss) loads into CPU memory wholly de-quantized before its
    weights go to the GPU in 4 bits: the plan counts it and refuses a machine whose RAM cannot hold
    it, naming the RAM that would. Qwen3-MoE's experts stream from the files onto the GPU
    (models/expert_loading.py), and a dense model loads onto the GPU: neither plans loading RAM,
    and a 32 GiB machine trains Qwen3-30B-A3B."""
    from lora_lab.planning.choice import check_fits

    gib = 2**30
    plans = {}
    for alias in ("qwen3-30b-a3b", "gpt-oss-20b", "qwen2.5-7b"):
        config = resolve_config("24gb", flags={"model.name": alias, "data.datasets": ["x"]})
        plans[alias] = plan_memory(config, gpu_memory_gib=24, cpu_memory_gib=32)
        shape = ModelShape.from_config(model_config_of(alias))
        if alias == "gpt-oss-20b":
            assert plans[alias].loading_host_gib == shape.params * 2 / gib
            assert plan_memory(config, gpu_memory_gib=24, cpu_memory_gib=128).cpu_fits
            with pytest.raises(LoraLabError, match="GiB of 16-bit weights pass through it while the model loads"):
                check_fits(config, 24, cpu_memory_gib=32)
    for alias in ("qwen3-30b-a3b", "qwen2.5-7b"):
        assert plans[alias].loading_host_gib == 0 and plans[alias].fits and plans[alias].cpu_fits
    assert plans["gpt-oss-20b"].fits and plans["gpt-oss-20b"].cpu_fits is False
    assert plans["gpt-oss-20b"].longest_max_length is None
    assert plans["gpt-oss-20b"].fixes[0].startswith("a machine with ")


GEMMA4 = ["gemma-4-e2b", "gemma-4-e4b", "gemma-4-26b-a4b", "gemma-4-31b"]


@pytest.mark.parametrize("alias", GEMMA4)
def test_the_planner_counts_gemma_4_as_transformers_builds_it(alias):
    """Every parameter of transformers' Gemma 4 of the shipped config.json (meta device), exactly:
    wider full-attention heads, shared keys and values with double-wide MLPs, per-layer inputs,
    k = v attention, experts beside the dense MLP; the decoder's linear layers exactly (the
    routers' and the per-layer input table's projection aside)."""
    import torch

    config = model_config_of(alias)
    model = meta_model(config)
    shape = ModelShape.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    decoder = [
        m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in n and ".router." not in n
    ]
    assert shape.linear_params - shape.layers * shape.layer_experts == sum(m.weight.numel() for m in decoder)
    assert shape.lora_params_per_rank == sum(m.in_features + m.out_features for m in decoder)


@pytest.mark.parametrize(
    "model", ["qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b", "gemma-4-26b-a4b", "gemma-4-31b"]
)
def test_models_over_12b_take_qlora_on_every_card_and_the_24gb_plan_fits(model):
    """The large size class: QLoRA on every tier (16 bits of 20B and more fits no consumer card);
    the 24gb preset's plan fits its card (planned, not measured)."""
    from lora_lab.config import resolve_config
    from lora_lab.registry import size_class

    assert size_class(model)[0] == "large"
    for tier in ("24gb", "16gb", "12gb", "8gb"):
        config = resolve_config(tier, flags={"model.name": model, "data.datasets": ["x"]})
        assert config.model.quantization == "nf4" and "sizes.large" in config.sources["model.quantization"]
    config = resolve_config("24gb", flags={"model.name": model, "data.datasets": ["x"]})
    assert plan_memory(config, gpu_memory_gib=24).fits
