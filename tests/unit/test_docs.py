"""Figures in README and preset headers come from bench/results (generated, not typed)."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402


def test_readme_bench_block_is_generated_from_results():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(report.BEGIN) + len(report.BEGIN):text.index(report.END)]
    assert block.strip() == report.render().strip()
    assert "speed vs plain" in block and "Real-length SFT data" in block
    assert "| 24gb (23.5 GiB) | 16-bit LoRA | 16384 | 17.29 |" in block


@pytest.mark.parametrize("tier", ["24gb", "16gb", "12gb", "8gb"])
def test_preset_header_figures_match_stored_results(tier):
    rows = [json.loads(line) for path in (ROOT / "bench" / "results").glob("*-presets-*.jsonl")
            for line in path.read_text().splitlines()[1:]]
    header = (ROOT / "presets" / f"{tier}.yaml").read_text().split("\ndescription:")[0]
    stated = re.findall(r"([\d.]+B)( nf4)? ([\d.]+) @(\d+)", header)
    assert len(stated) == 4
    for size, nf4, peak, length in stated:
        row = next(r for r in rows if r["kind"] == "lora-lab" and r["preset"] == tier
                   and r["size"] == size.lower())
        assert f"{row['peak_reserved_gib']:.2f}" == peak and row["max_length"] == int(length)
        assert (row["resolved"]["quantization"] == "nf4") == bool(nf4)
        assert row["error"] is None and row["steps"] >= 20
        assert row["peak_reserved_gib"] <= row["cap_gib"]
