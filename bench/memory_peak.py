"""What sets a cell's peak reserved GPU memory: the caching allocator's history, read back.

bench/cell.py records it when the cell asks ("memory_history": true) and adds `report()` to the
cell's result as "memory_peak": at each moment an allocation of 8 MiB or more made the
reserved memory grow to a new high (the last few of them), what was allocated then, what was
freed but still waited on another stream's work (record_stream: not yet reusable), and the
allocation that made the allocator map more memory, with its Python frames; and what was live
at the allocated peak (the tensors made since recording began, summed by the frames that made
them: "live_at_peak"). The gap between
the peak reserved and the peak allocated is either memory held for other streams or free cached
memory in pieces too small for that allocation (fragmentation); these figures say which.
"""

from __future__ import annotations

GIB = 2**30


def _gib(value: int) -> float:
    return round(value / GIB, 3)


def start(max_entries: int = 2_000_000) -> dict:
    """Begin recording; returns the allocator's figures at the start (the trace counts from
    there)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    return {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


def _frames(event, count: int = 4) -> list:
    frames = [
        f for f in event.get("frames", []) if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]
    ]
    return [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in frames[:count]]


def report(begin: dict, highs: int = 4) -> dict:
    """Stop recording and read the trace back (see the module docstring)."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    reserved, allocated, pending = begin["reserved"], begin["allocated"], 0
    peak_allocated, moments, grew = allocated, [], False
    for event in trace:
        action, size = event["action"], event["size"]
        if action in ("segment_alloc", "segment_map"):
            reserved += size
            grew = True
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "alloc":
            allocated += size
            peak_allocated = max(peak_allocated, allocated)
            if grew and size >= 8 * 2**20 and (not moments or reserved > moments[-1]["reserved"]):
                moments.append(
                    {
                        "reserved": reserved,
                        "allocated": allocated,
                        "pending_free": pending,
                        "size": size,
                        "stream": event.get("stream"),
                        "frames": _frames(event),
                    }
                )
            grew = False
        elif action == "free_requested":
            pending += size
        elif action == "free_completed":
            pending -= size
            allocated -= size
    return {
        "peak_reserved_gib": _gib(max([m["reserved"] for m in moments] or [reserved])),
        "live_at_peak": _live_at_peak(trace, begin["allocated"]),
        "peak_allocated_gib": _gib(peak_allocated),
        "trace_events": len(trace),
        "highs": [
            {
                **m,
                "reserved": _gib(m["reserved"]),
                "allocated": _gib(m["allocated"]),
                "pending_free": _gib(m["pending_free"]),
                "size_mib": round(m["size"] / 2**20, 1),
            }
            for m in moments[-highs:]
        ],
    }


def _live_at_peak(trace, allocated: int, top: int = 12) -> list:
    """The blocks live at the allocated peak, summed by the frames that allocated them (largest
    first; tensors allocated before recording began are not in the trace)."""

    def replay(stop=None):
        live, now, peak, peak_index = {}, allocated, allocated, -1
        for index, event in enumerate(trace[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                now += event["size"]
                if now > peak:
                    peak, peak_index = now, index
            elif event["action"] == "free_completed" and live.pop(event["addr"], None):
                now -= event["size"]
        return live, peak_index

    at_peak = replay(replay()[1] + 1)[0]
    sums = {}
    for event in at_peak.values():
        frames = event.get("frames", [])
        inner = f"{frames[0]['filename'].rsplit('/', 2)[-1]}:{frames[0]['line']}" if frames else ""
        key = f"[{inner}] " + (" < ".join(_frames(event, 3)) or "(no Python frame)")
        count, size = sums.get(key, (0, 0))
        sums[key] = (count + 1, size + event["size"])
    return [
        {"frames": key, "tensors": count, "mib": round(size / 2**20, 1)}
        for key, (count, size) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]
    ]
