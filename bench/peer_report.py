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


def pairs(cells: dict) -> list:
    """(name, run, lora-lab row, Unsloth row) for every ll-NAME-RUN with its us-NAME-RUN."""
    found = []
    for label, ours in cells.items():
        if not label.startswith("ll-"):
            continue
        theirs = cells.get("us-" + label[3:])
        if theirs is not None:
            name, run = label[3:].rsplit("-", 1)
            found.append((name, run, ours, theirs))
    return found


def _figures(row: dict) -> str:
    if row.get("error"):
        return f"error: {row['error'][:60]}"
    return f"{row['tokens_per_s']:,.0f} tok/s, {row['peak_reserved_gib']:.2f} GiB"


def render(paths, heading: str = "###") -> str:
    lines = []
    for path in paths:
        headers, cells = rows_of(path)
        head = headers[0] if headers else {}
        lines += [f"{heading} {path.name}", "",
                  f"{head.get('gpu')}, {head.get('date')}; `{head.get('command')}`", "",
                  "| cell | lora-lab | Unsloth | speed ratio | peak ratio |",
                  "| --- | --- | --- | --- | --- |"]
        for name, run, ours, theirs in pairs(cells):
            ok = not ours.get("error") and not theirs.get("error")
            speed = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}x" if ok else "-"
            peak = f"{ours['peak_reserved_gib'] / theirs['peak_reserved_gib']:.3f}" if ok else "-"
            lines.append(f"| {name} (run {run}) | {_figures(ours)} | {_figures(theirs)} | "
                         f"{speed} | {peak} |")
        alone = [row for label, row in cells.items()
                 if label.startswith("ll-") and "us-" + label[3:] not in cells]
        if alone:
            lines += ["", "lora-lab cells without an Unsloth twin in this file:", ""]
            lines += [f"- {row['label']} ({', '.join(row.get('sets', []))}): {_figures(row)}, "
                      f"median step {row.get('median_step_seconds', 0):.3f} s"
                      for row in alone]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((HERE / "results").glob("*-peer*.jsonl"))
    print(render(paths))


if __name__ == "__main__":
    main()
