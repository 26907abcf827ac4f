"""Where a lora-lab training step spends its GPU time: torch.profiler over two optimizer steps.

  python bench/profile_step.py '{"label": "lora-lab-7b-4096-segments", "preset": "24gb",
      "size": "7b", "max_length": 4096, "steps": 6, "grad_accum": 4,
      "sets": ["data.packed_attention=segments"]}' --out DIR

Runs the cell as bench/cell.py does (kind lora-lab), profiles steps 4 and 5 (after two steps of
warm-up and one for the profiler's own) and writes DIR/profile-LABEL.txt: the GPU kernels by self
time, and how much of the steps' wall time the GPU was busy.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

import cell
import lora_lab.training.run as train_module

WAIT, WARMUP, ACTIVE = 2, 1, 2


class ProfilerSteps(TrainerCallback):
    """Advance the profiler's schedule at every optimizer step and time the recorded ones."""

    def __init__(self, profiler):
        self.profiler, self.step, self.active_seconds, self._start = profiler, 0, 0.0, None

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cell")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    spec = {"kind": "lora-lab", **json.loads(args.cell)}
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE))
    steps = ProfilerSteps(profiler)
    callbacks = train_module.run_callbacks
    train_module.run_callbacks = lambda run_dir: callbacks(run_dir) + [steps]
    with profiler:
        result = cell.run_lora_lab(spec)
    events = profiler.key_averages()
    busy_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    table = events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70)
    header = (f"{spec['label']}: {ACTIVE} optimizer steps profiled, {steps.active_seconds:.3f} s "
              f"wall, GPU kernels {busy_us / 1e6:.3f} s ({busy_us / 1e6 / steps.active_seconds:.0%}"
              f" busy); cell result: {json.dumps(result)}\n\n")
    out = Path(args.out) / f"profile-{spec['label']}.txt"
    out.write_text(header + table)
    print(header + table[:6000])


if __name__ == "__main__":
    main()
