"""Run a benchmark plan on the GPU and store every cell in bench/results/.

  python bench/run.py PLAN [--out DIR] [--parallel N]      PLAN: see PLANS below

Each cell runs in its own process (bench/cell.py). The results file starts with a header line
(GPU, library versions, date, command) followed by one JSON line per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIERS = {"24gb": 23.5, "16gb": 15.5, "12gb": 11.5, "8gb": 7.5}
SIZES = ("0.5b", "1.5b", "3b", "7b")


def preset_settings(preset: str, size: str) -> tuple[int, int, bool]:
    """(max_length, tokens per pass, QLoRA?) that `preset` picks for Qwen2.5-`size` (0.5b ...)
    or a model lora-lab ships the config of (qwen3-8b ...)."""
    sys.path.insert(0, str(HERE.parent))
    from lora_lab.config import resolve_config
    from lora_lab.planning.memory import micro_batch_rows, row_length

    config = resolve_config(preset, flags={"data.datasets": ["x"], "model.name": model_name(size)})
    return (config.data.max_length, row_length(config) * micro_batch_rows(config), config.model.quantization == "nf4")


def model_name(size: str) -> str:
    return f"qwen2.5-{size}" if size in SIZES else size


# Issue 20: other families' shapes (random weights from their published config.json) under the
# tiers' caps, to check the planner outside Qwen2.5.
FAMILY_MODELS = (
    "qwen3-8b",
    "llama-3.1-8b",
    "gemma-3-4b",
    "phi-4-mini",
    "mistral-7b",
    "qwen3.5-0.8b",
    "qwen3.5-4b",
    "qwen3.5-9b",
    "smollm3-3b",
)


FAMILY_SETS = {"mistral-7b": ["data.system=You answer questions."]}
"""A system message of words within Mistral's vocabulary in place of the stand-in tokenizer's
default one ("... named SmolLM ...": "LM" is id 34,519)."""


def family_cells(models=FAMILY_MODELS, tiers=("24gb", "16gb", "12gb", "8gb")) -> list:
    cells = []
    for name in models:
        for tier in tiers:
            length, _, _ = preset_settings(tier, name)
            cells.append(
                {
                    "kind": "lora-lab",
                    "label": f"{tier}-{name}-{length}",
                    "preset": tier,
                    "size": name,
                    "max_length": length,
                    "steps": 4,
                    "cap_gib": TIERS[tier],
                    "sets": FAMILY_SETS.get(name, []),
                }
            )
    return cells


def tuner_cells(tiers=("24gb", "16gb")) -> list:
    """Issue 21: 7B with DoRA and with the preference tasks under the tiers' caps, the presets'
    own settings, to check the planner's DoRA terms and its counting of both sequences of a
    pair against the measured peak."""
    cells = []
    for tier in tiers:
        length, _, _ = preset_settings(tier, "7b")
        for name, extra in (
            ("dora", {"sets": ["train.tuner=dora"]}),
            ("dpo", {"task": "dpo"}),
            ("orpo", {"task": "orpo"}),
        ):
            cells.append(
                {
                    "kind": "lora-lab",
                    "label": f"{tier}-7b-{name}-{length}",
                    "preset": tier,
                    "size": "7b",
                    "max_length": length,
                    "steps": 4,
                    "cap_gib": TIERS[tier],
                    **extra,
                }
            )
    return cells


def preset_cells(sizes) -> list:
    """Every tier x size: lora-lab under the tier's cap (20 optimizer steps at the preset's
    max_length, every sample full length), and the plain recipe at the same length, uncapped."""
    cells = []
    for size in sizes:
        for tier, cap in TIERS.items():
            length, pass_tokens, qlora = preset_settings(tier, size)
            label = f"{tier}-{size}-{length}"
            # packed presets: one row of pack_length tokens (full-length samples) per step
            cells.append(
                {
                    "kind": "lora-lab",
                    "label": label,
                    "preset": tier,
                    "size": size,
                    "max_length": length,
                    "steps": 20,
                    "cap_gib": cap,
                }
            )
            baseline = {
                "kind": "baseline",
                "label": f"baseline-{size}-{pass_tokens}{'-qlora' if qlora else ''}",
                "size": size,
                "max_length": pass_tokens,
                "steps": 6,
                "grad_accum": 1,
                "qlora": qlora,
            }
            if baseline not in cells:  # tiers that pick the same settings share one baseline
                cells.append(baseline)
    return cells


def long_cells(settings, steps: int = 20) -> list:
    """7B under a tier's cap at a chosen length, 16-bit or nf4 (QLoRA): one sample per step."""
    return [
        {
            "kind": "lora-lab",
            "label": f"long-{tier}-7b-{length}{'-nf4' if nf4 else ''}",
            "preset": tier,
            "size": "7b",
            "max_length": length,
            "steps": steps,
            "grad_accum": 1,
            "cap_gib": TIERS[tier],
            "sets": [f"model.quantization={'nf4' if nf4 else 'none'}", "data.packing=false"],
        }
        for tier, length, nf4 in settings
    ]


