"""Fuzz: thousands of mutated rows across .jsonl / .json / .csv / .parquet (issue #18).

Good rows in every row format are mutated (a wrong type at a random place, deep nesting, a key
dropped or added, invalid bytes, truncation, binary lines, duplicate keys, lone surrogates, huge
cells) and read by `data validate` and by a run's loading (prepare_data). Asserted: no exception;
every row is either kept or reported as one error with its file and line; every unmutated row is
kept with its text byte for byte; validate and the run keep the same rows. Seeded, modest sizes.
"""

import copy
import csv
import io
import json
import random

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import load_samples, prepare_data, validate_data

SEED = 18
ROWS = {"jsonl": 2000, "json": 800, "csv": 800, "parquet": 400}
"""Rows per file type read by validate (structure); the run's loading encodes a tenth of them."""
ALPHABET = 'abc xyz 0123 {}[]":,\\ \n\t é 中文 🙂 {"ok": true} \' <|im_start|>'
WRONG = [None, 0, 1.5, True, [], {}, "", [1], {"a": 1}, ["x", "y"]]


def text(rng, low=1, high=30) -> str:
    out = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(low, high)))
    return out if out.strip() else out + "x"


def good_row(rng, fmt):
    """(row, the conversation it must be read as)."""
    turns = [(text(rng), text(rng)) for _ in range(rng.randint(1, 3))]
    system = text(rng) if rng.random() < 0.5 else None
    expected = ([{"role": "system", "content": system}] if system else []) + [
        m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
    if fmt == "messages":
        return {"messages": copy.deepcopy(expected)}, expected
    if fmt == "sharegpt":
        row = {
            "conversations": [
                t for q, a in turns for t in ({"from": "human", "value": q}, {"from": "gpt", "value": a})
            ]
        }
    elif fmt == "swift-sharegpt":
        row = {"conversation": [{"human": q, "assistant": a} for q, a in turns]}
    else:
        prompt, reply = ("instruction", "output") if fmt == "alpaca" else ("query", "response")
        row = {prompt: turns[-1][0], reply: turns[-1][1]}
        if len(turns) > 1:
            row["history"] = [list(t) for t in turns[:-1]]
    if system:
        row["system"] = system
    return row, expected


def nodes(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from nodes(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from nodes(item, path + (index,))


def replace_at(row, path, new):
    if not path:
        return new
    target = row
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return row


def mutate_value(rng, row):
    row = copy.deepcopy(row)
    path = rng.choice(list(nodes(row)))
    kind = rng.random()
    if kind < 0.6:
        return replace_at(row, path, copy.deepcopy(rng.choice(WRONG)))
    if kind < 0.7:
        nested = "x"
        for _ in range(rng.choice([3, 99, 150, 900])):
            nested = [nested]
        return replace_at(row, path, nested)
    if kind < 0.8 and path:
        parent = row
        for step in path[:-1]:
            parent = parent[step]
        del parent[path[-1]]
        return row
    if kind < 0.9:
        return replace_at(row, path, "y" * 150_000) if path else row
    if isinstance(row, dict):
        row["extra_field"] = text(rng)
    return row


def mutate_line(rng, line: bytes) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return line[: rng.randrange(1, len(line))]
    if kind == 1:
        at = rng.randrange(len(line))
        return line[:at] + bytes([rng.randrange(0x80, 0x100)]) + line[at:]
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 80))).replace(b"\n", b"")
    if kind == 3:
        return line.replace(b"{", b'{"k": 1, "k": 2, ', 1)
    if kind == 4:
        return line.replace(b'": "', b'": "\\udc80', 1)
    return b"[" * 100_000 + b"]" * 100_000


def build_jsonl(rng, folder, fmt, count):
    path, lines, good = folder / f"{fmt}.jsonl", [], {}
    for number in range(1, count + 1):
        row, expected = good_row(rng, fmt)
        if number == 1 or rng.random() < 0.4:
            good[f"{path}:{number}"] = expected
            raw = json.dumps(row, ensure_ascii=rng.random() < 0.5).encode()
        elif rng.random() < 0.5:
            raw = json.dumps(mutate_value(rng, row)).encode()
        else:
            raw = mutate_line(rng, json.dumps(row).encode())
        lines.append(raw + b"\n")
    path.write_bytes(b"".join(lines))
    return path, count, good


def build_json(rng, folder, fmt, count):
    path, chunks, good = folder / f"{fmt}.json", [], {}
    for number in range(count):
        row, expected = good_row(rng, fmt)
        if number == 0 or rng.random() < 0.4:
            good[f"{path}:{number + 2}"] = expected
        elif rng.random() < 0.05:  # deeper than Python's JSON reader goes
            chunks.append("[" * 5000 + '"x"' + "]" * 5000)
            continue
        else:
            row = mutate_value(rng, row)
        chunks.append(json.dumps(row))
    path.write_text("[\n" + ",\n".join(chunks) + "\n]\n", encoding="utf-8")
    return path, count, good


