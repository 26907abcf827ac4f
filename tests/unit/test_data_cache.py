"""The encoded-data cache (lora_lab/data/cache.py): the ids equal an uncached encoding, a second
call maps the stored samples without encoding, any changed input is another key, num_proc 2
encodes exactly what one process does, and of two processes only one encodes."""

import json
import multiprocessing
import os
from dataclasses import replace

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import prepare_data, validate_data
from lora_lab.data.arrow import ArrowSamples, fingerprint_samples
from lora_lab.data.cache import META
from lora_lab.data.packing import pack_samples
from lora_lab.training.checkpoint import data_fingerprint

ROWS = 240


def write_rows(path, rows=ROWS):
    lines = []
    for i in range(rows):
        if i == 7:
            lines.append('{"messages": [{"role": "user", "content": "cut')  # bad JSON, line 8
            continue
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i} " + "why " * (i % 13)},
                        {"role": "assistant", "content": f"answer {i} " + "because " * (i % 29)},
                    ]
                }
            )
        )
    lines.append(
        json.dumps({"messages": [{"role": "user", "content": "long " * 300}, {"role": "assistant", "content": "x"}]})
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("LORA_LAB_DATA_CACHE", str(root))
    return root


def args_for(path, **changes) -> DataArgs:
    return replace(DataArgs(datasets=[str(path)], max_length=96, val_ratio=0.1, num_proc=1), **changes)


def as_lists(report) -> list:
    return [(s.input_ids, s.labels, s.origin, s.truncated) for s in report.samples]


def entries(root) -> list:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def test_cached_samples_equal_the_uncached_encoding_and_are_reused(tmp_path, cache_root, tokenizer):
    data = write_rows(tmp_path / "chat.jsonl")
    plain = prepare_data(args_for(data, cache=False), tokenizer, seed=3)
    first = prepare_data(args_for(data), tokenizer, seed=3)
    (key,) = entries(cache_root)
    stamp = os.stat(cache_root / key / META).st_mtime_ns
    second = prepare_data(args_for(data), tokenizer, seed=3)
    assert (plain.cache, first.cache, second.cache) == ("not cached", "encoded", "reused")
    assert os.stat(cache_root / key / META).st_mtime_ns == stamp  # nothing written again
    assert isinstance(second.train.samples, ArrowSamples)
    for cached in (first, second):
        assert as_lists(cached.train) == as_lists(plain.train)
        assert as_lists(cached.val) == as_lists(plain.val)
        assert [str(p) for p in cached.all_problems()] == [str(p) for p in plain.all_problems()]
        assert [str(w) for w in cached.all_warnings()] == [str(w) for w in plain.all_warnings()]
        assert cached.train.truncated == plain.train.truncated
        assert cached.formats == plain.formats
        assert cached.summary(96) == plain.summary(96)
    assert any(":8: bad JSON" in str(p) for p in second.all_problems())
    assert second.train.fingerprint == data_fingerprint(plain.train.samples)
    assert fingerprint_samples(second.train.samples) == second.train.fingerprint
    packed, mapped = (pack_samples(r.train.samples, 8, 400, seed=1) for r in (plain, second))
    assert [r.input_ids for r in packed.rows] == [r.input_ids for r in mapped.rows]
    assert [r.labels for r in packed.rows] == [r.labels for r in mapped.rows]
    assert packed.row_tokens == mapped.row_tokens


def test_a_changed_byte_template_or_setting_is_another_key(tmp_path, cache_root, tokenizer):
    data = write_rows(tmp_path / "chat.jsonl")
    base = prepare_data(args_for(data), tokenizer, seed=3)
    text = data.read_text()
    data.write_text(text.replace("answer 5 ", "answer 6 ", 1))  # one byte, same size
    changed = prepare_data(args_for(data), tokenizer, seed=3)
    assert changed.cache == "encoded" and as_lists(changed.train) != as_lists(base.train)
    shorter = prepare_data(args_for(data, max_length=64), tokenizer, seed=3)
    assert shorter.cache == "encoded" and max(len(s.input_ids) for s in shorter.train.samples) == 64
    assert prepare_data(args_for(data), tokenizer, seed=4).cache == "encoded"  # another split
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = template.replace("<|im_start|>", "<|im_start|> ")
        spaced = prepare_data(args_for(data), tokenizer, seed=3)
    finally:
        tokenizer.chat_template = template
    assert spaced.cache == "encoded" and as_lists(spaced.train) != as_lists(changed.train)
    assert prepare_data(args_for(data), tokenizer, seed=3).cache == "reused"
    assert len(entries(cache_root)) == 5


def test_two_processes_encode_exactly_what_one_does(tmp_path, cache_root, tokenizer):
    data = write_rows(tmp_path / "chat.jsonl")
    one = prepare_data(args_for(data, cache=False), tokenizer, seed=3)
    two = prepare_data(args_for(data, num_proc=2), tokenizer, seed=3)
    meta = json.loads((cache_root / entries(cache_root)[0] / META).read_text())
    assert meta["num_proc"] == {"train": 2, "val": 2}
    assert as_lists(two.train) == as_lists(one.train) and as_lists(two.val) == as_lists(one.val)
    assert [str(p) for p in two.all_problems()] == [str(p) for p in one.all_problems()]
    assert two.train.truncated == one.train.truncated


def test_validate_with_a_tokenizer_reuses_its_encoding(tmp_path, cache_root, tokenizer):
    data = write_rows(tmp_path / "chat.jsonl")
    args = args_for(data, val_ratio=0.0, max_length=64)
    plain = validate_data([str(data)], replace(args, cache=False), tokenizer)
    first, second = (validate_data([str(data)], args, tokenizer) for _ in range(2))
    for report in (first, second):
        assert report.kept == plain.kept and report.formats == plain.formats
        assert [str(e) for e in report.errors] == [str(e) for e in plain.errors]
        assert [str(w) for w in report.warnings] == [str(w) for w in plain.warnings]
    assert len(entries(cache_root)) == 1


def _prepare_in_child(path, root, queue):
    os.environ["LORA_LAB_DATA_CACHE"] = root
    from transformers import AutoTokenizer

    from tests.support.tiny import TOKENIZER_DIR

    prepared = prepare_data(args_for(path), AutoTokenizer.from_pretrained(TOKENIZER_DIR), seed=3)
    queue.put((prepared.cache, prepared.train.fingerprint))


def test_of_two_processes_one_encodes_and_the_other_maps_its_files(tmp_path, cache_root):
    data = write_rows(tmp_path / "chat.jsonl")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_prepare_in_child, args=(data, str(cache_root), queue)) for _ in range(2)]
    for child in children:
        child.start()
    results = [queue.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(how for how, _ in results) == ["encoded", "reused"]
    assert results[0][1] == results[1][1]
    assert len(entries(cache_root)) == 1
    assert not list(cache_root.glob("*.partial"))


def test_data_stats_prints_the_same_table_from_the_cache(tmp_path, cache_root):
    from click.testing import CliRunner

    from lora_lab.cli import main
    from tests.support.tiny import TOKENIZER_DIR

    data = write_rows(tmp_path / "chat.jsonl")
    outputs = [
        CliRunner().invoke(main, ["data", "stats", str(data), "--model", str(TOKENIZER_DIR)]).output for _ in range(2)
    ]
    lines = [[line for line in out.splitlines() if not line.startswith("data: ")] for out in outputs]
    assert "data: encoded in" in outputs[0] and "data: encoded data reused" in outputs[1]
    assert lines[0] == lines[1] and "(1 rows not usable" in outputs[1]
    assert any(line.startswith("samples 240 ") for line in lines[1])


def test_a_damaged_entry_is_encoded_again(tmp_path, cache_root, tokenizer):
    data = write_rows(tmp_path / "chat.jsonl")
    first = prepare_data(args_for(data), tokenizer, seed=3)
    (key,) = entries(cache_root)
    next((cache_root / key).glob("train-*.arrow")).unlink()
    again = prepare_data(args_for(data), tokenizer, seed=3)
    assert again.cache == "encoded" and as_lists(again.train) == as_lists(first.train)
    assert prepare_data(args_for(data), tokenizer, seed=3).cache == "reused"