def sft_cells(sizes, rows: int) -> list:
    """One epoch of the realistic SFT mix (bench/workloads.write_sft_mix_rows): the popular
    recipe (micro-batch 1 x accumulation 16) against the 24gb preset, same samples (its packed
    rows attended with the block mask, sample by sample, and with flash varlen)."""
    return [
        {
            "kind": kind,
            "label": f"{kind}-{size}-{rows}{suffix}",
            "preset": "24gb",
            "size": size,
            "rows": rows,
            "sets": sets,
        }
        for size in sizes
        for kind, suffix, sets in (
            ("baseline-sft", "", []),
            ("lora-lab-sft", "", ["data.packed_attention=mask"]),
            ("lora-lab-sft", "-segments", ["data.packed_attention=segments"]),
            ("lora-lab-sft", "-varlen", ["data.packed_attention=varlen"]),
            # sdpa's cuDNN backend (off by default): a plan per new sequence length
            ("lora-lab-sft", "-cudnn", ["data.packed_attention=mask", "model.cudnn_attention=true"]),
        )
    ]


# (engine, gradient checkpointing, the reference claim on 4 x A100 40GB) for the 4- and 8-GPU plan
SCALING_RUNS = (
    ("deepspeed-zero2-offload", False, "ZeRO-2 + CPU optimizer offload: 38 GB, 2.1 it/s"),
    ("deepspeed-zero3", False, "ZeRO-3: 28 GB, 1.6 it/s"),
    ("deepspeed-zero2-offload", True, "ZeRO-2 + gradient checkpointing: 24 GB, 1.4 it/s"),
)


def scaling_cells() -> list:
    return [
        {
            "kind": "multi",
            "label": f"{engine[10:]}-{'ckpt' if ckpt else 'nockpt'}-7b-{gpus}gpu",
            "size": "7b",
            "engine": engine,
            "tuner": "full",
            "gpus": gpus,
            "steps": 4,
            "grad_accum": 4,
            "max_length": 2048,
            "cap_gib": 40,
            "sets": [f"train.gradient_checkpointing={str(ckpt).lower()}", "train.save_only_model=true"],
        }
        for gpus in (4, 8)
        for engine, ckpt, _ in SCALING_RUNS
    ]


# Issue 17: lora-lab against Unsloth (bench/peer_unsloth.py) on the same cells. lora-lab with
# its preset and no adapter dropout (Unsloth's setting; fast LoRA on), Unsloth with its own
# recommended settings; 7B at 4096 also with the preset as shipped (dropout 0.05) and each speed
# mean off, to show what each one does. Labels end in -1 / -2: every cell runs twice.
FAST = ["lora.dropout=0", "data.packed_attention=varlen"]
PEER_CELLS = {
    "7b-4096": ({"preset": "24gb", "max_length": 4096, "grad_accum": 4}, {"max_length": 4096, "grad_accum": 4}),
    "7b-1024": (
        {"preset": "24gb", "max_length": 1024, "grad_accum": 4},
        {"max_length": 1024, "grad_accum": 1, "batch": 4},
    ),
    "7b-2048-nf4": (
        {"preset": "16gb", "max_length": 2048, "grad_accum": 4},
        {"max_length": 2048, "grad_accum": 4, "qlora": True},
    ),
    "1.5b-4096": ({"preset": "24gb", "max_length": 4096, "grad_accum": 4}, {"max_length": 4096, "grad_accum": 4}),
    "0.5b-4096": ({"preset": "24gb", "max_length": 4096, "grad_accum": 4}, {"max_length": 4096, "grad_accum": 4}),
    # Qwen3.5 (hybrid linear attention), issue 48
    "qwen3.5-4b-4096": (
        {"size": "qwen3.5-4b", "preset": "24gb", "max_length": 4096, "grad_accum": 4},
        {"size": "qwen3.5-4b", "max_length": 4096, "grad_accum": 4},
    ),
    "qwen3.5-9b-2048-nf4": (
        {"size": "qwen3.5-9b", "preset": "16gb", "max_length": 2048, "grad_accum": 4},
        {"size": "qwen3.5-9b", "max_length": 2048, "grad_accum": 4, "qlora": True},
    ),
}
ABLATIONS_7B_4096 = {  # label suffix: sets on top of the preset
    "preset": ["data.packed_attention=varlen"],  # as shipped: dropout 0.05, peft's path
    "d0-plain": FAST + ["model.fast_lora=false", "train.offload_copy_stream=false"],
    "d0-fast-nostream": FAST + ["train.offload_copy_stream=false"],
    "nocudnn": FAST + ["model.cudnn_attention=false"],
    "chunk": FAST + ["model.fast_lora_chunk_tokens=2048"],
    "noexpand": FAST + ["train.expandable_segments=false"],
}


