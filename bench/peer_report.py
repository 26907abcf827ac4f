"""The Unsloth comparison: lora-lab / Unsloth ratios from the peer plan's results (never typed by hand).

  python bench/peer_report.py [RESULTS.jsonl ...]     default: bench/results/*-peer*.jsonl

A ratio is formed only from two cells of one results file (one device call, one machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows_of(path: Path) -> tuple[list, dict]:
    headers, cells = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        (headers.append(row) if row.get("header") else cells.__setitem__(row["label"], row))
    return headers, cells


def peer_name(label: str) -> str:
    """The peer plan's cell (bench/run.py PEER_CELLS) that a lora-lab cell ll-NAME[-VARIANT]-RUN
    runs: NAME, whatever setting VARIANT changes."""
    from run import PEER_CELLS

    rest = label[3:].rsplit("-", 1)[0]
    return max((name for name in PEER_CELLS if rest == name or rest.startswith(name + "-")), key=len, default=rest)


def twin(cells: dict, label: str) -> dict | None:
    """The Unsloth row measured beside the lora-lab cell `label` (ll-NAME[-VARIANT]-RUN):
    us-NAME-RUN, or the one us-NAME-* of the file where the runs were numbered apart. None for
    a cell that recorded the allocator's history (which slows its steps)."""
    if cells[label].get("memory_history"):
        return None
    name, run = peer_name(label), label.rsplit("-", 1)[1]
    same_run = cells.get(f"us-{name}-{run}")
    if same_run is not None:
        return same_run
    others = [row for other, row in cells.items() if other.startswith("us-") and other[3:].rsplit("-", 1)[0] == name]
    return others[0] if len(others) == 1 else None


def pairs(cells: dict) -> list:
    """(name, run, lora-lab row, Unsloth row) for every ll-NAME-RUN with its Unsloth twin."""
    found = []
    for label, ours in cells.items():
        theirs = twin(cells, label) if label.startswith("ll-") else None
        if theirs is not None:
            name, run = label[3:].rsplit("-", 1)
            their_run = theirs["label"].rsplit("-", 1)[1]
            found.append((name, run if their_run == run else f"{run}, Unsloth's run {their_run}", ours, theirs))
    return found


ABLATION_FLAGS = ("residual_skip", "shared_input", "native_norms", "cast_cache", "memory_history")
"""bench/cell.py switches a cell sets beside its --set flags."""


def _settings(row: dict) -> str:
    flags = [f"{flag}={str(row[flag]).lower()}" for flag in ABLATION_FLAGS if flag in row]
    return ", ".join(list(row.get("sets", [])) + flags)


def _figures(row: dict) -> str:
    if row.get("error"):
        return f"error: {row['error'][:60]}"
    return f"{row['tokens_per_s']:,.0f} tok/s, {row['peak_reserved_gib']:.2f} GiB"


def render(paths, heading: str = "###") -> str:
    lines = []
    for path in paths:
        headers, cells = rows_of(path)
        lines += [f"{heading} {path.name}", ""]
        bullet = "- " if len(headers) > 1 else ""  # a run in parts: one line per part
        lines += [f"{bullet}{head.get('gpu')}, {head.get('date')}; `{head.get('command')}`" for head in headers]
        lines += ["", "| cell | lora-lab | Unsloth | speed ratio | peak ratio |", "| --- | --- | --- | --- | --- |"]
        for name, run, ours, theirs in pairs(cells):
            ok = not ours.get("error") and not theirs.get("error")
            speed = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}x" if ok else "-"
            peak = f"{ours['peak_reserved_gib'] / theirs['peak_reserved_gib']:.3f}" if ok else "-"
            lines.append(f"| {name} (run {run}) | {_figures(ours)} | {_figures(theirs)} | {speed} | {peak} |")
        alone = [row for label, row in cells.items() if label.startswith("ll-") and twin(cells, label) is None]
        if alone:
            lines += ["", "lora-lab cells without an Unsloth twin in this file:", ""]
            lines += [
                f"- {row['label']} ({_settings(row)}): {_figures(row)}, "
                f"median step {row.get('median_step_seconds', 0):.3f} s"
                for row in alone
            ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((HERE / "results").glob("*-peer*.jsonl"))
    print(render(paths))


if __name__ == "__main__":
    main()
