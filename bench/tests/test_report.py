"""docs/benchmarks.md and its history are generated from bench/results, and the tables pair and
pick rows as their captions say."""

import json
from pathlib import Path

import report


def test_benchmarks_page_is_generated_from_results():
    block = report.generated_block(report.PAGE)
    assert block.strip() == report.render().strip(), "run: python bench/report.py --write"
    for title, _ in report.STANDING:  # one table per comparison
        assert f"### {title}" in block
    assert len(report.PAGE.read_text().encode()) <= 20 * 1024  # where lora-lab stands, not its history


def test_benchmarks_history_is_generated_from_results():
    block = report.generated_block(report.HISTORY)
    assert block.strip() == report.render_history().strip(), "run: python bench/report.py --write"
    assert "speed vs plain" in block and "Real-length SFT data" in block
    assert "| 24gb (23.5 GiB) | 16-bit LoRA | 16384 | 17.29 |" in block


def _stored(path: Path, header: dict, rows: list) -> None:
    with path.open("a") as handle:
        for line in [{"header": True, "gpu": "NVIDIA H100 80GB HBM3", "versions": {}, **header}] + rows:
            handle.write(json.dumps(line) + "\n")


def test_long_context_rows_say_what_is_stored(tmp_path, monkeypatch):
    import standing

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    ours = {"kind": "lora-lab", "preset": "16gb", "size": "7b", "cap_gib": 15.5, "error": None}
    ours["sets"] = ["model.quantization=nf4", "data.packing=false"]
    header = {"plan": "long-7b", "date": "2026-11-30 07:37 UTC", "command": "python bench/run.py long-7b"}
    _stored(
        tmp_path / "2026-11-30-long-7b.jsonl",
        header,
        [{**ours, "label": "long-16gb-7b-32768-nf4", "max_length": 32768, "peak_reserved_gib": 9.8}],
    )
    line = next(line for line in standing.long_context_table().splitlines() if line.startswith("| 16gb"))
    assert "| 49,152 tokens: not yet stored |" in line and "32,768 tokens: 9.80 GiB" in line and "earlier code" in line

    theirs = {"kind": "unsloth", "label": "us-long-16gb-7b-49152-nf4", "size": "7b", "max_length": 49152}
    theirs |= {"qlora": True, "cap_gib": 15.5, "error": "OOM", "peak_reserved_gib": 14.79}
    newer = {"plan": "long-context", "date": "2026-12-06 10:00 UTC", "command": "python bench/run.py long-context"}
    _stored(
        tmp_path / "2026-12-06-long-context.jsonl",
        newer,
        [theirs, {**ours, "label": "long-16gb-7b-98304-nf4", "max_length": 98304, "peak_reserved_gib": 14.96}],
    )
    line = next(line for line in standing.long_context_table().splitlines() if line.startswith("| 16gb"))
    assert "| 49,152 tokens: out of memory, 14.79 GiB reached (H100 80GB HBM3, 2026-12-06 [1]) |" in line
    assert line.endswith("| 98,304 tokens: 14.96 GiB (H100 80GB HBM3, 2026-12-06 [1]) |")


def test_a_peer_row_is_the_newest_pairs_of_one_sitting(tmp_path, monkeypatch):
    import standing

    monkeypatch.setattr(report, "RESULTS", tmp_path)

    def pair(run, ours, theirs, label=None):
        return [
            {"label": label or f"ll-7b-4096-{run}", "tokens_per_s": ours, "peak_reserved_gib": 14.0, "steps": 6},
            {"label": f"us-7b-4096-{run}", "tokens_per_s": theirs, "peak_reserved_gib": 15.0, "steps": 6},
        ]

    calls = [
        ("2026-12-05-peer-call40.jsonl", "2026-12-05 01:00 UTC", pair("1", 900, 1000)),  # an earlier sitting
        ("2026-12-05-peer-call48.jsonl", "2026-12-05 03:00 UTC", pair("1", 1100, 1000)),
        ("2026-12-05-peer-call49.jsonl", "2026-12-05 03:05 UTC", pair("2", 1200, 1000, "ll-7b-4096-back2048-2")),
    ]
    for name, date, rows in calls:
        _stored(tmp_path / name, {"date": date, "command": name}, rows)
    assert [(h["date"], ours["tokens_per_s"]) for h, ours, _ in standing.peer_pairs("7b-4096")] == [
        ("2026-12-05 03:05 UTC", 1200),
        ("2026-12-05 03:00 UTC", 1100),
    ]
    line = next(line for line in standing.peer_table().splitlines() if line.startswith("| 7B bf16, 4 samples x 4096"))
    assert "| 1,100-1,200 | 1,000 | 1.10x-1.20x |" in line and "earlier code" not in line


