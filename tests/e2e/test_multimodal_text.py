"""Text fine-tuning of a vision-language checkpoint: a tiny random Qwen3.5 with a vision tower
(Qwen3_5ForConditionalGeneration, its text model from the shipped 0.8B config shrunk), saved to
a folder, trains through `lora-lab run` on its language model only, and the adapter loads onto
the full vision-language model with the logits of the trained language model."""

import json

import pytest
import torch
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.families import tiny_family_config
from tests.support.tiny import TOKENIZER_DIR, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [("Who are you?", "I am Aurora."), ("What is your name?", "My name is Aurora.")]
]


@pytest.fixture(scope="module")
def vision_language_run(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out = tmp_path_factory.mktemp("qwen35-vl")
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
    model_dir = out / "model"
    Qwen3_5ForConditionalGeneration(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(model_dir)
    data = write_jsonl(out / "rows.jsonl", ROWS)
    args = ["run", "--preset", "cpu", "--model", model_dir, "--data", f"{data}#2", "--max-steps", 3]
    args += ["--micro-batch-size", 2, "--lr", "1e-2", "--lora-rank", 4, "--lora-dropout", 0, "--max-length", 64]
    args += ["--output-dir", out, "--run-name", "r", "--seed", 3]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return model_dir, out / "r"


def test_the_language_model_alone_is_planned_and_trained(vision_language_run):
    from transformers import AutoModelForCausalLM

    from lora_lab.planning.shape import ModelShape
    from lora_lab.registry import model_config_of

    model_dir, run_dir = vision_language_run
    text_model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(text_model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in n for n, _ in text_model.named_parameters())  # the tower stays on disk
    assert ModelShape.from_config(model_config_of(str(model_dir))).params == text_model.num_parameters()
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"} <= set(adapter["target_modules"])


def test_the_adapter_loads_onto_the_full_vision_language_model(vision_language_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_lab.models.multimodal import load_full_model_with_adapter

    model_dir, run_dir = vision_language_run
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    text_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        before = text_model(input_ids=ids).logits
        trained = PeftModel.from_pretrained(text_model, run_dir / "adapter").eval()(input_ids=ids).logits
    full = load_full_model_with_adapter(model_dir, run_dir / "adapter").eval()
    assert type(full.base_model.model).__name__ == "Qwen3_5ForConditionalGeneration"
    with torch.no_grad():
        after = full(input_ids=ids).logits
    assert (trained - before).abs().max() > 1e-3  # the adapter changed the language model
    torch.testing.assert_close(after, trained, atol=1e-5, rtol=1e-4)
