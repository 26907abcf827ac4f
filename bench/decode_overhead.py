"""Time a decoding step of a LoRA model through peft's own forward and through lora-lab's fast
LoRA path (models/fast_lora), on a model of tiny width and a real model's depth: what each path
costs a step beyond the arithmetic, which is what a GRPO step's sampling pays on a GPU (one
token per sequence a step, many steps).

    python bench/decode_overhead.py [--device cuda] [--layers 28] [--out bench/results/FILE.json]

--size 7b (a model of bench/workloads.make_random_model, random weights of the published shape;
GPU) times that model instead, loaded as a run loads it (`--nf4`: QLoRA; the input embedding in
CPU memory unless `--gpu-embedding`), through the path `--paths` names, one process each:
peft, fast, or unsloth (Unsloth's model.generate on its own QLoRA model, the peer folder on
PYTHONPATH):

    python bench/decode_overhead.py --size 7b --nf4 --paths peft,fast,unsloth --out FILE.jsonl
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


def build_real(path: str, size: str, nf4: bool, gpu_embedding: bool):
    """bench/workloads' random `size` model loaded as a GRPO run of the 16gb preset loads it:
    liger's kernels, nf4 with --nf4, LoRA r 8 on every linear layer through the fast path (or
    peft's forward), the input embedding in CPU memory and checkpoints offloaded."""
    from cell import WORK
    from workloads import make_random_model

    from lora_lab.config import LoraArgs, ModelArgs
    from lora_lab.models.fast_lora import FastLoraOptions
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model
    from lora_lab.models.lora import LoraOptions, apply_lora, prepare_quantized_for_training
    from lora_lab.planning.memory import MemoryMeans

    folder = make_random_model(size, WORK / f"random-{size}")
    args = ModelArgs(name=str(folder), quantization="nf4" if nf4 else "none")
    model = load_base_model(
        args,
        choose_precision("bf16" if torch.cuda.is_available() else "fp32"),
        LoadOptions(kernels="liger" if torch.cuda.is_available() else "none", path=str(folder)),
    )
    if nf4:
        model = prepare_quantized_for_training(model)
    means = MemoryMeans(embedding_on_cpu=not gpu_embedding, offload_checkpoints=True, checkpoint_tokens=2560)
    options = LoraOptions(gradient_checkpointing=True, means=means, fast=FastLoraOptions() if path == "fast" else None)
    return apply_lora(model, LoraArgs(rank=8, alpha=16, dropout=0.0), options), folder


def build_unsloth(size: str, nf4: bool):
    from cell import WORK
    from peer_unsloth import import_unsloth, load
    from workloads import make_random_model

    fast = import_unsloth()
    folder = make_random_model(size, WORK / f"random-{size}")
    model, _ = load(fast, str(folder), 2048 + 512, nf4, rank=8, alpha=16)
    return model, folder


def real_row(args) -> dict:
    """One --paths entry on the --size model: ms a decoding step (sampling at temperature 1)."""
    path = args.paths
    if path == "unsloth":
        model, folder = build_unsloth(args.size, args.nf4)
    else:
        model, folder = build_real(path, args.size, args.nf4, args.gpu_embedding)
    model.train()
    times = [
        round(ms_per_token(model, args.sequences, args.tokens, "cuda", prompt=94, sample=True), 2) for _ in range(2)
    ]
    from lora_lab.paths import installed_versions

    return {
        "what": "ms a decoding step of 16 sequences after a 94-token prompt, sampled, LoRA r 8 on every linear layer",
        "path": path,
        "size": args.size,
        "nf4": args.nf4,
        "embedding": "gpu" if args.gpu_embedding or path == "unsloth" else "cpu",
        "device": torch.cuda.get_device_name(),
        "versions": installed_versions(("torch", "transformers", "peft", "bitsandbytes", "unsloth")),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/decode_overhead.py " + " ".join(sys.argv[1:]),
        "sequences": args.sequences,
        "tokens": args.tokens,
        "ms_per_token": times,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "model": str(folder),
    }


def ms_per_token(model, sequences: int, tokens: int, device: str, prompt: int = 20, sample: bool = False) -> float:
    from lora_lab.models.memory_means import checkpointing_paused

    ids = torch.randint(0, 512, (sequences, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    settings = {"do_sample": sample, "use_cache": True, "attention_mask": mask, "pad_token_id": 0}
    with torch.no_grad(), checkpointing_paused(model):
        model.generate(ids, max_new_tokens=4, **settings)  # warm
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **settings)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / tokens * 1000  # the prompt's pass counted as one step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--size", help="a bench/workloads model (7b ...): its real shape, one path a process")
    parser.add_argument("--nf4", action="store_true")
    parser.add_argument("--gpu-embedding", action="store_true")
    parser.add_argument("--paths", default="fast", help="with --size: peft, fast or unsloth")
    args = parser.parse_args()
    if args.size:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        if args.paths == "unsloth":
            from peer_unsloth import import_unsloth

            import_unsloth()  # before transformers and peft
        row = real_row(args)
        print(json.dumps(row))
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
        return
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