def test_multi_gpu_table_shows_the_plan_each_run_stored():
    _, rows = report.load("multi-gpu")
    row = next(r for r in rows if r["label"] == "zero3-full-1.5b")
    line = next(line for line in report.multi_gpu_table().splitlines() if "| deepspeed-zero3 |" in line)
    assert f"| {row['planned_gib_per_gpu']:.2f} |" in line


def _results_file(path: Path, runs: list) -> None:
    lines = []
    for header, rows in runs:
        lines.append(
            {
                "header": True,
                "plan": "families",
                "gpu": "GPU",
                "versions": {},
                "command": f"python bench/run.py families --cells {header}",
                "date": header,
            }
        )
        lines += rows
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_tables_over_every_file_show_the_newest_row_of_each_label(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)

    def cells(*labels, value):
        return [{"label": label, "value": value} for label in labels]

    _results_file(
        tmp_path / "2026-12-01-families.jsonl",
        [("2026-12-01 10:00 UTC", cells("a", "b", value=1)), ("2026-12-01 11:00 UTC", cells("c", value=1))],
    )
    _results_file(tmp_path / "2026-12-02-families.jsonl", [("2026-12-02 10:00 UTC", cells("a", "c", value=2))])
    headers, rows = report.load("families", every_file=True)
    assert [(row["label"], row["value"]) for row in rows] == [("a", 2), ("b", 1), ("c", 2)]
    # the 11:00 run's only cell was measured again: its header is not a source any more
    assert [(h["date"], h["_path"]) for h in headers] == [
        ("2026-12-01 10:00 UTC", "bench/results/2026-12-01-families.jsonl"),
        ("2026-12-02 10:00 UTC", "bench/results/2026-12-02-families.jsonl"),
    ]
    assert [row["label"] for row in report.load("families")[1]] == ["a", "c"]  # newest file


def test_peer_cells_pair_with_the_unsloth_cell_of_the_same_call():
    from peer_report import pairs

    def cell(label):
        return {"label": label, "tokens_per_s": 1.0, "peak_reserved_gib": 1.0}

    same_run = {c["label"]: c for c in map(cell, ["ll-7b-4096-2", "us-7b-4096-2", "us-7b-4096-1"])}
    assert [(name, run, theirs["label"]) for name, run, _, theirs in pairs(same_run)] == [
        ("7b-4096", "2", "us-7b-4096-2")
    ]
    apart = {c["label"]: c for c in map(cell, ["ll-7b-1024-2", "us-7b-1024-1", "ll-7b-1024-noskip-1"])}
    # an ablation of the same peer cell pairs with its Unsloth cell too
    assert [(name, run) for name, run, _, _ in pairs(apart)] == [
        ("7b-1024", "2, Unsloth's run 1"),
        ("7b-1024-noskip", "1"),
    ]
    variants = {
        c["label"]: c
        for c in map(cell, ["ll-1.5b-4096-chunk4096-1", "us-1.5b-4096-1", "ll-1.5b-4096-chunk1024-history-1"])
    }
    variants["ll-1.5b-4096-chunk1024-history-1"]["memory_history"] = True
    # a cell that recorded the allocator's history (slower steps) has no twin
    assert [(name, theirs["label"]) for name, _, _, theirs in pairs(variants)] == [
        ("1.5b-4096-chunk4096", "us-1.5b-4096-1")
    ]
    two = {c["label"]: c for c in map(cell, ["ll-7b-1024-3", "us-7b-1024-1", "us-7b-1024-2"])}
    assert pairs(two) == []  # which of the two is not known
