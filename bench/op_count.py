"""The operators one training step of the fast LoRA path runs, counted on the CPU: a proxy for
the GPU's kernel launches, which bound the 7B step on short rows
(bench/results/2026-12-01-peer-NOTES.md).

    python bench/op_count.py [--chunk-tokens N] [--down-backward-tokens N] [--out FILE]

A 2-layer Qwen2 (tiny_untied of tests/unit/test_memory_means.py) in bf16 under CPU autocast, LoRA
rank 4 on every linear layer, dropout 0 (the fast path), layer checkpoints replayed in backward as
on one GPU; one forward and backward of 2 x 24 tokens under torch.profiler, the fast LoRA MLP in
chunks of N tokens where asked (model.fast_lora_chunk_tokens), the backward pass through down and
SwiGLU from saved gate and up in chunks of --down-backward-tokens (fast_lora.mlp's
model.fast_lora_down_backward_tokens, 2048 unless given: one chunk here). Prints (and appends to FILE) a
JSON row: the aten operators of the step by name, their total, and the git commit."""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# operators that launch work on a GPU (views, reshapes and empty allocations launch none)
NO_LAUNCH = (
    "aten::view",
    "aten::reshape",
    "aten::t",
    "aten::transpose",
    "aten::as_strided",
    "aten::empty",
    "aten::split",
    "aten::slice",
    "aten::expand",
    "aten::_reshape_alias",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::permute",
    "aten::detach",
    "aten::alias",
    "aten::select",
    "aten::narrow",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::_unsafe_view",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::contiguous",
)


SEQ = 24


def tiny_untied():
    """A 2-layer Qwen2 with its own output head (like 7B), fp32: the model whose ops are counted."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    config = Qwen2Config(**shape, **heads, tie_word_embeddings=False, initializer_range=0.3, use_cache=False)
    return Qwen2ForCausalLM(config)


def count(chunk_tokens: int = 0, down_backward_tokens: int | None = None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lora_lab.config import LoraArgs
    from lora_lab.models.fast_lora import FastLoraOptions
    from lora_lab.models.lora import LoraOptions, apply_lora
    from lora_lab.planning.memory import MemoryMeans

    fast = FastLoraOptions(chunk_tokens=chunk_tokens)
    if down_backward_tokens is not None:
        fast = FastLoraOptions(chunk_tokens=chunk_tokens, down_backward_tokens=down_backward_tokens)
    model = tiny_untied().to(torch.bfloat16)
    torch.manual_seed(1)
    means = MemoryMeans(embedding_on_cpu=False, offload_checkpoints=True, mlp_chunk_tokens=0)
    building = LoraOptions(gradient_checkpointing=True, means=means, fast=fast)
    model = apply_lora(model, LoraArgs(rank=4, alpha=8, dropout=0.0), building)
    model.train()
    ids = torch.randint(0, 512, (2, SEQ))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    top = collections.Counter()  # operators called from Python (not from inside another one)
    casts = 0  # aten::to copies only where the type changes: count its _to_copy
    for event in prof.events():
        parent = event.cpu_parent
        if event.name == "aten::_to_copy":
            casts += 1
        elif event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            top[event.name] += 1
    launching = {k: v for k, v in top.items() if k not in NO_LAUNCH and k != "aten::to"}
    launching["aten::_to_copy (casts)"] = casts
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "layers": 2,
        "command": "python bench/op_count.py"
        + (f" --chunk-tokens {chunk_tokens}" if chunk_tokens else "")
        + (f" --down-backward-tokens {down_backward_tokens}" if down_backward_tokens is not None else ""),
        "chunk_tokens": chunk_tokens,
        "down_backward_tokens": fast.down_backward_tokens,
        "top_level_ops": sum(top.values()),
        "launching_ops": sum(launching.values()),
        "by_name": dict(sorted(launching.items(), key=lambda kv: -kv[1])),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--chunk-tokens", type=int, default=0, help="The fast LoRA MLP in chunks of this many tokens (of 48)."
    )
    parser.add_argument(
        "--down-backward-tokens",
        type=int,
        help="The saved MLP's backward through down and SwiGLU in chunks of this many tokens (of 48; 0: all).",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    row = count(args.chunk_tokens, args.down_backward_tokens)
    print(json.dumps(row))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
