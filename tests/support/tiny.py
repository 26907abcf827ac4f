"""Helpers the tests share (fixtures stay in tests/conftest.py): the shipped real Qwen2.5
tokenizer, a tiny random Qwen2 model, a tiny LoRA run through the CLI, jsonl files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).parents[1] / "assets"
TOKENIZER_DIR = Path(__file__).parents[2] / "lora_lab" / "qwen25_tokenizer"  # real Qwen2.5, shipped


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


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


def train_tiny_run(model_dir: Path, out: Path, rows: list, lr: str = "1e-2"):
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
                lr,
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
