"""Generated docs match their sources: the key reference (the RunConfig dataclasses), preset
headers (bench/results); README links resolve. (bench/tests/test_report.py: the benchmark tables.)"""

import json
import re
from pathlib import Path

import pytest

from lora_lab import config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_key_reference_is_generated_from_the_dataclasses():
    block = config_reference.generated_block()
    assert block.strip() == config_reference.render().strip(), "run: python -m lora_lab.config_reference --write"
    assert "| `lora.rank` | int | `8` | `--lora-rank` |" in block


def test_key_reference_lists_every_key_once():
    keys = [row["key"] for row in config_reference.key_rows()]
    from lora_lab.config import all_keys

    assert keys == all_keys()


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    assert max(len(line) for line in text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)


@pytest.mark.parametrize("tier", ["24gb", "16gb", "12gb", "8gb"])
def test_preset_header_figures_match_stored_results(tier):
    rows = [
        json.loads(line)  # oldest first: the newest run of a cell is the last match
        for path in sorted((ROOT / "bench" / "results").glob("*-presets-*.jsonl"))
        for line in path.read_text().splitlines()[1:]
    ]
    header = (ROOT / "presets" / f"{tier}.yaml").read_text().split("\ndescription:")[0]
    stated = re.findall(r"([\d.]+B)( nf4)? ([\d.]+) @(\d+)", header)
    assert len(stated) == 4
    for size, nf4, peak, length in stated:
        row = [r for r in rows if r.get("kind") == "lora-lab" and r["preset"] == tier and r["size"] == size.lower()][
            -1
        ]
        assert f"{row['peak_reserved_gib']:.2f}" == peak and row["max_length"] == int(length)
        assert (row["resolved"]["quantization"] == "nf4") == bool(nf4)
        assert row["error"] is None and row["steps"] >= 20
        assert row["peak_reserved_gib"] <= row["cap_gib"]