def peer_cells(steps: int = 6) -> list:
    cells = []
    for run in (1, 2):
        for name, (ours, theirs) in PEER_CELLS.items():
            size = name.split("-")[0]
            cells.append(
                {"kind": "lora-lab", "label": f"ll-{name}-{run}", "size": size, "steps": steps, "sets": FAST, **ours}
            )
            cells.append({"kind": "unsloth", "label": f"us-{name}-{run}", "size": size, "steps": steps, **theirs})
            if name.startswith("qwen3.5"):  # the plain recipe (transformers' own Qwen3.5 layers)
                cells.append({"kind": "baseline", "label": f"bl-{name}-{run}", "steps": steps, **theirs})
            if name in ("0.5b-4096", "1.5b-4096"):  # rows of 4096 tokens, as Unsloth's batches
                for suffix, more in (("", []), ("-chunk", ["model.fast_lora_chunk_tokens=2048"])):
                    cells.append(
                        {
                            "kind": "lora-lab",
                            "label": f"ll-{name}-rows4096{suffix}-{run}",
                            "size": size,
                            "steps": steps,
                            "sets": FAST + ["data.pack_length=4096"] + more,
                            **ours,
                        }
                    )
            if name in ("7b-4096", "0.5b-4096", "1.5b-4096"):
                # the backward pass through down and SwiGLU over all tokens at once (wholeback)
                # or N at a time (backN) instead of model.fast_lora_down_backward_tokens
                for suffix, tokens in (("wholeback", 0), ("back2048", 2048), ("back4096", 4096)):
                    cells.append(
                        {
                            "kind": "lora-lab",
                            "label": f"ll-{name}-{suffix}-{run}",
                            "size": size,
                            "steps": steps,
                            "sets": FAST,
                            "down_backward_tokens": tokens,
                            **ours,
                        }
                    )
            if name in ("7b-1024", "7b-2048-nf4", "0.5b-4096", "1.5b-4096"):
                # the MLP in chunks of 2048 tokens (of 1024: -chunk1024, of 4096: -chunk4096)
                for suffix, tokens in (("chunk", 2048), ("chunk1024", 1024), ("chunk4096", 4096)):
                    cells.append(
                        {
                            "kind": "lora-lab",
                            "label": f"ll-{name}-{suffix}-{run}",
                            "size": size,
                            "steps": steps,
                            **ours,
                            "sets": FAST + [f"model.fast_lora_chunk_tokens={tokens}"],
                        }
                    )
            if name in ("7b-1024", "7b-4096"):
                # the last N layers not recomputed (their activations kept: more memory)
                for layers in (8, 14):
                    cells.append(
                        {
                            "kind": "lora-lab",
                            "label": f"ll-{name}-keep{layers}-{run}",
                            "size": size,
                            "steps": steps,
                            **ours,
                            "sets": FAST + [f"train.uncheckpointed_layers={layers}"],
                        }
                    )
            if name == "7b-1024":  # the embedding on the GPU, as Unsloth keeps it
                cells.append(
                    {
                        "kind": "lora-lab",
                        "label": f"ll-{name}-gpuemb-{run}",
                        "size": size,
                        "steps": steps,
                        "sets": FAST + ["model.embedding_on_cpu=false"],
                        **ours,
                    }
                )
                # the recomputed MLP run to its output (fast_lora.RESIDUAL_MLP_LAYERS empty)
                cells.append(
                    {
                        "kind": "lora-lab",
                        "label": f"ll-{name}-noskip-{run}",
                        "size": size,
                        "steps": steps,
                        "sets": FAST,
                        "residual_skip": False,
                        **ours,
                    }
                )
                # RMSNorm through liger's Triton kernel; the adapter weights cast at every call
                for suffix, flag in (("ligernorm", "native_norms"), ("nocache", "cast_cache")):
                    cells.append(
                        {
                            "kind": "lora-lab",
                            "label": f"ll-{name}-{suffix}-{run}",
                            "size": size,
                            "steps": steps,
                            "sets": FAST,
                            flag: False,
                            **ours,
                        }
                    )
                # the layer checkpoints kept on the GPU (no copies to and from the host)
                cells.append(
                    {
                        "kind": "lora-lab",
                        "label": f"ll-{name}-nooffload-{run}",
                        "size": size,
                        "steps": steps,
                        "sets": FAST + ["train.offload_checkpoints=false"],
                        **ours,
                    }
                )
            if name in ("7b-1024", "7b-4096", "7b-2048-nf4"):
                # q, k and v as three calls (fast_lora.SHARED_INPUT_PROJECTIONS empty)
                cells.append(
                    {
                        "kind": "lora-lab",
                        "label": f"ll-{name}-noshare-{run}",
                        "size": size,
                        "steps": steps,
                        "sets": FAST,
                        "shared_input": False,
                        **ours,
                    }
                )
        for suffix, sets in ABLATIONS_7B_4096.items():
            cells.append(
                {
                    "kind": "lora-lab",
                    "label": f"ll-7b-4096-{suffix}-{run}",
                    "size": "7b",
                    "steps": steps,
                    "sets": sets,
                    **PEER_CELLS["7b-4096"][0],
                }
            )
        # what sets the peak reserved memory (bench/memory_peak.py; the history slows the step)
        for name, cell, sets in (
            ("7b-4096", "7b-4096", FAST),
            ("7b-4096-nostream", "7b-4096", FAST + ["train.offload_copy_stream=false"]),
            ("7b-2048-nf4-chunk", "7b-2048-nf4", FAST + ["model.fast_lora_chunk_tokens=2048"]),
            ("1.5b-4096-chunk1024", "1.5b-4096", FAST + ["model.fast_lora_chunk_tokens=1024"]),
            ("0.5b-4096-chunk4096", "0.5b-4096", FAST + ["model.fast_lora_chunk_tokens=4096"]),
            ("0.5b-4096", "0.5b-4096", FAST),
        ):
            cells.append(
                {
                    "kind": "lora-lab",
                    "label": f"ll-{name}-history-{run}",
                    "size": cell.split("-")[0],
                    "steps": 4,
                    "sets": sets,
                    "memory_history": True,
                    **PEER_CELLS[cell][0],
                }
            )
        for size in ("7b", "1.5b", "0.5b"):
            cells.append(
                {
                    "kind": "lora-lab-sft",
                    "label": f"ll-sft-{size}-{run}",
                    "preset": "24gb",
                    "size": size,
                    "rows": 256,
                    "sets": FAST,
                }
            )
            cells.append({"kind": "unsloth-sft", "label": f"us-sft-{size}-{run}", "size": size, "rows": 256})
    # the long-sequence leads (memory under a tier's cap; lora-lab only)
    cells += [
        {**c, "label": c["label"] + "-fast", "sets": c["sets"] + ["lora.dropout=0"]}
        for c in long_cells((("16gb", 65536, True), ("24gb", 32768, False)), steps=2)
    ]
    return cells


