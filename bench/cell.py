"""One benchmark measurement in a fresh process (so peak memory is this cell's alone).

  python bench/cell.py '{"kind": "lora-lab", "preset": "16gb", "size": "7b", "max_length": 2048,
                         "steps": 20, "grad_accum": 1, "cap_gib": 15.5}'
kind "lora-lab" runs lora_lab.train() on full-length synthetic samples with the preset;
kind "baseline" runs the plain Trainer+PEFT recipe (bench/baseline.py); kinds "unsloth" and
"unsloth-sft" the peer (bench/peer_unsloth.py). Prints one JSON line.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import traceback
from pathlib import Path

from workloads import (
    make_random_model,
    words_within,
    write_full_length_pairs,
    write_full_length_rows,
    write_prompt_rows,
    write_sft_mix_rows,
)

WORK = Path("/tmp/lora-lab-bench")


def cap_memory(cap_gib: float | None) -> None:
    """The cap lora-lab users set with LORA_LAB_GPU_MEMORY_GIB (lora_lab.device.cap_gpu_memory),
    here for the whole cell process, baseline included."""
    import os

    from lora_lab.device import MEMORY_CAP_ENV, cap_gpu_memory

    if cap_gib:
        os.environ[MEMORY_CAP_ENV] = str(cap_gib)
        cap_gpu_memory()


ABLATIONS = {
    "residual_skip": "model.fast_lora_residual_skip",  # false: recomputed MLPs run to their output
    "shared_input": "model.fast_lora_shared_input",  # false: q, k, v one call each
    "native_norms": "model.native_rms_norm",  # false: RMSNorm through liger's Triton kernel
    "down_backward_tokens": "model.fast_lora_down_backward_tokens",  # SwiGLU's backward N tokens at a time
    "cast_cache": "model.fast_lora_cast_cache",  # false: adapter weights cast at every call
}
"""A cell's ablation keys -> the settings they set (the config, not a patch of the modules)."""


def ablation_sets(cell: dict) -> list[str]:
    return [f"{key}={json.dumps(cell[name])}" for name, key in ABLATIONS.items() if name in cell]


