"""Quantized export on the GPU: size on disk, GPU memory to load, and quality on a real fine-tune.

  python bench/export_bench.py --out DIR [--real-run RUN_DIR] [--sizes 0.5b,1.5b,7b]
                               [--formats nf4,w4a16] [--parallel 4]

For each size, a random-weight Qwen2.5 of the real shape (bench/workloads.py; same bytes and
memory as the real one) is exported to each 4-bit format by lora_lab.use.export; then every folder,
the bf16 one included, is loaded in a fresh process (torch.cuda.max_memory_allocated / _reserved
after from_pretrained, and again after a 16-token greedy generation: transformers de-quantizes
w4a16 to 16 bits at the first forward, vLLM does not).

With --real-run RUN_DIR (a fine-tuned run folder; its merged/ is used when present, else it is
merged here, which needs the base model the run's config.yaml names), the real model is exported
too (w4a16 calibrated on the run's own training data) and each variant is compared with the bf16
merge: eval loss and perplexity on the assistant tokens of bench/export_heldout.jsonl (prompts not
in the training set; lora_lab.use.evaluate loss), and greedy answers to the self-cognition prompts.

Writes DIR/<date>-export.jsonl: a header line (GPU, library versions, date, command), then one
JSON line per measurement, each with "error" (null when it worked). Every step runs in its own
process. --sizes tiny runs every step on a tiny model on CPU (the tests use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
HELDOUT = HERE / "export_heldout.jsonl"
FORMATS = ("nf4", "w4a16", "awq")
SIZES = ("0.5b", "1.5b", "7b")
GIB = 2**30


# ----------------------------------------------------------------------------- steps (own process)


def build_model(size: str, out: Path) -> str:
    """A random-weight Qwen2.5-`size` folder (bf16, real tokenizer); tiny: 2 layers, hidden 128."""
    from workloads import make_random_model

    if size != "tiny":
        return str(make_random_model(size, out))
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        )
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.generation_config.eos_token_id = [151645, 151643]
        model.save_pretrained(out, safe_serialization=True)
        tokenizer_dir = ROOT / "lora_lab" / "qwen25_tokenizer"
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


def step_build(step: dict) -> dict:
    return {"folder": build_model(step["size"], Path(step["folder"]))}


def step_merge(step: dict) -> dict:
    from lora_lab import merge_adapter

    result = merge_adapter(step["run_dir"], output=step["folder"], dtype="bf16", force=True)
    return {"folder": str(result.output_dir), "top1_agreement": result.top1_agreement}


def step_export(step: dict) -> dict:
    from lora_lab import export_quantized

    result = export_quantized(
        step["source"],
        quantize=step["format"],
        calib_data=step.get("calib_data"),
        calib_samples=step["calib_samples"],
        output=step["folder"],
        force=True,
    )
    report = json.loads((Path(step["folder"]) / "export_report.json").read_text())
    return {
        "folder": step["folder"],
        "weights_bytes": result.weights_bytes,
        "weights_gib": round(result.weights_bytes / GIB, 3),
        "source_weights_bytes": result.source_weights_bytes,
        "folder_bytes": report["folder_bytes"],
        "export_seconds": result.seconds,
        "top1_agreement": result.top1_agreement,
        "calibration_samples": (result.calibration or {}).get("samples", 0),
        "calibration_tokens": (result.calibration or {}).get("tokens", 0),
        "warnings": result.warnings,
    }


def _memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"allocated_gib": None, "reserved_gib": None}
    torch.cuda.synchronize()
    return {
        "allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
    }


def _load(folder: str):
    import torch
    from transformers import AutoModelForCausalLM

    device_map = {"": 0} if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device_map).eval()


def _weight_dtype(module) -> str:
    """What a linear layer holds: its weight's dtype, or its packed weight's (compressed)."""
    for name in ("weight", "weight_packed"):
        tensor = getattr(module, name, None)
        if tensor is not None:
            return f"{name}:{str(tensor.dtype).replace('torch.', '')}"
    return "none"


def step_load(step: dict) -> dict:
    """Peak GPU memory of from_pretrained in this fresh process, then after a short generation."""
    import torch
    from transformers import AutoTokenizer

    from lora_lab.use.export import weights_bytes

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    model = _load(step["folder"])
    load_seconds = time.time() - started
    after_load = _memory()
    q_proj = model.model.layers[0].self_attn.q_proj
    layer_after_load = f"{type(q_proj).__name__} weight {_weight_dtype(q_proj)}"
    tokenizer = AutoTokenizer.from_pretrained(step["folder"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}], tokenize=False, add_generation_prompt=True
    )
    batch = tokenizer(text, return_tensors="pt").to(model.device)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    after_generate = _memory()
    q_proj = model.model.layers[0].self_attn.q_proj
    return {
        "q_proj_after_load": layer_after_load,
        "q_proj_after_generate": f"{type(q_proj).__name__} weight {_weight_dtype(q_proj)}",
        "weights_bytes": weights_bytes(Path(step["folder"])),
        "weights_gib": round(weights_bytes(Path(step["folder"])) / GIB, 3),
        "load_seconds": round(load_seconds, 1),
        "peak_allocated_gib_after_load": after_load["allocated_gib"],
        "peak_reserved_gib_after_load": after_load["reserved_gib"],
        "peak_allocated_gib_after_generate": after_generate["allocated_gib"],
        "peak_reserved_gib_after_generate": after_generate["reserved_gib"],
        "memory_footprint_gib": round(model.get_memory_footprint() / GIB, 3),
    }


def step_quality(step: dict) -> dict:
    """Eval loss on held-out assistant tokens and greedy self-cognition answers, per variant."""
    import torch
    from transformers import AutoTokenizer

    from lora_lab.data import load_samples
    from lora_lab.data.encode import encode_samples
    from lora_lab.run_folder import load_saved_config
    from lora_lab.use.evaluate import assistant_token_loss
    from lora_lab.use.infer import GenerationSettings, generate_replies

    config = load_saved_config(Path(step["run_dir"]) / "config.yaml")
    args = dataclasses.replace(  # fills {{NAME}} and {{AUTHOR}} in the held-out rows
        config.data, model_name=config.data.model_name or "Aurora", model_author=config.data.model_author or "Lora Lab"
    )
    tokenizer = AutoTokenizer.from_pretrained(step["variants"]["bf16"])
    heldout = encode_samples(
        tokenizer, load_samples([step["eval_data"]], args, 42).samples, args.max_length, args.truncation, args.system
    ).samples
    prompts = [s.messages[:-1] for s in load_samples(["self-cognition"], args, 42).samples]
    prompts = prompts[: step.get("max_prompts") or len(prompts)]
    settings = GenerationSettings(max_new_tokens=48, do_sample=False)
    rows, reference = {}, None
    for name, folder in step["variants"].items():
        model = _load(folder)
        loss, tokens = assistant_token_loss(model, heldout)
        answers = generate_replies(
            model, tokenizer, prompts, settings, batch_size=40 if torch.cuda.is_available() else 8
        )
        reference = reference or answers  # bf16 comes first
        rows[name] = {
            "eval_loss": loss / tokens,
            "perplexity": math.exp(loss / tokens),
            "heldout_samples": len(heldout),
            "assistant_tokens": tokens,
            "prompts": len(prompts),
            "answers_identical_to_bf16": sum(a == b for a, b in zip(answers, reference)) / len(prompts),
            "answers_with_name": sum(args.model_name in a for a in answers) / len(prompts),
            "examples": [{"prompt": p[-1]["content"], "answer": a} for p, a in list(zip(prompts, answers))[:4]],
        }
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"variants": rows}


STEPS = {"build": step_build, "merge": step_merge, "export": step_export, "load": step_load, "quality": step_quality}


def run_step_here(step: dict) -> None:
    """--step JSON: run one step in this process and print `STEP {json}`."""
    try:
        outcome = {"error": None, **STEPS[step["kind"]](step)}
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
    print("STEP " + json.dumps(outcome), flush=True)


# ----------------------------------------------------------------------------- orchestration


def environment(command: str) -> dict:
    import torch

    from lora_lab.use.export import library_versions

    on_gpu = torch.cuda.is_available()
    return {
        "header": True,
        "plan": "export",
        "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
        "gpu_memory_gib": (round(torch.cuda.get_device_properties(0).total_memory / GIB, 2) if on_gpu else None),
        "cpu_count": os.cpu_count(),
        "versions": library_versions(),
        "note": "steps run in parallel (--parallel); peak memory is per process (fresh "
        "process per load), export seconds are under that concurrency",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
    }


class Bench:
    def __init__(self, args, out_file: Path):
        self.args, self.out_file, self.lock = args, out_file, threading.Lock()
        self.deadline = time.time() + args.budget
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)

    def step(self, step: dict) -> dict:
        """Run one step in a fresh process, within --timeout and what is left of --budget."""
        started = time.time()
        timeout = min(self.args.timeout, self.deadline - started)
        if timeout < 10:
            return {"error": f"skipped: --budget {self.args.budget}s used up", "step_seconds": 0}
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--step", json.dumps(step)],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("STEP ")]
            outcome = (
                json.loads(lines[-1][5:]) if lines else {"error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
            )
        except subprocess.TimeoutExpired:
            outcome = {"error": f"timeout after {timeout:.0f}s"}
        outcome["step_seconds"] = round(time.time() - started, 1)
        return outcome

    def record(self, row: dict) -> None:
        with self.lock, open(self.out_file, "a") as handle:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        shown = row.get("error") or ", ".join(
            f"{k} {row[k]}"
            for k in (
                "weights_gib",
                "peak_reserved_gib_after_load",
                "peak_reserved_gib_after_generate",
                "eval_loss",
                "answers_identical_to_bf16",
            )
            if row.get(k) is not None
        )
        print(
            f"{row['kind']:<8} {row['model']:<18} {row['format']:<6} {shown} ({row.get('step_seconds', '')} s)",
            flush=True,
        )

    def build(self, size: str) -> str | None:
        outcome = self.step({"kind": "build", "size": size, "folder": str(self.work / f"random-{size}")})
        if outcome["error"]:
            self.record(
                {"kind": "build", "model": f"qwen2.5-{size} (random)", "size": size, "format": "bf16", **outcome}
            )
            return None
        return outcome["folder"]

    def merge_real(self, run_dir: Path) -> str | None:
        """The real run's bf16 merge: its merged/ folder, else merged here."""
        if (run_dir / "merged" / "config.json").is_file():
            return str(run_dir / "merged")
        outcome = self.step({"kind": "merge", "run_dir": str(run_dir), "folder": str(self.work / "real-merged")})
        if outcome["error"]:
            self.record({"kind": "merge", "model": "real", "format": "bf16", **outcome})
            return None
        return outcome["folder"]

    def calib_file(self) -> Path:
        from workloads import write_sft_mix_rows

        path = self.work / "calib-sft-mix.jsonl"
        if not path.is_file():
            write_sft_mix_rows(path, 64)
        return path

    def export(self, model: str, size: str, fmt: str, source: str) -> str | None:
        """Random models calibrate on synthetic SFT rows; the real run on its training data."""
        real = model == "real"
        folder = str(self.work / f"{'real' if real else 'random-' + size}-{fmt}")
        step = {
            "kind": "export",
            "source": source,
            "format": fmt,
            "folder": folder,
            "calib_samples": self.args.real_calib_samples if real else self.args.calib_samples,
        }
        if not real and fmt in ("w4a16", "awq"):
            step["calib_data"] = [str(self.calib_file())]
        outcome = self.step(step)
        self.record({"kind": "export", "model": model, "size": size, "format": fmt, **outcome})
        return None if outcome["error"] else folder

    def quality(self, run_dir: Path, variants: dict) -> None:
        from lora_lab.use.export import weights_bytes

        outcome = self.step(
            {
                "kind": "quality",
                "run_dir": str(run_dir),
                "variants": variants,
                "eval_data": self.args.eval_data,
                "max_prompts": self.args.max_prompts,
            }
        )
        if outcome["error"]:
            self.record({"kind": "quality", "model": "real", "format": "all", **outcome})
            return
        for name, row in outcome["variants"].items():
            self.record(
                {
                    "kind": "quality",
                    "model": "real",
                    "format": name,
                    "run_dir": str(run_dir),
                    "weights_bytes": weights_bytes(Path(variants[name])),
                    "step_seconds": outcome["step_seconds"],
                    "error": None,
                    **row,
                }
            )

    def load(self, size: str, fmt: str, folder: str) -> None:
        outcome = self.step({"kind": "load", "folder": folder})
        in_memory = {
            "bf16": "bf16",
            "nf4": "nf4 (bitsandbytes Linear4bit)",
            "w4a16": "packed int4 after load; de-quantized to bf16 by transformers at "
            "the first forward (vLLM keeps int4)",
        }
        in_memory["awq"] = in_memory["w4a16"]
        in_memory = in_memory[fmt]
        self.record(
            {
                "kind": "load",
                "model": f"qwen2.5-{size} (random)",
                "size": size,
                "format": fmt,
                "in_memory": in_memory,
                **outcome,
            }
        )

    def run(self) -> None:
        """Three phases, each a pool of steps: build (and merge the real run), export, then
        load in fresh processes (and the real model's quality)."""
        run_dir = Path(self.args.real_run) if self.args.real_run else None
        self.calib_file()
        with ThreadPoolExecutor(max_workers=self.args.parallel) as pool:
            merging = pool.submit(self.merge_real, run_dir) if run_dir else None
            built = dict(zip(self.args.sizes, pool.map(self.build, self.args.sizes)))
            merged = merging.result() if merging else None
        jobs = [
            (f"qwen2.5-{size} (random)", size, fmt, source)
            for size, source in built.items()
            if source
            for fmt in self.args.formats
        ]
        if merged:
            jobs += [("real", "0.5b", fmt, merged) for fmt in self.args.formats]
        jobs.sort(key=lambda job: (-_size_rank(job[1]), job[2] != "w4a16"))  # longest first
        with ThreadPoolExecutor(max_workers=self.args.parallel) as pool:
            folders = list(pool.map(lambda job: self.export(*job), jobs))
        loads = [(size, "bf16", source) for size, source in built.items() if source]
        loads += [(job[1], job[2], folder) for job, folder in zip(jobs, folders) if folder and job[0] != "real"]
        variants = {"bf16": merged} if merged else {}
        variants.update({job[2]: folder for job, folder in zip(jobs, folders) if folder and job[0] == "real"})
        with ThreadPoolExecutor(max_workers=self.args.parallel) as pool:
            judging = pool.submit(self.quality, run_dir, variants) if variants else None
            list(pool.map(lambda item: self.load(*item), loads))
            if judging:
                judging.result()


