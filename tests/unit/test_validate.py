"""Data validation: a 10,000-row file with faults planted on known lines.

`lora-lab data validate` and the check at the start of `lora-lab run` must report exactly the
planted lines, and keep exactly the other rows.
"""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.config import DataArgs
from lora_lab.data import prepare_data, validate_data
from tests.support.tiny import TOKENIZER_DIR

ROWS = 10_000
MAX_LENGTH = 64


def turns(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


def row(messages, **extra) -> bytes:
    return json.dumps({"messages": messages, **extra}).encode()


ERRORS = {  # line -> (raw line, what is wrong with it)
    17: (b'{"messages": [{"role": "user", "content": "cut', "bad JSON"),
    123: (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid UTF-8"),
    500: (row([{"role": "user"}, {"role": "assistant", "content": "x"}]), "missing field"),
    777: (row(turns(("robot", "beep"), ("assistant", "x"))), "unknown role"),
    1000: (row(turns(("tool", "r"), ("user", "q"), ("assistant", "a"))), "out of order"),
    2024: (row(turns(("user", "q"), ("assistant", "  "))), "empty reply"),
    3000: (row(turns(("user", "q"))), "no reply"),
    4096: (row(turns(("user", "q"), ("assistant", "a"), ("user", "q2"))), "ends with user"),
    5555: (row(turns(("user", "word " * 100), ("assistant", "a"))), "nothing left to train"),
    6000: (json.dumps({"conversation": []}).encode(), "missing messages"),
    7777: (b"[1, 2]", "not an object"),
    9999: (row(turns(("user", "q"), ("system", "s"), ("assistant", "a"))), "system not first"),
}
WARNINGS = {  # line -> (raw line or None for a valid row, the remark)
    1: (None, "byte-order mark"),
    42: (None, "CRLF"),
    6000: (None, "unknown field `conversation`"),
    8000: (row(turns(("user", "q"), ("assistant", "a")), id=8000), "unknown field `id`"),
    8500: (b"", "blank line"),
    9000: (row(turns(("user", "q"), ("assistant", "long " * 100))), "cut to --max-length"),
    ROWS: (None, "no final newline"),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("validate") / "big.jsonl"
    lines = []
    for number in range(1, ROWS + 1):
        raw = row(turns(("user", f"Question {number}?"), ("assistant", f"Answer {number}.")))
        raw = ERRORS.get(number, (raw,))[0]
        raw = WARNINGS[number][0] if number in WARNINGS and WARNINGS[number][0] is not None else raw
        lines.append(raw + (b"\r\n" if number == 42 else b"\n" if number < ROWS else b""))
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(lines))
    origin = lambda numbers: [f"{path}:{n}" for n in sorted(numbers)]  # noqa: E731
    kept = origin(set(range(1, ROWS + 1)) - set(ERRORS) - {8500})
    return path, origin(ERRORS), origin(WARNINGS), kept, origin


def test_validate_reports_exactly_the_planted_lines(planted, tokenizer):
    path, errors, warnings, kept, _ = planted
    report = validate_data([str(path)], DataArgs(max_length=MAX_LENGTH), tokenizer)
    assert [p.origin for p in report.errors] == errors
    assert [p.origin for p in report.warnings] == warnings
    assert report.kept == kept and len(kept) == ROWS - len(ERRORS) - 1
    reasons = {p.origin.rsplit(":", 1)[1]: p.reason for p in report.errors + report.warnings}
    assert reasons["17"].startswith("bad JSON") and "invalid UTF-8" in reasons["123"]
    assert reasons["500"] == "message 1: missing field `content`"
    assert "unknown role 'robot'" in reasons["777"]
    assert "a tool result must follow an assistant tool call" in reasons["1000"]
    assert "empty assistant reply" in reasons["2024"]
    assert "last message must be the assistant's" in reasons["3000"] == reasons["4096"]
    assert "no assistant token left" in reasons["5555"] and "--max-length 64" in reasons["5555"]
    assert "expected an object" in reasons["7777"]
    assert "system message may only come first" in reasons["9999"]
    assert "byte-order mark" in reasons["1"] and "read correctly" in reasons["1"]
    assert "CRLF" in reasons["42"] and "field `id`" in reasons["8000"]
    assert "blank line" in reasons["8500"] and "cut to --max-length 64" in reasons["9000"]
    assert "no newline at the end" in reasons[str(ROWS)]


def test_a_run_keeps_exactly_the_valid_rows(planted, tokenizer):
    path, errors, _, kept, _ = planted
    prepared = prepare_data(DataArgs(datasets=[str(path)], max_length=MAX_LENGTH), tokenizer)
    assert [s.origin for s in prepared.train.samples] == kept
    assert sorted(p.origin for p in prepared.all_problems()) == sorted(errors)


def test_validate_command_is_strict_and_lists_every_line(planted):
    path, errors, warnings, _, origin = planted
    result = CliRunner().invoke(
        main, ["data", "validate", str(path), "--model", str(TOKENIZER_DIR), "--max-length", MAX_LENGTH]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    listed = [line.split(": error: ")[0] for line in result.output.splitlines() if ": error: " in line]
    assert listed == errors
    assert "9987 rows usable, 12 errors, 7 warnings" in result.output
    assert "error: 12 error(s) listed above; a run would skip those rows" in result.output
    # Without --model only the structure is checked; --no-strict reports and exits 0.
    loose = CliRunner().invoke(main, ["data", "validate", str(path), "--no-strict"])
    assert loose.exit_code == 0, loose.output
    listed = [line.split(": error: ")[0] for line in loose.output.splitlines() if ": error: " in line]
    assert listed == origin(set(ERRORS) - {5555})
    assert "(lengths not checked: pass --model)" in loose.output


def test_run_logs_every_skipped_row(planted, tiny_model_dir, tmp_path):
    path, errors, warnings, kept, _ = planted
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(path),
            "--max-length",
            MAX_LENGTH,
            "--max-steps",
            1,
            "--lora-rank",
            2,
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "big",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"  skipped {path}:17: bad JSON" in result.output
    logged = [json.loads(line) for line in (tmp_path / "big" / "logs" / "data_problems.jsonl").open()]
    assert sorted(p["origin"] for p in logged if p["severity"] == "error") == sorted(errors)
    assert {p["origin"] for p in logged if p["severity"] == "warning"} == set(warnings)
    summary = json.loads((tmp_path / "big" / "run_summary.json").read_text())
    assert summary["train_samples"] == len(kept)


def test_json_with_a_bom_and_csv_with_crlf_are_read(tmp_path):
    import csv

    messages = turns(("user", "q"), ("assistant", "a"))
    as_json = tmp_path / "d.json"
    as_json.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"messages": messages}]).encode())
    as_csv = tmp_path / "d.csv"
    with open(as_csv, "w", newline="") as handle:  # the csv module ends lines with CRLF
        writer = csv.DictWriter(handle, ["query", "response"])
        writer.writeheader()
        writer.writerow({"query": "q", "response": "a"})
    report = validate_data([str(as_json), str(as_csv)], DataArgs())
    assert report.kept == [f"{as_json}:1", f"{as_csv}:2"] and report.errors == []
    assert [(w.origin, "byte-order mark" in w.reason) for w in report.warnings] == [(f"{as_json}:1", True)]


def test_an_empty_query_is_a_warning_with_its_line(tmp_path):
    from lora_lab.config import DataArgs
    from lora_lab.data import validate_data

    path = tmp_path / "qa.jsonl"
    path.write_text('{"query": "Hi?", "response": "Hello."}\n{"query": "", "response": "x"}\n')
    report = validate_data([str(path)], DataArgs())
    assert report.errors == [] and len(report.kept) == 2
    assert [(w.origin, w.reason) for w in report.warnings] == [
        (
            f"{path}:2",
            "user message 1 is empty: the model learns to answer an empty prompt (fill it in, or drop the row)",
        )
    ]
