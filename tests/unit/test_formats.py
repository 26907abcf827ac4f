"""Every row format in every file type normalises to the same conversation."""

import csv
import json

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import load_samples, prepare_data
from lora_lab.data.formats import read_rows
from lora_lab.data.reading import load_dataset_spec
from lora_lab.errors import DataError
from tests.support.tiny import write_jsonl

EXPECTED = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name?\nPlease."},
    {"role": "assistant", "content": "Ann"},
]

ROWS = {
    "messages": {"messages": EXPECTED},
    "sharegpt": {
        "system": "Be kind.",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Name?\nPlease."},
            {"from": "gpt", "value": "Ann"},
        ],
    },
    "alpaca": {
        "system": "Be kind.",
        "instruction": "Name?",
        "input": "Please.",
        "output": "Ann",
        "history": [["Hi", "Hello!"]],
    },
    "query-response": {
        "system": "Be kind.",
        "query": "Name?\nPlease.",
        "response": "Ann",
        "history": [["Hi", "Hello!"]],
    },
}


def _write(path, rows):
    suffix = path.suffix
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False))
    elif suffix == ".csv":
        keys = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, keys)
            writer.writeheader()
            for row in rows:
                writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_every_format_in_every_file_type(tmp_path, fmt, suffix):
    if suffix == ".csv" and fmt in ("messages", "sharegpt"):
        row = {k: v for k, v in ROWS[fmt].items()}
    else:
        row = ROWS[fmt]
    path = _write(tmp_path / f"data{suffix}", [row, row])
    loaded = load_dataset_spec(str(path))
    assert not loaded.problems
    assert [s.messages for s in loaded.samples] == [EXPECTED, EXPECTED]


def test_format_override_and_undetectable_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"cannot tell the row format .*completion, prompt"):
        load_dataset_spec(str(path))
    path = write_jsonl(tmp_path / "q.jsonl", [ROWS["query-response"]])
    assert load_dataset_spec(str(path), "query-response").samples[0].messages == EXPECTED


def test_sharegpt_tool_calls_become_openai_tool_calls(tmp_path):
    row = {
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": json.dumps({"name": "w", "arguments": {"c": "P"}})},
            {"from": "observation", "value": "21"},
            {"from": "gpt", "value": "21 degrees"},
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "w"}}]),
    }
    sample = load_dataset_spec(str(write_jsonl(tmp_path / "t.jsonl", [row]))).samples[0]
    assert sample.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}],
    }
    assert sample.messages[2] == {"role": "tool", "content": "21"}
    assert sample.tools == [{"type": "function", "function": {"name": "w"}}]


def test_openai_string_arguments_are_decoded(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ]
    }
    sample = load_dataset_spec(str(write_jsonl(tmp_path / "t.jsonl", [row]))).samples[0]
    assert sample.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_bad_rows_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps(ROWS["messages"])
    lines = [
        good,
        "{not json",
        good,
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}),
        json.dumps({"messages": [{"role": "robot", "content": "q"}]}),
        good,
    ]
    path.write_text("\n".join(lines) + "\n")
    loaded = load_dataset_spec(str(path))
    assert len(loaded.samples) == 3
    assert [s.origin for s in loaded.samples] == [f"{path}:1", f"{path}:3", f"{path}:7"]
    reasons = {p.origin: p.reason for p in loaded.problems}
    assert list(reasons) == [f"{path}:2", f"{path}:4", f"{path}:5", f"{path}:6"]
    assert reasons[f"{path}:2"].startswith("bad JSON")
    assert "last message must be the assistant" in reasons[f"{path}:4"]
    assert "empty assistant reply" in reasons[f"{path}:5"]
    assert "unknown role 'robot'" in reasons[f"{path}:6"]


def test_invalid_utf8_row_is_reported(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROWS["messages"]).encode() + b"\n" + b'{"messages": "\xff"}\n')
    loaded = load_dataset_spec(str(path))
    assert [p.origin for p in loaded.problems] == [f"{path}:2"]
    assert "invalid UTF-8" in loaded.problems[0].reason


def test_csv_line_numbers_count_the_header(tmp_path):
    path = _write(tmp_path / "d.csv", [ROWS["alpaca"], {"instruction": "x", "output": ""}])
    loaded = load_dataset_spec(str(path))
    assert [s.origin for s in loaded.samples] == [f"{path}:2"]
    assert [p.origin for p in loaded.problems] == [f"{path}:3"]