def long_context_cells() -> list:
    """The long-context comparison in one call, each cell under its tier's cap, 2 optimizer steps
    of one full-length sample: Unsloth at 49,152 tokens (nf4, 16gb cap) and 32,768 (bf16, 24gb
    cap), lora-lab's presets at 98,304 and 65,536 under the same caps. The Unsloth cells go first
    (rows are written as each cell ends); a cell that runs out of memory is stored as a row saying
    so (error "OOM", its cap, its length and the peak it reached)."""
    unsloth = [
        {
            "kind": "unsloth",
            "label": f"us-long-{tier}-7b-{length}{'-nf4' if nf4 else ''}",
            "size": "7b",
            "max_length": length,
            "steps": 2,
            "grad_accum": 1,
            "qlora": nf4,
            "cap_gib": TIERS[tier],
        }
        for tier, length, nf4 in (("16gb", 49152, True), ("24gb", 32768, False))
    ]
    return unsloth + long_cells((("24gb", 65536, False), ("16gb", 98304, True)), steps=2)


# Issue 51: Unsloth's context table (Llama-3.1-8B, QLoRA, rank 32, micro-batch 1, LoRA on every
# linear layer): its published longest lengths per card, lora-lab's targets, the caps.
CONTEXT_TABLE = {  # tier: (cap GiB or None for the whole GPU, Unsloth's published length, target)
    "8gb": (TIERS["8gb"], 2972, 11888),
    "12gb": (TIERS["12gb"], 21848, 65544),
    "16gb": (TIERS["16gb"], 40724, 131072),
    "24gb": (TIERS["24gb"], 78475, 131072),  # 235,425 asks for RoPE scaling past the native 128k
    "80gb": (None, 342733, 514100),
}
CONTEXT_SETS = ["model.quantization=nf4", "lora.rank=32", "lora.alpha=32", "data.packing=false"]