def _size_rank(size: str) -> float:
    return float(size.rstrip("b")) if size != "tiny" else 0.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="Folder of the results file.")
    parser.add_argument("--real-run", help="A fine-tuned run folder of the real 0.5B model.")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help="Comma-separated: 0.5b, 1.5b, 3b, 7b, or tiny (CPU test)."
    )
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument(
        "--calib-samples",
        type=int,
        default=16,
        help="w4a16 calibration samples for the random models (only size and memory are measured on them).",
    )
    parser.add_argument(
        "--real-calib-samples",
        type=int,
        default=256,
        help="w4a16 calibration samples of the real run's training data.",
    )
    parser.add_argument(
        "--eval-data", default=str(HELDOUT), help="Held-out conversations for the real model's eval loss."
    )
    parser.add_argument("--max-prompts", type=int, default=0, help="Self-cognition prompts to answer (0: all 120).")
    parser.add_argument("--parallel", type=int, default=4, help="Steps at once.")
    parser.add_argument("--timeout", type=int, default=420, help="Seconds per step.")
    parser.add_argument(
        "--budget",
        type=int,
        default=540,
        help="Seconds for the whole run: steps that would start later are "
        "recorded as skipped, so that the file is complete in time.",
    )
    parser.add_argument(
        "--work", default="/tmp/lora-lab-bench/export", help="Where models and exports are written (7B: ~26 GB)."
    )
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; choose from {', '.join(FORMATS)}")
    return args


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    if args.step:
        run_step_here(json.loads(args.step))
        return None
    command = "python bench/export_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = {
        **environment(command),
        "sizes": args.sizes,
        "formats": args.formats,
        "parallel": args.parallel,
        "calib_samples": args.calib_samples,
        "real_run": args.real_run,
    }
    out_file = Path(args.out) / f"{header['date'][:10]}-export.jsonl"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(header) + "\n")
    started = time.time()
    Bench(args, out_file).run()
    print(f"wrote {out_file} in {time.time() - started:.0f} s")
    return out_file


if __name__ == "__main__":
    main()
