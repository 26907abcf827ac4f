"""Code, comments, docstrings, help text and messages in lora_lab/ state rules and their reasons,
not measurements: no result file, device call, date, GPU model or peer toolkit in them. The
figures live in docs/benchmarks.md, generated from bench/results (docs/development.md)."""

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"

MEASUREMENT_MARKS = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a device call": re.compile(r"\bcalls? \d+", re.IGNORECASE),
    "a result file": re.compile(r"bench/results"),
    "a GPU model": re.compile(
        r"\b(H100|H200|H800|GH200|B200|A100|A10G?|A40|A6000|A5000|A4000|L4|L40S?|RTX|GeForce|V100|T4|MI\d{3}X?)s?\b"
    ),
    "a peer toolkit": re.compile(r"unsloth|llama-?factory|ms-swift|axolotl", re.IGNORECASE),
}
PEERS_NAME_FORMATS = PACKAGE / "data"
"""The dataset readers name the toolkits whose data formats they read (LLaMA-Factory's
dataset_info.json, ms-swift's rows): a format's name, not a comparison."""


def findings(path: Path, package: Path = PACKAGE) -> list[str]:
    """`path`'s lines that carry a measurement mark, as "file:line: what ('match')"."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in MEASUREMENT_MARKS.items():
            if what == "a peer toolkit" and path.is_relative_to(package / PEERS_NAME_FORMATS.name):
                continue
            match = pattern.search(line)
            if match:
                found.append(f"{path.relative_to(package.parent)}:{number}: {what} ({match.group(0)!r})")
    return found


def test_lora_lab_source_holds_no_measurement_marks():
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in findings(path)]
    assert not found, "state the rule and its reason; figures go to docs/benchmarks.md:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line, what",
    [
        ("# 2048 keeps the peak under (bench/results/x.jsonl)", "a result file"),
        ("# measured on 2026-12-01", "a date"),
        ("# slower in call 46", "a device call"),
        ("# it failed on two H200s", "a GPU model"),
        ('help="as Unsloth sets it"', "a peer toolkit"),
    ],
)
def test_each_mark_is_found(tmp_path, line, what):
    source = tmp_path / "lora_lab" / "module.py"
    source.parent.mkdir()
    source.write_text("x = 1\n" + line + "\n")
    assert findings(source, source.parent) == [
        f"lora_lab/module.py:2: {what} ({MEASUREMENT_MARKS[what].search(line)[0]!r})"
    ]


def test_the_data_readers_may_name_the_formats_they_read(tmp_path):
    source = tmp_path / "lora_lab" / "data" / "formats.py"
    source.parent.mkdir(parents=True)
    source.write_text("# LLaMA-Factory's dataset_info.json, ms-swift's rows\n")
    assert findings(source, source.parents[1]) == []
