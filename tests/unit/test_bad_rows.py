"""One bad row is `file:line: reason`, never a traceback; nothing is changed silently (#18)."""

import csv
import json

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import validate_data
from lora_lab.data.reading import load_dataset_spec
from lora_lab.errors import DataError

QA = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

BAD_LINES = {  # raw JSONL line -> the reason it is reported with
    json.dumps(
        {"conversations": QA, "tools": "{not json"}
    ): "field `tools` is text but not JSON: bad JSON (Expecting property name enclosed in "
    "double quotes at column 2). It must be a list of tool schemas (or that list as a JSON "
    "string)",
    json.dumps(
        {"conversations": QA, "tools": {"name": "f"}}
    ): "field `tools` must be a list of tools; got one object. Put it in a list: [{...}]",
    json.dumps(
        {"conversations": QA, "tools": [5]}
    ): "tool 1: expected an object (a function schema), got a number (5)",
    json.dumps(
        {"conversations": [{"from": ["human"], "value": "q"}, QA[1]]}
    ): "turn 1: unknown speaker a list; expected one of human, user, gpt, assistant, system, "
    "observation, tool, function_call",
    json.dumps(
        {"conversations": [QA[0], {"from": "function_call", "value": {"name": "f"}}]}
    ): "turn 2 (function_call): the call must be a JSON string, got an object",
    json.dumps(
        {"conversations": QA, "history": 5}
    ): "field `history` is not used by the sharegpt format and was ignored",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": "a", "tool_calls": 5}]}
    ): "message 2: `tool_calls` must be a list of calls; got a number (5)",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": []}]}
    ): "message 2: `content` must be text or a list of text parts; got an empty list",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": 0}]}
    ): "message 2: `content` must be text or a list of text parts; got a number (0)",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": {}}]}
    ): "message 2: `content` must be text or a list of text parts; got an object",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}]}
    ): 'message 2: `content`, part 1: only text parts ({"type": "text", "text": ...}) can '
    "be trained on; got 'image_url'",
    '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", '
    '"content": "b"}]}': "key `content` appears twice in one object; JSON keeps only the last value, so remove "
    "or rename one",
    "[" * 100_000 + "]" * 100_000: "nested too deeply to read (more than 100 levels)",
    json.dumps(
        {"messages": [CHAT[0], {"role": "assistant", "content": "\ud800"}]}
    ): "contains a lone surrogate \\ud800, which is not valid Unicode; fix the escape sequence",
    json.dumps({"query": "q", "response": 5}): "field `response` must be text; got a number (5)",
    json.dumps(
        {"instruction": "q", "output": "a", "history": 5}
    ): "`history` must be a list of [question, answer] pairs; got a number (5)",
}


def test_each_bad_row_is_one_line_with_its_reason(tmp_path):
    for index, (line, reason) in enumerate(BAD_LINES.items()):
        fmt = json.loads(line) if not line.startswith("[[") else {}
        good = (
            {"conversations": QA}
            if "conversations" in fmt
            else {"query": "q", "response": "a"}
            if "query" in fmt
            else {"instruction": "q", "output": "a"}
            if "instruction" in fmt
            else {"messages": CHAT}
        )
        path = tmp_path / f"d{index}.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n", encoding="utf-8", errors="surrogatepass")
        report = validate_data([str(path)], DataArgs())
        found = [(p.origin, p.reason) for p in report.errors + report.warnings]
        assert found == [(f"{path}:2", reason)], line[:80]
        expected_kept = [f"{path}:1"] + ([f"{path}:2"] if "not used by" in reason else [])
        assert report.kept == expected_kept


def test_a_lone_surrogate_never_reaches_the_tokenizer(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"query": "q", "response": "a\\ud800"}\n{"query": "q", "response": "a"}\n')
    report = validate_data([str(path)], DataArgs(), tokenizer)
    assert report.kept == [f"{path}:2"] and [p.origin for p in report.errors] == [f"{path}:1"]


def test_csv_cells_keep_their_exact_text(tmp_path):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instruction", "output", "history"])
        writer.writerow(['{"ok": true}', "[1, 2]", '[["q", "{\\"a\\": 1}"]]'])
        writer.writerow(["long", "x" * 200_000, ""])
    loaded = load_dataset_spec(str(path))
    assert not loaded.problems
    first, second = (s.messages for s in loaded.samples)
    assert first == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": '{"a": 1}'},
        {"role": "user", "content": '{"ok": true}'},
        {"role": "assistant", "content": "[1, 2]"},
    ]
    assert second[1]["content"] == "x" * 200_000