def context_table_cells(tiers=("16gb", "24gb", "12gb", "8gb")) -> list:
    """The context table as ladders (bench/run.py runs a ladder's rungs in order and skips the
    rest once one fails): per tier, Unsloth at its published length and at twice it, lora-lab at
    twice Unsloth's published length and at the tier's target; 2 optimizer steps of one
    full-length sample each, under the tier's cap. Llama-3.1-8B with random weights."""
    cells = []
    for tier in tiers:
        cap, published, target = CONTEXT_TABLE[tier]
        preset = tier if tier in TIERS else "24gb"
        for kind, rungs in (("unsloth", (published, 2 * published)), ("lora-lab", (2 * published, target))):
            for length in sorted(set(rungs)):
                cell = {
                    "kind": kind,
                    "label": f"{'us' if kind == 'unsloth' else 'll'}-ctx-{tier}-{length}",
                    "ladder": f"{kind}-{tier}",
                    "size": "llama-3.1-8b",
                    "max_length": length,
                    "steps": 2,
                    "grad_accum": 1,
                    "cap_gib": cap,
                }
                if kind == "unsloth":
                    cell.update(qlora=True, rank=32, alpha=32)
                else:
                    cell.update(preset=preset, sets=CONTEXT_SETS)
                cells.append(cell)
    # the long-row attention kernel (models/attention.long_row): cuDNN against flash, uncapped
    for kernel, cudnn in (("cudnn", "true"), ("flash", "auto")):
        cells.append(
            {
                "kind": "lora-lab",
                "label": f"ll-ctx-attn-{kernel}-65536",
                "size": "llama-3.1-8b",
                "max_length": 65536,
                "steps": 2,
                "grad_accum": 1,
                "preset": "16gb",
                "sets": [*CONTEXT_SETS, f"model.cudnn_attention={cudnn}"],
            }
        )
    # what the per-token working memory is made of (bench/memory_peak.py), at half the target
    cells.append(
        {
            "kind": "lora-lab",
            "label": "ll-ctx-memory-65536",
            "size": "llama-3.1-8b",
            "max_length": 65536,
            "steps": 2,
            "grad_accum": 1,
            "preset": "16gb",
            "sets": CONTEXT_SETS,
            "memory_history": True,
        }
    )
    return cells


# Issue 49: mixture of experts against Unsloth, QLoRA (nf4), rank 8, alpha 32, one 2048-token
# sample a step, uncapped. The 16-bit random checkpoints of Qwen3-30B-A3B (61 GB) and gpt-oss-20b
# (42 GB) do not fit the GPU machine's disk beside each other, so each keeps its first layers
# (NAME@N); both toolkits train the same folder, and the planner plans that folder.
MOE_MODELS = (("qwen3-30b-a3b", 16), ("gpt-oss-20b", 8))
MOE_SETS = ["model.quantization=nf4", "lora.rank=8", "lora.alpha=32", "data.packing=false", "train.micro_batch_size=1"]


def moe_cells(steps: int = 6) -> list:
    cells = []
    for name, layers in MOE_MODELS:
        base = {"size": f"{name}@{layers}", "max_length": 2048, "steps": steps, "grad_accum": 1}
        tag = f"moe-{name}-{layers}L"
        cells += [
            {"kind": "lora-lab", "label": f"ll-{tag}", "preset": "24gb", "sets": MOE_SETS, **base},
            # liger's fused MoE, where the family has it: lora.experts adds its delta to the experts
            {"kind": "lora-lab", "label": f"ll-{tag}-experts", "preset": "24gb", **base}
            | {"sets": [*MOE_SETS, "lora.experts=true", "model.liger_experts=true"]},
            {"kind": "unsloth", "label": f"us-{tag}", "qlora": True, **base},
        ]
        # the experts through transformers' grouped products instead of liger's fused MoE (with
        # lora.experts the default, model.liger_experts auto: its LoRA in low rank on them)
        for suffix, more in (("-noliger", []), ("-experts-noliger", ["lora.experts=true"])):
            sets = [*MOE_SETS, *more, "model.liger_experts=false"]
            cells.append({"kind": "lora-lab", "label": f"ll-{tag}{suffix}", "preset": "24gb", "sets": sets, **base})
    return cells