def build_csv(rng, folder, fmt, count):
    path, good = folder / f"{fmt}.csv", {}
    columns = ["instruction", "input", "output", "system", "history"] if fmt == "alpaca" else ["messages"]
    head = io.StringIO()
    csv.writer(head).writerow(columns)
    records, line = [head.getvalue().encode()], 2
    for number in range(count):
        row, expected = good_row(rng, "alpaca" if fmt == "alpaca" else "messages")
        cells = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()}
        cells = [(cells.get(c) or "") for c in columns]
        mutated = number > 0 and rng.random() >= 0.4
        if mutated:
            at = rng.randrange(len(cells))
            cells[at] = rng.choice(
                ["", "[", "{}", "5", '{"ok": true}', "z" * 200_000, "[" * 5000 + "]" * 5000, text(rng)]
            )
        buffer = io.StringIO()
        short = mutated and len(cells) > 1 and rng.random() < 0.1  # a cell missing
        csv.writer(buffer).writerow(cells[:-1] if short else cells)
        record = buffer.getvalue().encode()
        if mutated and rng.random() < 0.2:
            record = record.replace(b"a", b"\xff", 1) if b"a" in record else record[:-2] + b"\xff" + record[-2:]
        if not mutated:
            good[f"{path}:{line}"] = expected
        records.append(record)
        line += record.count(b"\n")
    path.write_bytes(b"".join(records))
    return path, count, good


def build_parquet(rng, folder, fmt, count):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, rows, good = folder / "alpaca.parquet", [], {}
    for number in range(count):
        q, a = text(rng), text(rng)
        row = {"instruction": q, "output": a}
        if number == 0 or rng.random() < 0.4:
            good[f"{path}[row {number}]"] = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        else:
            key = rng.choice(["instruction", "output"])
            row[key] = rng.choice([None, "", "w" * 150_000, " \n "])
        rows.append(row)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path, count, good


def build_files(folder, scale: float) -> list:
    rng = random.Random(SEED)
    rows = {kind: max(8, int(count * scale)) for kind, count in ROWS.items()}
    files = [
        build_jsonl(rng, folder, fmt, rows["jsonl"] // 4)
        for fmt in ("messages", "sharegpt", "swift-sharegpt", "query-response")
    ]
    files += [build_json(rng, folder, fmt, rows["json"] // 2) for fmt in ("alpaca", "sharegpt")]
    files += [build_csv(rng, folder, fmt, rows["csv"] // 2) for fmt in ("alpaca", "messages")]
    files.append(build_parquet(rng, folder, "alpaca", rows["parquet"]))
    return files


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    return build_files(tmp_path_factory.mktemp("fuzz"), 1.0)


def all_origins(path, count):
    if path.suffix == ".parquet":
        return {f"{path}[row {i}]" for i in range(count)}
    if path.suffix == ".json":
        return {f"{path}:{i + 2}" for i in range(count)}
    return None  # jsonl / csv: checked through the good rows and the kept/error split


def check_report(report, path, count, good):
    errors = [p.origin for p in report.errors]
    assert len(errors) == len(set(errors)), "a row was reported twice"
    assert not set(errors) & set(report.kept), "a row was both kept and reported"
    assert all(o.startswith(str(path)) for o in errors + report.kept)
    expected = all_origins(path, count)
    if expected is not None:
        assert set(errors) | set(report.kept) == expected
    else:
        assert len(set(errors) | set(report.kept)) == count
    assert set(good) <= set(report.kept)


def test_fuzzed_rows_are_kept_or_reported_once(fuzzed):
    total = 0
    for path, count, good in fuzzed:
        report = validate_data([str(path)], DataArgs(max_length=4096))
        check_report(report, path, count, good)
        samples = load_samples([str(path)], DataArgs(), seed=0).samples
        by_origin = {s.origin: s.messages for s in samples}
        for origin, messages in good.items():
            assert by_origin[origin] == messages, origin  # byte for byte
        total += count
    assert total >= 4000


def test_the_run_keeps_what_validate_keeps(tmp_path, tokenizer):
    fuzzed = build_files(tmp_path, 0.1)
    specs = [str(path) for path, _, _ in fuzzed]
    args = DataArgs(datasets=specs, max_length=4096)
    report = validate_data(specs, args, tokenizer)
    prepared = prepare_data(args, tokenizer)
    chats = [s.origin for s in prepared.train.samples if s.origins is None]
    documents = [o for s in prepared.train.samples if s.origins for o in s.origins]
    assert chats + list(dict.fromkeys(documents)) == report.kept
    assert sorted(p.origin for p in prepared.all_problems()) == sorted(p.origin for p in report.errors)
    for path, _count, good in fuzzed:
        mine = [o for o in report.kept if o.startswith(f"{path}:") or o.startswith(f"{path}[")]
        assert set(good) <= set(mine)