def test_csv_with_invalid_utf8_reports_the_row_and_reads_the_rest(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"query,response\nq,a\nq,caf\xe9\nq,b\n")
    loaded = load_dataset_spec(str(path))
    assert [s.origin for s in loaded.samples] == [f"{path}:2", f"{path}:4"]
    assert [(p.origin, p.reason) for p in loaded.problems] == [
        (f"{path}:3", "column `response` is not valid UTF-8; save the file as UTF-8")
    ]


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json", ".jsonl"])
def test_random_bytes_are_a_clean_report(tmp_path, suffix):
    import random

    path = tmp_path / f"noise{suffix}"
    path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    report = validate_data([str(path)], DataArgs())
    assert report.kept == [] and report.errors
    assert all(str(path) in p.origin or str(path) in p.reason for p in report.errors)


def test_json_file_with_one_row_object_is_one_row(tmp_path):
    path = tmp_path / "one.json"
    path.write_text("\n" + json.dumps({"messages": CHAT}))
    loaded = load_dataset_spec(str(path))
    assert [s.messages for s in loaded.samples] == [CHAT]
    assert [(w.origin, w.reason) for w in loaded.warnings] == [
        (f"{path}:2", "the file holds one row object, not a list of rows; it is read as one row")
    ]


def test_json_rows_are_reported_by_the_line_they_start_on(tmp_path):
    path = tmp_path / "d.json"
    rows = [{"messages": CHAT}, {"messages": [CHAT[0]]}, {"messages": CHAT}]
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in rows) + "\n]\n")
    loaded = load_dataset_spec(str(path))
    starts = [
        2,
        2 + len(json.dumps(rows[0], indent=1).splitlines()),
        2 + len(json.dumps(rows[0], indent=1).splitlines()) + len(json.dumps(rows[1], indent=1).splitlines()),
    ]
    assert [s.origin for s in loaded.samples] == [f"{path}:{starts[0]}", f"{path}:{starts[2]}"]
    assert [p.origin for p in loaded.problems] == [f"{path}:{starts[1]}"]


def test_rows_of_a_json_list_on_one_line_are_reported_by_their_row(tmp_path):
    path = tmp_path / "d.json"
    rows = [{"messages": CHAT}] * 60
    rows[17] = {"messages": [CHAT[0]]}
    path.write_text(json.dumps(rows))  # the whole list on line 1
    loaded = load_dataset_spec(str(path))
    assert [p.origin for p in loaded.problems] == [f"{path}:1, row 18"]
    assert [s.origin for s in loaded.samples][:2] == [f"{path}:1", f"{path}:1, row 2"]


def test_bad_json_file_names_the_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"messages": []},\n{"messages": [}\n]')
    with pytest.raises(DataError, match=rf"^{path}:3: bad JSON"):
        load_dataset_spec(str(path))


def test_csv_header_with_a_column_twice_is_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("query,response,response\nq,a,b\n")
    with pytest.raises(DataError, match=rf"^{path}:1: column `response` appears twice"):
        load_dataset_spec(str(path))


@pytest.mark.parametrize("block", [1, 7, 64])
def test_a_json_list_read_in_small_blocks_gives_the_rows_lines_and_errors_of_one_read(tmp_path, monkeypatch, block):
    from lora_lab.data import readers

    rows = [{"messages": CHAT, "n": 12345678}, {"messages": [CHAT[0]]}, {"messages": CHAT}]
    good = tmp_path / "d.json"
    good.write_text("\ufeff[\n" + ",\n".join(json.dumps(r, indent=1) for r in rows) + "\n]\n", encoding="utf-8")
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"messages": []},\n  {"messages": [}\n]')
    cut = tmp_path / "cut.json"
    cut.write_text('[\n{"messages": []},\n')
    utf = tmp_path / "utf.json"
    utf.write_bytes(b'[\n{"a": 1},\n{"a": "\xff"}\n]')

    def read(path):
        try:
            return [
                (value if isinstance(value, dict) else value.reason, origin)
                for value, origin in readers.read_json(path, [], stream=True)
            ]
        except DataError as exc:
            return str(exc)

    whole = [read(path) for path in (good, bad, cut, utf)]
    heights = [len(json.dumps(r, indent=1).splitlines()) for r in rows]
    assert [origin for _, origin in whole[0]] == [f"{good}:{2 + sum(heights[:i])}" for i in range(3)]
    assert whole[0][0][0]["n"] == 12345678
    assert whole[1].startswith(f"{bad}:3: bad JSON (Expecting value at column 17)")
    assert whole[2] == f"{cut}:3: bad JSON (the list of rows is never closed)."
    assert whole[3].startswith(f"{utf}:3: invalid UTF-8 at byte 19")
    monkeypatch.setattr(readers, "JSON_BLOCK_BYTES", block)
    held = []
    drop = readers._TextWindow.drop
    monkeypatch.setattr(
        readers._TextWindow, "drop", lambda self, position: held.append(len(self.text)) or drop(self, position)
    )
    assert [read(path) for path in (good, bad, cut, utf)] == whole
    assert max(held) < 200  # a row and a block of text at a time, not the file (440 chars)