# Issue 50: GRPO beside Unsloth's (TRL's GRPOTrainer on its model), each with the settings of
# lora-lab's preset for the model (completions a step, group size, completion length, QLoRA or
# not, rank), lora-lab's `length` reward on both sides, prompts of 64 words, under the tier's cap.
GRPO_MODELS = (("16gb", "7b"), ("8gb", "1.5b"))


def grpo_cells(steps: int = 4) -> list:
    sys.path.insert(0, str(HERE.parent))
    from lora_lab.config import resolve_config

    cells = []
    for tier, size in GRPO_MODELS:
        flags = {
            "model.name": model_name(size),
            "data.datasets": ["x"],
            "train.task": "grpo",
            "grpo.rewards": ["length"],
        }
        config = resolve_config(tier, flags=flags)
        base = {"size": size, "steps": steps, "cap_gib": TIERS[tier], "prompt_words": 64}
        base |= {"max_length": config.data.max_length, "grad_accum": config.train.grad_accum}
        cells += [
            {"kind": "lora-lab", "label": f"ll-grpo-{tier}-{size}", "preset": tier, "task": "grpo", **base}
            | {"sets": ['grpo.rewards=["length"]']},
            {"kind": "lora-lab", "label": f"ll-grpo-{tier}-{size}-static", "preset": tier, "task": "grpo", **base}
            | {"sets": ['grpo.rewards=["length"]', "grpo.static_cache=true"]},
            {"kind": "lora-lab", "label": f"ll-grpo-{tier}-{size}-static-gpuemb", "preset": tier, "task": "grpo"}
            | base
            | {"sets": ['grpo.rewards=["length"]', "grpo.static_cache=true", "model.embedding_on_cpu=false"]},
            {
                "kind": "unsloth-grpo",
                "label": f"us-grpo-{tier}-{size}",
                "batch": config.train.micro_batch_size,
                "num_generations": config.grpo.num_generations,
                "max_completion_length": config.grpo.max_completion_length,
                "qlora": config.model.quantization == "nf4",
                "rank": config.lora.rank,
                "alpha": int(config.lora.alpha),
                **base,
            },
        ]
    return cells


