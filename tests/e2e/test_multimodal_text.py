"""Text fine-tuning of a vision-language checkpoint: a tiny random Qwen3.5 with a vision tower
(Qwen3_5ForConditionalGeneration, its text model from the shipped 0.8B config shrunk) and a tiny
random Gemma 4 with one (Gemma4ForConditionalGeneration, E2B's text model shrunk), each saved to a
folder, train through `lora-lab run` on their language model only, and the adapter loads onto
the full vision-language model with the logits of the trained language model."""

import json

import pytest
import torch
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support import families
from tests.support.families import tiny_family_config
from tests.support.tiny import TOKENIZER_DIR, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [("Who are you?", "I am Aurora."), ("What is your name?", "My name is Aurora.")]
]


def qwen35_vision_language(folder):
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_family_config(
        "qwen3.5-0.8b",
        vocab_size=151936,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    ).to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        spatial_merge_size=2,
    )
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)


def gemma4_vision_language(folder):
    """E2B's text model shrunk (families.GEMMA4_TINY: sliding and full layers, shared keys and
    values, per-layer inputs) on Gemma 4's tokenizer, with a one-layer
    vision tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    tokenizer = families.gemma4_tokenizer()
    text = tiny_family_config("gemma-4-e2b", **families.GEMMA4_TINY).to_dict()
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    torch.manual_seed(0)
    Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


BUILDERS = {"qwen3_5": qwen35_vision_language, "gemma4": gemma4_vision_language}
TEXT_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "gemma4": "Gemma4ForCausalLM"}
FULL_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
ADAPTED = {"qwen3_5": {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"}}
ADAPTED["gemma4"] = {"q_proj", "down_proj", "per_layer_input_gate", "per_layer_model_projection"}


@pytest.fixture(scope="module", params=list(BUILDERS))
def vision_language_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"{request.param}-vl")
    model_dir = out / "model"
    BUILDERS[request.param](model_dir)
    data = write_jsonl(out / "rows.jsonl", ROWS)
    args = ["run", "--preset", "cpu", "--model", model_dir, "--data", f"{data}#2", "--max-steps", 3]
    args += ["--micro-batch-size", 2, "--lr", "1e-2", "--lora-rank", 4, "--lora-dropout", 0, "--max-length", 64]
    args += ["--output-dir", out, "--run-name", "r", "--seed", 3]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return request.param, model_dir, out / "r"


def language_model(model_dir):
    """The checkpoint's language model as lora-lab loads it (models/load.py)."""
    from lora_lab.models.load import _from_pretrained

    return _from_pretrained(str(model_dir), str(model_dir), {})


def test_the_language_model_alone_is_planned_and_trained(vision_language_run):
    from lora_lab.planning.shape import ModelShape
    from lora_lab.registry import model_config_of

    family, model_dir, run_dir = vision_language_run
    text_model = language_model(model_dir)
    assert type(text_model).__name__ == TEXT_CLASSES[family]
    assert not any(part in n for n, _ in text_model.named_parameters() for part in ("visual", "vision"))  # on disk
    assert ModelShape.from_config(model_config_of(str(model_dir))).params == text_model.num_parameters()
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert ADAPTED[family] <= set(adapter["target_modules"])
    assert not any("vision" in module for module in adapter["target_modules"])


def test_the_adapter_loads_onto_the_full_vision_language_model(vision_language_run):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from lora_lab.models.multimodal import load_full_model_with_adapter

    family, model_dir, run_dir = vision_language_run
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        ROWS[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    text_model = language_model(model_dir).eval()
    with torch.no_grad():
        before = text_model(input_ids=ids).logits
        trained = PeftModel.from_pretrained(text_model, run_dir / "adapter").eval()(input_ids=ids).logits
    full = load_full_model_with_adapter(model_dir, run_dir / "adapter").eval()
    assert type(full.base_model.model).__name__ == FULL_CLASSES[family]
    with torch.no_grad():
        after = full(input_ids=ids).logits
    assert (trained - before).abs().max() > 1e-3  # the adapter changed the language model
    torch.testing.assert_close(after, trained, atol=1e-5, rtol=1e-4)
