"""Per optimizer step, where the GPU time of a profiled step goes, from bench/profile_step.py's
kernel traces: matrix products, attention, Triton kernels, torch's own elementwise kernels,
copies, how long the compute stream sat idle, and (for traces with the Trainer's host phases)
which phase the host was in while the compute stream waited.

  python bench/trace_gaps.py bench/results/profiles/trace-ll-7b-4096.json.gz [TRACE ...]
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import Counter, defaultdict

STEPS = 2  # optimizer steps profile_step.py records
KINDS = (
    ("attention", r"flash|fmha|sdpa"),
    ("matrix products", r"nvjet|gemm|cutlass|xmma|splitK"),
    ("copies", r"Memcpy|Memset"),
    ("torch elementwise", r"elementwise|reduce|cat|index|copy"),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.I)), "Triton and other")


def idle_by_phase(kernels: list, phases: list) -> dict:
    """Compute-stream idle time (us) by the innermost host phase running at each gap's middle."""
    idle = defaultdict(float)
    for (_, _, start, duration), following in zip(kernels, kernels[1:]):
        gap = following[2] - (start + duration)
        if gap <= 0:
            continue
        middle = start + duration + gap / 2
        around = [p for p in phases if p[2] <= middle <= p[2] + p[3]]
        idle[max(around, key=lambda p: p[2])[0] if around else "(no phase)"] += gap
    return idle


def summarise(path: str) -> str:
    rows = json.load(gzip.open(path, "rt"))  # (name, stream, start us, duration us)
    phases = [r for r in rows if r[1] == "host"]
    rows = [r for r in rows if r[1] != "host"]
    busy = defaultdict(float)
    for name, _, _, duration in rows:
        busy[kind_of(name)] += duration
    # the compute stream: the one that ran the most kernels other than copies
    stream = Counter(r[1] for r in rows if "Memcpy" not in r[0]).most_common(1)[0][0]
    kernels = [r for r in rows if r[1] == stream]
    span = kernels[-1][2] + kernels[-1][3] - kernels[0][2]
    idle = span - sum(r[3] for r in kernels)
    lines = [path] + [
        f"  {kind:18s} {us / STEPS / 1e3:8.1f} ms a step" for kind, us in sorted(busy.items(), key=lambda kv: -kv[1])
    ]
    lines.append(f"  compute stream {stream} idle {idle / STEPS / 1e3:.1f} ms a step")
    if phases:
        host = defaultdict(float)
        for name, _, _, duration in phases:
            host[name] += duration
        lines.append("  host phase: wall ms a step / compute stream idle during it, ms a step")
        waits = idle_by_phase(kernels, phases)
        for name in sorted(set(host) | set(waits), key=lambda n: -waits.get(n, 0)):
            lines.append(
                f"    {name:36s} {host.get(name, 0) / STEPS / 1e3:8.1f} {waits.get(name, 0) / STEPS / 1e3:8.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(summarise(path) for path in sys.argv[1:]))