PLANS = {
    "moe": moe_cells,
    "grpo": grpo_cells,
    "peer": peer_cells,
    "long-context": long_context_cells,
    "context-table": context_table_cells,
    "families": family_cells,
    "tuners": tuner_cells,
    "smoke": lambda: [
        {
            "kind": "lora-lab",
            "label": "smoke-ll",
            "preset": "24gb",
            "size": "0.5b",
            "max_length": 512,
            "steps": 4,
            "grad_accum": 2,
        },
        {
            "kind": "lora-lab",
            "label": "smoke-q",
            "preset": "16gb",
            "size": "0.5b",
            "max_length": 512,
            "steps": 4,
            "grad_accum": 2,
            "sets": ["model.quantization=nf4"],
        },
        {"kind": "baseline", "label": "smoke-base", "size": "0.5b", "max_length": 512, "steps": 4, "grad_accum": 2},
    ],
    # Speed: the plain recipe against lora-lab's 24gb preset (its packed rows attended with
    # the block mask, and sample by sample), 4 samples per optimizer step; at 4096 tokens also
    # without recomputation (gradient checkpointing off: what a card with the memory can do).
    "speed": lambda: [
        {
            "kind": kind,
            "label": f"{kind}-7b-{length}{suffix}",
            "preset": "24gb",
            "size": "7b",
            "max_length": length,
            "steps": 8,
            "grad_accum": 4,
            "sets": sets,
        }
        for length in (1024, 4096)
        for kind, suffix, sets in (
            ("baseline", "", []),
            ("lora-lab", "", ["data.packed_attention=mask"]),
            ("lora-lab", "-segments", ["data.packed_attention=segments"]),
            ("lora-lab", "-varlen", ["data.packed_attention=varlen"]),
            ("lora-lab", "-varlen-nockpt", ["data.packed_attention=varlen", "train.gradient_checkpointing=false"]),
        )
        if length == 4096 or not suffix.endswith("nockpt")
    ],
    "presets-small": lambda: preset_cells(("0.5b", "1.5b", "3b")),
    # The longest 7B sequence each tier's targets ask for, under the tier's cap, and beyond.
    "long-7b": lambda: long_cells(
        (
            ("24gb", 16384, False),
            ("16gb", 32768, True),
            ("16gb", 2048, False),
            ("12gb", 16384, True),
            ("8gb", 4096, True),
        ),
        steps=4,
    ),
    "longer-7b": lambda: long_cells(
        (
            ("24gb", 32768, False),
            ("16gb", 49152, True),
            ("16gb", 4096, False),
            ("12gb", 24576, True),
            ("8gb", 8192, True),
        ),
        steps=3,
    ),
    # Several GPUs: two GPUs capped to 40 GiB each (like A100 40GB); reference settings: micro-batch 1,
    # gradient accumulation 4, 2048 tokens, bf16, checkpointing.
    "multi-gpu": lambda: [
        {
            "kind": "multi",
            "label": label,
            "size": size,
            "engine": engine,
            "tuner": tuner,
            "gpus": gpus,
            "steps": steps,
            "grad_accum": accum,
            "max_length": 2048,
            "cap_gib": 40,
            "sets": sets,
        }
        for label, size, engine, tuner, gpus, steps, accum, sets in (
            ("loss-1gpu-0.5b", "0.5b", "ddp", "lora", 1, 8, 4, ["lora.dropout=0"]),
            ("loss-2gpu-0.5b", "0.5b", "ddp", "lora", 2, 8, 2, ["lora.dropout=0"]),
            ("zero2-lora-7b", "7b", "deepspeed-zero2", "lora", 2, 4, 4, []),
            ("zero3-full-1.5b", "1.5b", "deepspeed-zero3", "full", 2, 4, 4, []),
            # weights-only checkpoints: with its optimizer state the last checkpoint alone is
            # ~107 GB, more than the GPU machine's disk holds next to the model (disk check)
            (
                "zero3-offload-full-7b",
                "7b",
                "deepspeed-zero3-offload",
                "full",
                2,
                3,
                4,
                ["train.save_only_model=true"],
            ),
            ("fsdp-full-1.5b", "1.5b", "fsdp", "full", 2, 4, 4, []),
            # what sync_each_micro_batch (on for fsdp) saves: FSDP's whole gradients kept
            # between the micro-batches of a step
            ("fsdp-full-1.5b-no-sync", "1.5b", "fsdp", "full", 2, 4, 4, ["train.sync_each_micro_batch=false"]),
            ("zero2-offload-full-1.5b", "1.5b", "deepspeed-zero2-offload", "full", 2, 4, 4, []),
            ("fsdp-lora-0.5b", "0.5b", "fsdp", "lora", 2, 4, 4, []),
        )
    ],
    # Scaling: 7B full fine-tuning at the reference settings on 4 and 8 GPUs (needs them)
    "scaling-7b": lambda: scaling_cells(),
    "sft-mix": lambda: sft_cells(("7b", "1.5b", "0.5b"), rows=256),
    "sft-mix-small": lambda: sft_cells(("1.5b", "0.5b"), rows=256),
    # Shorter lengths, after long-7b found the targets out of reach with the present means.
    "fit-7b": lambda: long_cells(
        (
            ("24gb", 8192, False),
            ("16gb", 16384, True),
            ("16gb", 8192, True),
            ("12gb", 8192, True),
            ("8gb", 3072, True),
            ("16gb", 1024, False),
            # 16-bit 7B on a 16 GB card at the row `lora-lab plan` says
            # fits (8192 tokens: 15.35 of 15.5 GiB planned)
            ("16gb", 8192, False),
        )
    ),
    "presets-7b": lambda: preset_cells(("7b",)),
    # train.uncheckpointed_layers=auto under a tier's cap: the layers it keeps, the peak, the
    # speed against the preset's cell (every layer recomputed)
    "auto-layers": lambda: [
        {
            "kind": "lora-lab",
            "label": f"auto-{tier}-{size}-{length}",
            "preset": tier,
            "size": size,
            "max_length": length,
            "steps": 8,
            "cap_gib": TIERS[tier],
            "sets": ["train.uncheckpointed_layers=auto"],
        }
        for tier, size, length in (
            ("24gb", "7b", 2048),
            ("24gb", "3b", 2048),
            ("24gb", "1.5b", 2048),
            ("16gb", "3b", 2048),
            ("12gb", "1.5b", 2048),
        )
    ],
}


