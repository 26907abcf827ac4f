"""Where a training step spends its GPU time: torch.profiler over two optimizer steps.

  python bench/profile_step.py '{"kind": "lora-lab", "label": "ll-7b-4096", "preset": "24gb",
      "size": "7b", "max_length": 4096, "steps": 6, "grad_accum": 4,
      "sets": ["lora.dropout=0"]}' --out DIR
  python bench/profile_step.py '{"kind": "unsloth", "label": "us-7b-4096", "size": "7b",
      "max_length": 4096, "steps": 6, "grad_accum": 4}' --out DIR

  python bench/profile_step.py ll-7b-1024 --out DIR    (a label of CELLS)
  python bench/profile_step.py ll-7b-1024 --host --out DIR

--host: the host's Python instead (cProfile over the same two steps, no torch.profiler):
host-LABEL.txt, the functions by own time and by time inside them, with the steps' wall time;
the step whose GPU waits on the host (bench/results/2026-12-01-peer-NOTES.md) is paid there.

Runs the cell as bench/cell.py does (kind lora-lab or unsloth), profiles optimizer steps 4 and 5
(after two steps of warm-up and one for the profiler's own) and writes to DIR:
- profile-LABEL.txt: the GPU kernels by self time, the time by kind of kernel (matrix products,
  attention, Triton, copies, the rest) and how much of the steps' wall time the compute stream
  was busy;
- trace-LABEL.json.gz: the GPU kernels of the profiled steps (name, stream, start, duration),
  for bench/trace_gaps.py, and the Trainer's phases on the host (annotate_trainer: rows whose
  stream is "host"), so that trace_gaps.py can say which phase each idle stretch of the
  compute stream fell in.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

WAIT, WARMUP, ACTIVE = 2, 1, 2

from run import FAST, PEER_CELLS

# issue 17's cells (bench/run.py PEER_CELLS) by label: ll-NAME lora-lab's, us-NAME Unsloth's
CELLS = {
    label: {"kind": kind, "size": name.split("-")[0], "steps": 6, **settings}
    for name, (ours, theirs) in PEER_CELLS.items()
    for label, kind, settings in (
        (f"ll-{name}", "lora-lab", {"sets": FAST, **ours}),
        (f"us-{name}", "unsloth", theirs),
    )
}

KINDS = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|cublas|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("copy", re.compile(r"memcpy|memset", re.I)),
    ("triton", re.compile(r"^triton_|_kernel$|liger", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|cat|copy|index", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


class HostSteps(TrainerCallback):
    """cProfile on for the profiled optimizer steps only (as ProfilerSteps' active ones)."""

    def __init__(self):
        import cProfile

        self.profile, self.step, self.active_seconds, self._start = (cProfile.Profile(), 0, 0.0, None)

    def on_step_begin(self, args, state, control, **kwargs):
        if WAIT + WARMUP <= self.step < WAIT + WARMUP + ACTIVE:
            torch.cuda.synchronize()
            self._start = time.perf_counter()
            self.profile.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            self.profile.disable()
            torch.cuda.synchronize()
            self.active_seconds += time.perf_counter() - self._start
            self._start = None
        self.step += 1

    def report(self, rows: int = 70) -> str:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text)
        stats.sort_stats("tottime").print_stats(rows)
        stats.sort_stats("cumulative").print_stats(rows)
        return text.getvalue()


class ProfilerSteps(TrainerCallback):
    """Advance the profiler's schedule at every optimizer step and time the recorded ones."""

    def __init__(self, profiler):
        self.profiler, self.step, self.active_seconds, self._start = profiler, 0, 0.0, None

    def on_train_begin(self, args, state, control, **kwargs):
        # now, not before: Unsloth reads the Trainer's source while it loads the model
        annotate_trainer()

    def on_step_begin(self, args, state, control, **kwargs):
        if WAIT + WARMUP <= self.step < WAIT + WARMUP + ACTIVE:
            torch.cuda.synchronize()
            self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            torch.cuda.synchronize()
            self.active_seconds += time.perf_counter() - self._start
            self._start = None
        self.step += 1
        self.profiler.step()


PHASE = "phase:"


