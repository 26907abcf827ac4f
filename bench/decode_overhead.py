"""Time a decoding step of a LoRA model through peft's own forward and through lora-lab's fast
LoRA path (models/fast_lora), on a model of tiny width and a real model's depth: what each path
costs a step beyond the arithmetic, which is what a GRPO step's sampling pays on a GPU (one
token per sequence a step, many steps).

    python bench/decode_overhead.py [--device cuda] [--layers 28] [--out bench/results/FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(fast: bool, layers: int, device: str, dtype: torch.dtype):
    """A Qwen2 of `layers` layers, hidden 64, LoRA r 8 on every linear layer, checkpointing set
    up as a training run has it (paused while sampling, as the GRPO trainer does)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lora_lab.config import LoraArgs
    from lora_lab.models.fast_lora import FastLoraOptions
    from lora_lab.models.lora import LoraOptions, apply_lora

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    options = LoraOptions(gradient_checkpointing=True, fast=FastLoraOptions() if fast else None)
    return apply_lora(model, LoraArgs(rank=8, alpha=16, dropout=0.0), options)


def ms_per_token(model, sequences: int, tokens: int, device: str) -> float:
    from lora_lab.models.memory_means import checkpointing_paused

    ids = torch.randint(0, 512, (sequences, 20), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), checkpointing_paused(model):
        model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)  # warm
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / tokens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lora_lab.paths import installed_versions

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu":
        torch.set_num_threads(1)  # the Python side is what is timed
    times: dict[str, list] = {"peft": [], "fast": []}
    for _ in range(args.repeats):  # the two paths in turn
        for path in times:
            model = build(path == "fast", args.layers, args.device, dtype)
            model.train()
            times[path].append(round(ms_per_token(model, args.sequences, args.tokens, args.device), 2))
    row = {
        "what": "ms a decoding step, LoRA r 8 on every linear layer, through peft's forward and the fast path",
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({platform.processor() or 'x86_64'}, 1 thread)",
        "versions": installed_versions(("torch", "transformers", "peft")),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/decode_overhead.py " + " ".join(sys.argv[1:]),
        "layers": args.layers,
        "sequences": args.sequences,
        "tokens": args.tokens,
        "ms_per_token": times,
        "median_ms_per_token": {path: statistics.median(t) for path, t in times.items()},
    }
    print(json.dumps(row, indent=1))
    if args.out:
        args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
