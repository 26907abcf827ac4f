"""Streamed encoding (lora_lab/data/stream.py): read, normalised and encoded chunk by chunk in
worker processes, it gives exactly the samples, order, problems and warnings of reading every
row into memory and encoding the list (build_prepared with encode_samples): the same `PATH#N`
rows, the same mixing and val_ratio split, for .jsonl, .csv and .parquet files."""

import csv
import json
import random

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import arrow as arrow_module
from lora_lab.data import (
    build_prepared,
    encode_as_training,
    finish_validation,
    load_samples,
    prepare_data,
    read_for_validation,
    validate_data,
)
from lora_lab.data import stream as stream_module
from lora_lab.data.arrow import ArrowSamples, fingerprint_samples
from lora_lab.data.encode import encode_samples
from lora_lab.data.reading import sample_rows

MAX_LENGTH = 80


def chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"question {i} " + "why " * (i % 7)},
            {"role": "assistant", "content": f"answer {i} " + "so " * (i % 23)},
        ]
    }


def write_jsonl(path, rows: int, offset: int = 0):
    lines = [json.dumps(chat(offset + i)) for i in range(rows)]
    lines[3] = '{"messages": [{"role": "user"'  # bad JSON, line 4
    lines[5] = json.dumps({"messages": [{"role": "assistant", "content": "a document " * 30}]})
    lines[6] = json.dumps({**chat(offset + 6), "id": 6})  # unused field: a warning
    lines[9] = json.dumps(
        {"messages": [{"role": "user", "content": "long " * 200}, {"role": "assistant", "content": "cut"}]}
    )
    lines[11] = "null"  # a row, not a blank line: reported
    path.write_text("\n".join(lines) + "\n\n")  # a blank line: a warning
    return path


def write_csv(path, rows: int):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instruction", "output"])
        for i in range(rows):
            writer.writerow([f"task {i} " + "word " * (i % 5), "" if i == 2 else f"done {i}"])
    return path