def environment() -> dict:
    import importlib.metadata as metadata

    import torch

    versions = {}
    for name in (
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "bitsandbytes",
        "liger-kernel",
        "unsloth",
        "unsloth_zoo",
        "trl",
    ):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_gib": (
            torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
        ),
        "versions": versions,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_cell(cell: dict, timeout: int, concurrent: int, lora_lab_site: str | None = None) -> dict:
    """One cell in its own process; `lora_lab_site` goes first on a lora-lab cell's PYTHONPATH."""
    started = time.time()
    env = dict(os.environ)
    if lora_lab_site and cell["kind"].startswith("lora-lab"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(lora_lab_site).resolve()), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / "cell.py"), json.dumps(cell)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=HERE,
            env=env,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("CELL ")]
        row = (
            json.loads(lines[-1][5:]) if lines else {**cell, "error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
        )
    except subprocess.TimeoutExpired:
        row = {**cell, "error": f"timeout after {timeout}s"}
    # Cells sharing the GPU measure their own peak memory, but not a clean speed.
    row["concurrent_cells"] = concurrent
    row["wall_seconds"] = round(time.time() - started, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan", choices=sorted(PLANS))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--timeout", type=int, default=300, help="Seconds per cell.")
    parser.add_argument("--parallel", type=int, default=1, help="Cells at once (speed figures are only clean with 1).")
    parser.add_argument(
        "--cells",
        help="Comma-separated labels: run only these cells of the "
        "plan and append them (after their own header line) to the day's "
        "results file of the plan, so a plan can be run in parts.",
    )
    parser.add_argument(
        "--lora-lab-site",
        help="A folder put first on the lora-lab cells' PYTHONPATH: packages lora-lab needs in "
        "other versions than the peer folder's (TRL >= 1.16 for --task grpo, where Unsloth "
        "2026.10.9's folder has 1.15; pip install --no-deps --target DIR 'trl>=1.16,<2').",
    )
    args = parser.parse_args()
    command = (
        f"python bench/run.py {args.plan} --parallel {args.parallel}"
        + (f" --cells {args.cells}" if args.cells else "")
        + (f" --lora-lab-site {args.lora_lab_site}" if args.lora_lab_site else "")
    )
    header = {"header": True, "plan": args.plan, **environment(), "command": command}
    out = Path(args.out) / f"{header['date'][:10]}-{args.plan}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    cells = PLANS[args.plan]()
    if args.cells:
        wanted = args.cells.split(",")
        unknown = sorted(set(wanted) - {c["label"] for c in cells})
        if unknown:
            parser.error(f"--cells: {unknown} are not cells of {args.plan}")
        cells = [c for c in cells if c["label"] in wanted]
    with open(out, "a" if args.cells else "w") as handle:
        handle.write(json.dumps(header) + "\n")
    for size in sorted({c["size"] for c in cells}):  # build once, before cells run in parallel
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import cell, workloads; workloads.make_random_model('{size}', cell.WORK / 'random-{size}')",
            ],
            cwd=HERE,
            check=True,
        )
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for row in pool.map(
            lambda c: run_cell(c, args.timeout, args.parallel, args.lora_lab_site),
            [c for c in cells if "ladder" not in c],
        ):
            record(out, row)
    failed: set = set()
    for cell in (c for c in cells if "ladder" in c):  # in order; a rung after a failed one is skipped
        if cell["ladder"] in failed:
            record(out, {**cell, "error": "skipped: a shorter rung of its ladder failed", "wall_seconds": 0})
            continue
        row = run_cell(cell, args.timeout, 1, args.lora_lab_site)
        if row.get("error"):
            failed.add(cell["ladder"])
        record(out, row)
    print(f"wrote {out}")


def record(out: Path, row: dict) -> None:
    """Append a cell's row to the results file and print its line."""
    with open(out, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    shown = (
        f"{row.get('peak_reserved_gib', 0) or 0:6.2f} GiB {row.get('tokens_per_s', 0) or 0:9.0f} tok/s"
        + (f" · RSS {row['peak_rss_gib']:.1f} GiB" if row.get("peak_rss_gib") else "")
        if not row.get("error")
        else f"ERROR {row['error'][:150]}"
        + (f" at {row['peak_reserved_gib']:.2f} GiB reserved" if row.get("peak_reserved_gib") else "")
    )
    print(f"{row['label']:<28} {shown}  ({row['wall_seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