def test_sampling_with_hash_n(tmp_path):
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    few = load_dataset_spec(f"{path}#4").samples
    assert len(few) == 4 and len({s.origin for s in few}) == 4
    many = load_dataset_spec(f"{path}#25").samples
    assert len(many) == 25
    counts = {o: sum(s.origin == o for s in many) for o in {s.origin for s in many}}
    assert len(counts) == 10 and sorted(counts.values()) == [2] * 5 + [3] * 5


def test_mixing_datasets_and_placeholders(tmp_path, chat_rows):
    other = write_jsonl(tmp_path / "o.jsonl", [{"query": "q", "response": "r"}])
    chat = write_jsonl(tmp_path / "c.jsonl", chat_rows)
    args = DataArgs(datasets=[str(chat), str(other)], model_name="Aurora", model_author="Lab X")
    samples = load_samples(args.datasets, args, seed=0).samples
    assert len(samples) == 3
    assert samples[0].messages[1]["content"] == "I am Aurora, made by Lab X."


def test_missing_placeholder_values_are_a_warning_per_row(tmp_path, chat_rows):
    chat = write_jsonl(tmp_path / "c.jsonl", chat_rows)
    loaded = load_dataset_spec(str(chat))
    assert len(loaded.samples) == 2 and not loaded.problems
    assert [(w.origin, w.reason) for w in loaded.warnings] == [
        (
            f"{chat}:1",
            "placeholder {{AUTHOR}}, {{NAME}} is not filled and would be trained "
            "literally; pass --model-author and --model-name",
        )
    ]
    assert loaded.samples[0].messages[1]["content"] == "I am {{NAME}}, made by {{AUTHOR}}."


def test_bundled_self_cognition_set():
    rows = read_rows("self-cognition")
    assert len(rows) >= 80
    texts = [json.dumps(r, ensure_ascii=False) for r, _ in rows]
    assert sum(any("\u4e00" <= ch <= "\u9fff" for ch in t) for t in texts) >= 40
    assert all("{{NAME}}" in t for t in texts)
    loaded = load_dataset_spec("self-cognition", fill={"model_name": "N", "model_author": "A"})
    assert len(loaded.samples) == len(rows) and not loaded.problems


def test_unknown_file_and_unreachable_hub_dataset(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="file not found"):
        load_dataset_spec(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type"):
        load_dataset_spec(str(tmp_path / "notes.txt"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="loading it as a hub dataset failed"):
        load_dataset_spec("no-such-org/no-such-dataset")


def test_validation_split_by_ratio_and_by_file(tmp_path, tokenizer):
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare_data(DataArgs(datasets=[str(path)], val_ratio=0.25), tokenizer)
    assert len(prepared.train.samples) == 15 and len(prepared.val.samples) == 5
    assert not {s.origin for s in prepared.train.samples} & {s.origin for s in prepared.val.samples}
    val = write_jsonl(tmp_path / "v.jsonl", rows[:3])
    prepared = prepare_data(DataArgs(datasets=[str(path)], val_data=[str(val)]), tokenizer)
    assert len(prepared.train.samples) == 20 and len(prepared.val.samples) == 3


def test_inference_prompts_are_read_as_training_rows_are_and_bad_ones_named(tmp_path):
    """lora-lab infer's prompts go through the training rows' reader (data.reading.normalise_rows,
    a reply not required): a final reply is the reference, and unusable rows are named by
    file:line before anything is generated."""
    import json

    import pytest

    from lora_lab.errors import DataError
    from lora_lab.use.infer import read_prompts

    good = tmp_path / "p.jsonl"
    rows = [{"query": "Hi"}, {"query": "2+2?", "response": "4"}]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompts(str(good)) == [
        (f"{good}:1", [{"role": "user", "content": "Hi"}], None),
        (f"{good}:2", [{"role": "user", "content": "2+2?"}], "4"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "Hi"}) + "\n" + json.dumps({"question": "Hi"}) + "\n")
    with pytest.raises(
        DataError, match=rf"--input {bad}: 1 rows are not usable prompts .*\n  {bad}:2: missing field `query`"
    ):
        read_prompts(str(bad))
