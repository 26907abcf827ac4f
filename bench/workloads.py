"""Benchmark inputs: random-weight Qwen2.5 models of the real shapes, and synthetic SFT data.

A model built from the real config.json with random weights costs exactly the memory and time of
the pretrained one, so GPU benchmarks need no download.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKENIZER_DIR = ROOT / "tests" / "assets" / "qwen2.5-tokenizer"

WORDS = ("the model learns to answer questions about data training memory speed kernel "
         "attention layer token batch gradient adapter rank alpha weight bias loss step "
         "epoch card budget plan preset length sample dataset answer reply user system").split()


def make_random_model(size: str, out: Path) -> Path:
    """Qwen2.5-`size` (0.5b ... 7b) with random bf16 weights, saved with the real tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lora_lab.registry import known_model_config

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    body = dict(known_model_config(size))
    body.pop("_name_or_path", None)
    config = AutoConfig.for_model(**{k: v for k, v in body.items()
                                     if k not in ("architectures", "transformers_version")})
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = [151645, 151643]
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(staging)
    staging.rename(out)
    del model
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_full_length_rows(path: Path, rows: int, tokens: int, seed: int = 0) -> Path:
    """Conversations longer than `tokens`: with --truncation truncate every sample is exactly
    `tokens` long, and almost all of it is the assistant reply (trained)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            row = {"messages": [{"role": "user", "content": _text(rng, 12)},
                                {"role": "assistant", "content": _text(rng, tokens + 64)}]}
            handle.write(json.dumps(row) + "\n")
    return path


def write_sft_mix_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """A realistic SFT length mix (stated so it can be reproduced): 40% self-cognition-like
    (reply 10-40 words), 45% alpaca-like (prompt 10-60, reply 20-250 words), 15% long
    (prompt 50-300, reply 300-900 words)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            kind = rng.random()
            if kind < 0.40:
                prompt, reply = rng.randint(3, 12), rng.randint(10, 40)
            elif kind < 0.85:
                prompt, reply = rng.randint(10, 60), rng.randint(20, 250)
            else:
                prompt, reply = rng.randint(50, 300), rng.randint(300, 900)
            row = {"messages": [{"role": "user", "content": _text(rng, prompt)},
                                {"role": "assistant", "content": _text(rng, reply)}]}
            handle.write(json.dumps(row) + "\n")
    return path