def run_lora_lab(cell: dict) -> dict:
    from lora_lab import train
    from lora_lab.config import resolve_config
    from lora_lab.models.attention import cudnn_shapes_taken
    from lora_lab.planning.memory import micro_batch_rows, plan_memory, row_length
    from lora_lab.training.plan import Target, plan_run

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    data = WORK / f"data-{cell['label']}.jsonl"
    flags = {
        "model.name": str(model),
        "data.max_length": cell["max_length"],
        "data.datasets": [str(data)],
        "train.max_steps": cell["steps"],
        "train.output_dir": str(WORK / "runs"),
        "train.run_name": cell["label"],
        "train.save_steps": 10**6,
        "train.logging_steps": 1,
        # Measure the cell as asked: no up-front refusal, no retry at a smaller batch.
        "train.memory_check": False,
        "train.oom_retry": False,
    }
    if cell.get("grad_accum"):
        flags["train.grad_accum"] = cell["grad_accum"]
    task = cell.get("task", "sft")
    if task != "sft":
        flags["train.task"] = task
    config = resolve_config(cell["preset"], flags=flags, sets=cell.get("sets", []) + ablation_sets(cell))
    if config.data.packing and not cell.get("grad_accum"):
        # every sample full length: one packed row of pack_length tokens per optimizer step
        accum = max(1, row_length(config) // cell["max_length"])
        config = config.with_changes({"train.grad_accum": accum}, "bench cell (one full row a step)")
    rows = cell["steps"] * config.train.grad_accum * config.train.micro_batch_size
    if task == "sft":
        write_full_length_rows(data, rows, cell["max_length"], vocabulary=words_within(model))
    elif task == "grpo":
        write_prompt_rows(data, rows, cell["prompt_words"], vocabulary=words_within(model))
    else:
        write_full_length_pairs(data, rows, cell["max_length"])
    history = None
    if cell.get("memory_history"):  # what sets the peak reserved memory (bench/memory_peak.py)
        import memory_peak

        history = memory_peak.start()
    result = train(config)
    extra = {"memory_peak": memory_peak.report(history)} if history else {}
    summary = json.loads((result.run_dir / "run_summary.json").read_text())
    performance = summary["performance"]
    tokens = config.train.micro_batch_size * config.train.grad_accum * cell["max_length"]
    # grpo: planned with its longest prompt, as the run chose its memory means (data.max_length only
    # bounds the prompts)
    longest = (
        longest_prompt_tokens(model, data, config.data.system, config.data.enable_thinking) if task == "grpo" else None
    )
    plan = plan_memory(plan_run(config, Target.here(), for_run=False).planner_config, cell.get("cap_gib"), longest)
    if task == "grpo":  # a step trains micro-batch x accumulation completions
        from importlib import metadata

        extra["longest_prompt_tokens"] = longest
        extra["completions_per_s"] = (
            config.train.micro_batch_size * config.train.grad_accum / (performance["median_step_seconds"])
        )
        extra["trl"] = metadata.version("trl")  # run.py --lora-lab-site may give this cell its own
    return {
        **performance,
        **extra,
        "tokens_per_s": tokens / performance["median_step_seconds"],
        "tokens_per_micro_batch": row_length(config) * micro_batch_rows(config),
        "planned_gib": plan.total_gib,
        "planned_host_gib": plan.host_peak_gib,
        "cudnn_shapes": [list(shape) for shape in cudnn_shapes_taken()],  # what cuDNN's kernel attended
        "trainable_params": adapter_parameters(result.run_dir),
        "resolved": resolved(config, summary),
    }


def longest_prompt_tokens(model: Path, data: Path, system: str | None = None, enable_thinking="auto") -> int:
    """Tokens of the longest prompt of a grpo cell's data, read and encoded as the run does
    (lora-lab's data/prompts.py: the chat template and the assistant's opening)."""
    from transformers import AutoTokenizer

    from lora_lab.data.prompts import encode_prompts, prompt_sample

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = data.read_text().splitlines()
    samples = [prompt_sample(json.loads(row), f"{data}:{line}") for line, row in enumerate(rows, 1)]
    report = encode_prompts(tokenizer, samples, max_length=10**9, system=system, enable_thinking=enable_thinking)
    assert not report.problems, report.problems[0]
    return max(len(sample.prompt_ids) for sample in report.samples)


def adapter_parameters(run_dir: Path) -> int:
    """The parameters of the run's final adapter (what LoRA trained, to set beside the peer's)."""
    from safetensors import safe_open

    from lora_lab.run_folder.names import ADAPTER_FOLDER, ADAPTER_WEIGHTS

    count = 0
    with safe_open(str(Path(run_dir) / ADAPTER_FOLDER / ADAPTER_WEIGHTS), framework="pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is not iterable)
            shape = weights.get_slice(name).get_shape()
            count += math.prod(shape)
    return count


def resolved(config, summary: dict) -> dict:
    """The settings a cell trained with; the memory means as the run chose them."""
    from lora_lab.planning.memory import row_length
    from lora_lab.training.plan import Target, settle_kernels, settle_packed_attention

    return {
        "quantization": config.model.quantization,
        "kernels": settle_kernels(config.model.kernels, Target.here()),
        "dtype": config.model.dtype,
        "rank": config.lora.rank,
        "lora_dropout": config.lora.dropout,
        "micro_batch_size": config.train.micro_batch_size,
        "grad_accum": config.train.grad_accum,
        "max_length": config.data.max_length,
        "packing": config.data.packing,
        "pack_length": row_length(config),
        "gradient_checkpointing": config.train.gradient_checkpointing,
        "memory_means": summary["memory_means"],
        "packed_attention": settle_packed_attention(config.data.packed_attention, Target.here()),
        "cudnn_attention": config.model.cudnn_attention,
        "fast_lora_chunk_tokens": config.model.fast_lora_chunk_tokens,
        "down_backward_tokens": config.model.fast_lora_down_backward_tokens,
    }


def run_lora_lab_sft(cell: dict) -> dict:
    """One epoch of the realistic SFT mix with the preset (packing as the preset says)."""
    from lora_lab import train
    from lora_lab.config import resolve_config

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    data = write_sft_mix_rows(WORK / f"sft-mix-{cell['rows']}.jsonl", cell["rows"])
    flags = {
        "model.name": str(model),
        "data.datasets": [str(data)],
        "train.epochs": 1,
        "train.output_dir": str(WORK / "runs"),
        "train.run_name": cell["label"],
        "train.save_steps": 10**6,
        "train.logging_steps": 1,
        "train.memory_check": False,
        "train.oom_retry": False,
    }
    config = resolve_config(cell["preset"], flags=flags, sets=cell.get("sets", []))
    result = train(config)
    log = [json.loads(line) for line in (result.run_dir / "logs" / "train_log.jsonl").read_text().splitlines()]
    seconds = next(entry["train_runtime"] for entry in log if "train_runtime" in entry)
    summary = json.loads((result.run_dir / "run_summary.json").read_text())
    tokens = sum(len(s) for s in encoded_lengths(config))
    return {
        "train_seconds": seconds,
        "samples": result.train_samples,
        "tokens": tokens,
        "optimizer_steps": result.global_step,
        "tokens_per_s": tokens / seconds,
        "peak_reserved_gib": summary["performance"]["peak_reserved_gib"],
        "median_step_seconds": summary["performance"]["median_step_seconds"],
        "first_step_seconds": summary["performance"]["first_step_seconds"],
        "final_loss": result.train_loss,
        "resolved": resolved(config, summary),
    }


def encoded_lengths(config) -> list:
    from lora_lab.data import prepare_data
    from lora_lab.models.load import load_tokenizer

    data = prepare_data(config.data, load_tokenizer(config.model.name), config.train.seed)
    return [s.input_ids for s in data.train.samples]


def multi_gpu_config(cell: dict):
    """The RunConfig a multi-GPU cell trains with (model named by size, for the planner)."""
    from lora_lab.config import resolve_config

    return resolve_config(
        "24gb",
        flags={
            "model.name": f"qwen2.5-{cell['size']}",
            "data.datasets": ["x"],
            "data.max_length": cell["max_length"],
            "train.micro_batch_size": 1,
            "train.grad_accum": cell["grad_accum"],
            "train.gpus": cell["gpus"],
            "train.engine": cell["engine"],
            "train.tuner": cell["tuner"],
        },
        sets=["data.packing=false", *cell.get("sets", [])],
    )


def run_multi_gpu(cell: dict) -> dict:
    """`lora-lab run --gpus N --engine E` as a user runs it (accelerate launch), each process
    capped with LORA_LAB_GPU_MEMORY_GIB; per-GPU peaks, step time, losses and the planner."""
    import os
    import subprocess

    from lora_lab.planning.memory import plan_memory

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    data = write_full_length_rows(
        WORK / f"data-{cell['label']}.jsonl", cell["steps"] * cell["grad_accum"] * cell["gpus"], cell["max_length"]
    )
    flags = [
        "--preset",
        "24gb",
        "--model",
        model,
        "--data",
        data,
        "--max-length",
        cell["max_length"],
        "--max-steps",
        cell["steps"],
        "--micro-batch-size",
        1,
        "--grad-accum",
        cell["grad_accum"],
        "--gpus",
        cell["gpus"],
        "--engine",
        cell["engine"],
        "--tuner",
        cell["tuner"],
        "--no-memory-check",
        "--no-oom-retry",
        "--logging-steps",
        1,
        "--save-steps",
        100000,
        "--seed",
        1,
        "--output-dir",
        WORK / "multi",
        "--run-name",
        cell["label"],
        "--set",
        "data.packing=false",
        *[x for s in cell.get("sets", []) for x in ("--set", s)],
    ]
    root = str(Path(__file__).resolve().parents[1])
    # OMP_NUM_THREADS is left to the launcher (offload engines: the cores / GPUs)
    env = {
        **os.environ,
        "LORA_LAB_GPU_MEMORY_GIB": str(cell["cap_gib"]),
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "lora_lab", "run", *map(str, flags)], env=env, capture_output=True, text=True, cwd=WORK
    )
    run_dir = WORK / "multi" / cell["label"]
    if proc.returncode != 0:
        # the launcher's own traceback ends the output; the workers' exceptions come earlier
        output = (proc.stderr or "") + (proc.stdout or "")
        raised = [
            line
            for line in output.splitlines()
            if any(
                word in line
                for word in ("Error", "Exception", "Signal", "exitcode", "Killed", "core dumped", "error:")
            )
            and "elastic" not in line
        ]
        return {
            "error": f"exit {proc.returncode}: " + " | ".join(dict.fromkeys(raised))[-2500:],
            "output_tail": (proc.stderr or "")[-5000:],
            "stdout_tail": (proc.stdout or "")[-1500:],
        }
    summary = json.loads((run_dir / "run_summary.json").read_text())
    log = [json.loads(line) for line in (run_dir / "logs" / "train_log.jsonl").read_text().splitlines()]
    plan = plan_memory(multi_gpu_config(cell))
    performance = summary["performance"]
    tokens = cell["grad_accum"] * cell["gpus"] * cell["max_length"]
    saved = run_dir / ("model" if cell["tuner"] == "full" else "adapter")
    return {
        **performance,
        "tokens_per_s": tokens / performance["median_step_seconds"],
        "iterations_per_s": 1 / performance["median_step_seconds"],
        "losses": [e["loss"] for e in log if "loss" in e and "train_runtime" not in e],
        "planned_gib_per_gpu": plan.total_gib,
        "planned_cpu_gib": plan.cpu_total_gib,
        "saved_files": sorted(p.name for p in saved.iterdir()) if saved.is_dir() else None,
    }


def run_baseline_sft_cell(cell: dict) -> dict:
    from baseline import run_baseline_sft

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    data = write_sft_mix_rows(WORK / f"sft-mix-{cell['rows']}.jsonl", cell["rows"])
    return run_baseline_sft(str(model), str(data), output_dir=str(WORK / "baseline-sft"))


def run_baseline_cell(cell: dict) -> dict:
    from baseline import run_baseline

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    return run_baseline(
        str(model),
        cell["max_length"],
        grad_accum=cell.get("grad_accum", 4),
        steps=cell["steps"],
        qlora=cell.get("qlora", False),
        output_dir=str(WORK / "baseline"),
    )


def run_unsloth_cell(cell: dict) -> dict:
    """The peer: Unsloth on the same model folder and samples (bench/peer_unsloth.py)."""
    import peer_unsloth

    model = make_random_model(cell["size"], WORK / f"random-{cell['size']}")
    if cell["kind"] == "unsloth-sft":
        data = write_sft_mix_rows(WORK / f"sft-mix-{cell['rows']}.jsonl", cell["rows"])
        return peer_unsloth.run_sft(cell, str(model), data)
    if cell["kind"] == "unsloth-grpo":
        rows = cell["steps"] * cell["grad_accum"] * cell["batch"]
        data = write_prompt_rows(
            WORK / f"prompts-{cell['label']}.jsonl", rows, cell["prompt_words"], vocabulary=words_within(model)
        )
        return peer_unsloth.run_grpo(cell, str(model), data)
    rows = cell["steps"] * cell.get("grad_accum", 4) * cell.get("batch", 1)
    data = write_full_length_rows(WORK / f"data-{cell['label']}.jsonl", rows, cell["max_length"])
    return peer_unsloth.run_fixed(cell, str(model), data)


def main() -> None:
    cell = json.loads(sys.argv[1])
    threading.Thread(target=watch_anonymous_memory, daemon=True).start()
    if cell["kind"].startswith("unsloth"):
        import peer_unsloth

        peer_unsloth.import_unsloth()  # before transformers and peft, which it patches
    if cell["kind"] != "multi":  # the launched processes cap themselves
        cap_memory(cell.get("cap_gib"))
    runner = {
        "lora-lab": run_lora_lab,
        "baseline": run_baseline_cell,
        "lora-lab-sft": run_lora_lab_sft,
        "baseline-sft": run_baseline_sft_cell,
        "multi": run_multi_gpu,
        "unsloth": run_unsloth_cell,
        "unsloth-sft": run_unsloth_cell,
        "unsloth-grpo": run_unsloth_cell,
    }[cell["kind"]]
    try:
        outcome = {"error": None, **runner(cell)}
    except Exception as exc:
        outcome = failure(exc)
    print("CELL " + json.dumps({**cell, **outcome, **host_memory()}), flush=True)


PEAK_ANONYMOUS_KIB = [0]
"""The largest RssAnon the watcher saw (Linux's /proc/self/status), in KiB."""


def watch_anonymous_memory(every: float = 0.1) -> None:
    """Sample the process's anonymous resident memory (its own allocations; the resident set also
    counts pages of files it maps, such as a checkpoint's safetensors, which the system can drop)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return
    while True:
        for line in status.read_text().splitlines():
            if line.startswith("RssAnon:"):
                PEAK_ANONYMOUS_KIB[0] = max(PEAK_ANONYMOUS_KIB[0], int(line.split()[1]))
        time.sleep(every)


def host_memory() -> dict:
    """The cell process's host RAM: its peak resident set, the peak of its anonymous part (sampled
    every 0.1 s: the resident set without mapped files' pages), and the peak of PyTorch's pinned
    (page-locked) host memory, where checkpoints offloaded to the CPU live."""
    import resource

    import torch

    row = {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    if PEAK_ANONYMOUS_KIB[0]:
        row["peak_anon_gib"] = round(PEAK_ANONYMOUS_KIB[0] / 2**20, 3)
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        row["peak_pinned_gib"] = round(stats.get("allocated_bytes.peak", 0) / 2**30, 3)
    return row


def failure(exc: Exception) -> dict:
    """A failed cell's row: "OOM" (with the peak reached before it, the cap and length being in
    the cell) or the exception. lora-lab's own out-of-memory error says "out of GPU memory"."""
    import torch

    oom = isinstance(exc, torch.cuda.OutOfMemoryError) or any(
        words in str(exc) for words in ("out of memory", "out of GPU memory")
    )
    if not oom:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "trace": traceback.format_exc()[-1500:]}
    peaks = {}
    if torch.cuda.is_available():
        peaks = {
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 4),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 4),
        }
    return {"error": "OOM", "oom_message": str(exc)[:400], **peaks, "trace": ""}


if __name__ == "__main__":
    main()
