"""Families beyond Qwen2.5: the planner's shape from config.json, the family table, base-model
detection."""

from pathlib import Path

import pytest

from lora_lab.config import resolve_config
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