def write_parquet(path, rows: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"query": [f"q {i}" for i in range(rows)], "response": [f"r {i} " + "x " * (i % 11) for i in range(rows)]}
    )
    pq.write_table(table, path, row_group_size=7)
    return path


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that a small dataset spans many chunks, workers and files."""
    monkeypatch.setattr(stream_module, "CHUNK_ROWS", 16)
    monkeypatch.setattr(stream_module, "FIRST_CHUNK_ROWS", 4)
    monkeypatch.setattr(arrow_module, "TAKE_ROWS", 7)  # rows written in another order: files of 7


def in_memory(args: DataArgs, tokenizer, seed: int):
    """Every row read into memory, then the list encoded in one process."""

    def encode(samples, name):
        return encode_samples(tokenizer, samples, args.max_length, args.truncation, args.system, args.enable_thinking)

    return build_prepared(args, seed, lambda specs: load_samples(specs, args, seed), encode)


def described(report) -> list:
    return [(s.input_ids, s.labels, s.origin, s.truncated, s.origins) for s in report.samples]


def assert_same(streamed, memory):
    assert isinstance(streamed.train.samples, ArrowSamples)
    for name in ("train", "val"):
        got, want = getattr(streamed, name), getattr(memory, name)
        assert (got is None) == (want is None)
        if want is not None:
            assert described(got) == described(want)
            assert got.truncated == want.truncated
    assert [str(p) for p in streamed.all_problems()] == [str(p) for p in memory.all_problems()]
    assert [str(w) for w in streamed.all_warnings()] == [str(w) for w in memory.all_warnings()]
    assert streamed.formats == memory.formats


def test_sample_rows_picks_the_rows_it_picked_before():
    samples = [f"row {i}" for i in range(37)]
    for count, seed in ((5, 42), (37, 1), (90, 7), (36, 3)):
        rng = random.Random(seed)  # the definition: whole copies, then random.sample
        whole, remainder = divmod(count, len(samples))
        assert sample_rows(samples, count, seed) == samples * whole + rng.sample(samples, remainder)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_sampled_mixed_and_split_ids_equal_the_in_memory_encoding(tmp_path, tokenizer, small_chunks, num_proc):
    first = write_jsonl(tmp_path / "a.jsonl", 60)
    second = write_jsonl(tmp_path / "b.jsonl", 25, offset=100)
    table = write_csv(tmp_path / "c.csv", 20)
    frame = write_parquet(tmp_path / "d.parquet", 30)
    args = DataArgs(
        datasets=[f"{first}#45", f"{second}#70", str(table), f"{frame}#12"],
        max_length=MAX_LENGTH,
        val_ratio=0.2,
        num_proc=num_proc,
        cache=False,
    )
    streamed, memory = prepare_data(args, tokenizer, seed=5), in_memory(args, tokenizer, 5)
    assert_same(streamed, memory)
    from_second = [
        s.origin for r in (streamed.train, streamed.val) for s in r.samples if s.origin.startswith(f"{second}:")
    ]
    assert len(from_second) > len(set(from_second))  # #70 of about 22 rows: whole copies
    documents = [o for r in (streamed.train, streamed.val) for s in r.samples for o in (s.origins or [])]
    assert f"{second}:6" in documents  # the pre-training row is packed
    assert streamed.train.fingerprint is None  # not cached: the run computes it
    assert fingerprint_samples(streamed.train.samples) == fingerprint_samples(memory.train.samples)


def test_cached_validation_data_and_a_second_seed(tmp_path, tokenizer, small_chunks, monkeypatch):
    monkeypatch.setenv("LORA_LAB_DATA_CACHE", str(tmp_path / "cache"))
    train = write_jsonl(tmp_path / "a.jsonl", 50)
    val = write_jsonl(tmp_path / "v.jsonl", 20, offset=500)
    args = DataArgs(datasets=[f"{train}#30"], val_data=[f"{val}#8"], max_length=MAX_LENGTH, num_proc=2)
    for seed in (1, 2):
        streamed = prepare_data(args, tokenizer, seed=seed)
        assert streamed.cache == "encoded"
        assert_same(streamed, in_memory(args, tokenizer, seed))
        assert streamed.train.fingerprint == fingerprint_samples(in_memory(args, tokenizer, seed).train.samples)
    assert prepare_data(args, tokenizer, seed=2).cache == "reused"


def test_a_whole_file_in_order_keeps_its_chunk_files(tmp_path, tokenizer, small_chunks, monkeypatch):
    monkeypatch.setenv("LORA_LAB_DATA_CACHE", str(tmp_path / "cache"))
    lines = [json.dumps(chat(i)) for i in range(70)]
    lines[3] = "[1, 2"  # bad JSON: a problem, no row
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = DataArgs(datasets=[str(data)], max_length=MAX_LENGTH, num_proc=2)
    streamed = prepare_data(args, tokenizer, seed=3)
    assert_same(streamed, in_memory(args, tokenizer, 3))
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    files = json.loads((entry / "meta.json").read_text())["reports"]["train"]["files"]
    assert files == sorted(p.name for p in entry.glob("*.arrow"))  # no stage file left over
    assert files == [f"train-{i:05d}.arrow" for i in range(len(files))] and len(files) > 4
    assert len(streamed.train.samples) == 69


def test_validation_reads_every_entry_and_reports_the_unreadable_one(tmp_path, tokenizer, small_chunks):
    data = write_jsonl(tmp_path / "a.jsonl", 40)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = DataArgs(max_length=MAX_LENGTH, num_proc=2, cache=False)
    specs = [str(empty), f"{data}#50"]
    streamed = validate_data(specs, args, tokenizer, seed=4)
    read, samples = read_for_validation(specs, args, 4, "sft")
    read.tokens_checked = True
    memory = finish_validation(read, encode_as_training(tokenizer, samples, args), MAX_LENGTH)
    assert streamed.formats[0] == (str(empty), "not read (error above)")
    assert f"{empty}: --data {empty}: the dataset has no rows." in map(str, streamed.errors)
    assert f"{data}:12: expected an object, got null" in map(str, streamed.errors)
    assert f"{data}:10" not in streamed.kept  # nothing left to train on after the cut
    assert streamed.kept == memory.kept and streamed.formats == memory.formats
    assert [str(e) for e in streamed.errors] == [str(e) for e in memory.errors]
    assert [str(w) for w in streamed.warnings] == [str(w) for w in memory.warnings]


def test_pretraining_documents_are_packed_across_chunks_as_in_memory(tmp_path, tokenizer, small_chunks):
    rows = [{"text": f"document {i} " + "words " * (i % 40)} for i in range(90)]
    rows[8] = {"text": ""}  # an empty document: a problem
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = DataArgs(datasets=[f"{data}#120"], max_length=MAX_LENGTH, val_ratio=0.1, num_proc=2, cache=False)
    streamed = prepare_data(args, tokenizer, seed=9)
    assert_same(streamed, in_memory(args, tokenizer, 9))
    lengths = [len(s.input_ids) for s in streamed.train.samples]
    assert set(lengths[:-1]) == {MAX_LENGTH} and len(lengths) > 10  # cut across documents
    assert any(len(s.origins) > 1 for s in streamed.train.samples)