def annotate_trainer() -> None:
    """Wrap the Trainer's phases in profiler ranges named phase:NAME (the same for lora-lab and
    Unsloth: both train with transformers' Trainer): batch fetch, forward and loss, backward,
    clipping, the callbacks and the log / save of each step."""
    import transformers
    from transformers.trainer_callback import CallbackHandler

    def wrap(owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(PHASE + name):
                return original(*args, **kwargs)

        setattr(owner, attribute, wrapped)

    trainer = transformers.Trainer
    for attribute, name in (
        ("get_batch_samples", "batch"),
        ("compute_loss", "forward"),
        ("_clip_grad_norm", "clip"),
        ("_prepare_inputs", "inputs"),
        ("_maybe_log_save_evaluate", "log-save"),
    ):
        wrap(trainer, attribute, name)
    for event in ("on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_substep_end"):
        wrap(CallbackHandler, event, event)
    import accelerate

    wrap(accelerate.Accelerator, "backward", "backward")


def gpu_kernels(profiler, scratch: Path) -> list:
    """(name, stream, start_us, duration_us) of every GPU kernel, copy and memset recorded, from
    the profiler's Chrome trace; the host ranges of annotate_trainer and the optimizer's step
    with stream "host"."""
    trace = scratch / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    rows = [
        (e["name"], e.get("args", {}).get("stream", e.get("tid")), float(e["ts"]), float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    rows += [
        (e["name"], "host", float(e["ts"]), float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and (e["name"].startswith(PHASE) or e["name"].startswith("Optimizer.step"))
    ]
    trace.unlink()
    return sorted(rows, key=lambda row: row[2])


def summary(rows: list, wall_seconds: float) -> str:
    by_kind, by_stream = defaultdict(float), defaultdict(float)
    for name, stream, _, duration in rows:
        if stream == "host":
            continue
        by_kind[kind_of(name)] += duration
        by_stream[stream] += duration
    lines = [f"wall {wall_seconds:.3f} s over {ACTIVE} optimizer steps"]
    for stream, busy in sorted(by_stream.items(), key=lambda kv: -kv[1]):
        lines.append(f"stream {stream}: busy {busy / 1e6:.3f} s ({busy / 1e6 / wall_seconds:.0%} of wall)")
    total = sum(by_kind.values())
    for kind, busy in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"{kind:12s} {busy / 1e6:8.3f} s  {busy / total:6.1%}")
    return "\n".join(lines)


def install_callback(kind: str, callback) -> None:
    """Add `callback` to the Trainer the cell builds."""
    if kind == "lora-lab":
        import lora_lab.training.builder as train_module

        callbacks = train_module.run_callbacks
        train_module.run_callbacks = lambda *args, **kw: callbacks(*args, **kw) + [callback]
        return
    import transformers

    original = transformers.Trainer.__init__

    def init(self, *args, **kwargs):
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [callback]
        original(self, *args, **kwargs)

    transformers.Trainer.__init__ = init


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cell")
    parser.add_argument("--out", default=".")
    parser.add_argument("--host", action="store_true", help="cProfile of the host instead")
    args = parser.parse_args()
    spec = (
        {"label": args.cell, **CELLS[args.cell]}
        if args.cell in CELLS
        else {"kind": "lora-lab", **json.loads(args.cell)}
    )
    if spec["kind"] == "unsloth":
        import peer_unsloth

        peer_unsloth.import_unsloth()
    import cell

    runner = cell.run_lora_lab if spec["kind"] == "lora-lab" else cell.run_unsloth_cell
    if args.host:
        host = HostSteps()
        install_callback(spec["kind"], host)
        result = runner(spec)
        text = (
            f"{spec['label']}: wall {host.active_seconds:.3f} s over {ACTIVE} optimizer "
            f"steps under cProfile\ncell result: {json.dumps(result)}\n\n{host.report()}"
        )
        (Path(args.out) / f"host-{spec['label']}.txt").write_text(text)
        print(text[:6000])
        return
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
    )
    steps = ProfilerSteps(profiler)
    install_callback(spec["kind"], steps)
    with profiler:
        result = runner(spec)
    events = profiler.key_averages()
    table = events.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90)
    rows = gpu_kernels(profiler, Path(args.out))
    header = f"{spec['label']}: {summary(rows, steps.active_seconds)}\ncell result: {json.dumps(result)}\n\n"
    out = Path(args.out)
    (out / f"profile-{spec['label']}.txt").write_text(header + table)
    with gzip.open(out / f"trace-{spec['label']}.json.gz", "wt") as handle:
        json.dump(rows, handle)
    print(header + table[:5000])


if __name__ == "__main__":
    main()
