"""Encoded samples as Arrow files, read back memory-mapped (pyarrow alone).

write_samples writes EncodedSample objects (with each one's length, trained-token count and
digest) to one Arrow IPC stream file; stream.py's workers write one per chunk of rows.
ArrowSamples maps such files (the samples are not held in memory: the kernel pages them in and
out) and gives EncodedSample objects one at a time; the length column answers packing and
length questions, and the digest column the resume fingerprint, without reading a token.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

from .encode import EncodedSample

COLUMNS = ("input_ids", "labels", "origin", "truncated", "origins", "length", "trained", "digest")
WRITE_BATCH = 1000
WRITE_TOKENS = 200_000
"""A batch is written once it holds this many tokens (Python lists of ints cost ~36 bytes each)."""
READ_ROWS = 100
"""Rows turned into Python objects at a time when every sample is read in order."""
TAKE_ROWS = 20_000
"""Rows per file when samples are written in another order (sampling, val_ratio)."""
MAX_NUM_PROC = 8
"""data.num_proc 0 (auto) uses the machine's cores up to this many: tokenising is CPU bound and
each worker holds its own copy of the tokenizer's state."""
SAMPLES_PER_WORKER = 2000
"""Auto num_proc starts no more workers than this many samples each keep busy (a fork costs
about as much as encoding a few hundred samples)."""


def resolve_num_proc(num_proc: int, samples: int) -> int:
    """data.num_proc as processes for `samples` samples: 0 = the cores (at most MAX_NUM_PROC,
    no more than SAMPLES_PER_WORKER samples each keep busy)."""
    if num_proc:
        return max(1, num_proc)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_NUM_PROC, samples // SAMPLES_PER_WORKER))


def schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("labels", pa.list_(pa.int32())),
            ("origin", pa.string()),
            ("truncated", pa.bool_()),
            ("origins", pa.list_(pa.string())),
            ("length", pa.int32()),
            ("trained", pa.int32()),
            ("digest", pa.binary()),
        ]
    )


def write_samples(path: Path, samples) -> int:
    """EncodedSample objects into one Arrow IPC stream file; returns how many."""
    import pyarrow as pa

    columns = schema()
    batch: dict[str, list] = {name: [] for name in COLUMNS}
    count, tokens = 0, 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, columns) as writer:
        for sample in samples:
            for name in COLUMNS[:5]:
                batch[name].append(getattr(sample, name))
            batch["length"].append(len(sample.input_ids))
            batch["trained"].append(sample.trained_tokens)
            batch["digest"].append(sample_digest(sample.input_ids, sample.labels))
            count += 1
            tokens += len(sample.input_ids)
            if len(batch["origin"]) == WRITE_BATCH or tokens >= WRITE_TOKENS:
                writer.write_batch(pa.RecordBatch.from_pydict(batch, schema=columns))
                batch, tokens = {name: [] for name in COLUMNS}, 0
        if batch["origin"]:
            writer.write_batch(pa.RecordBatch.from_pydict(batch, schema=columns))
    return count


def write_taken(folder: Path, files: list, rows, name: str, map_tasks=map) -> list:
    """Rows `rows` (an array("q") of indices into `files` read in order) written in that order
    to NAME-00000.arrow ..., TAKE_ROWS a file; map_tasks(function, tasks) may write the files
    in parallel (Pool.map). Returns the new files."""
    tasks = [
        (str(folder), files, rows[start : start + TAKE_ROWS].tobytes(), f"{name}-{index:05d}.arrow")
        for index, start in enumerate(range(0, max(len(rows), 1), TAKE_ROWS))
    ]
    return list(map_tasks(_write_part, tasks))


def _write_part(task: tuple) -> str:
    import pyarrow as pa

    folder, files, rows, name = task
    taken = take_rows(map_samples(folder, files), array("q", rows))
    with pa.OSFile(str(Path(folder) / name), "wb") as sink, pa.ipc.new_stream(sink, schema()) as writer:
        writer.write_table(taken, max_chunksize=WRITE_BATCH)
    return name


def take_rows(samples: ArrowSamples, rows):
    """The rows `rows` of mapped samples, in that order, as a table. Each record batch gives its
    own rows: Table.take on a table of many batches first copies all of them into one."""
    import numpy as np
    import pyarrow as pa

    wanted = np.asarray(rows, dtype=np.int64)
    if not len(wanted):
        return schema().empty_table()
    which = np.searchsorted(np.asarray(samples.starts), wanted, side="right") - 1
    order = np.argsort(which, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(which[order])) + 1)
    pieces = [
        samples.batches[which[group[0]]].take(pa.array(wanted[group] - samples.starts[which[group[0]]]))
        for group in groups
    ]
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return pa.Table.from_batches(pieces, schema()).combine_chunks().take(pa.array(inverse))


def map_samples(folder: Path, files: list) -> ArrowSamples:
    """The samples of `files` (in order), memory-mapped."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(pa.memory_map(str(Path(folder) / name))).read_all() for name in files]
    table = pa.concat_tables(tables) if tables else schema().empty_table()
    return ArrowSamples(table, (str(folder), list(files)))


class ArrowSamples(Sequence):
    """Encoded samples read from memory-mapped Arrow files, one EncodedSample per index."""

    def __init__(self, table, source: tuple):
        self.table, self.source = table, source
        self.batches = [batch for batch in table.to_batches() if batch.num_rows]
        self.starts = list(itertools.accumulate((b.num_rows for b in self.batches), initial=0))

    def __reduce__(self):  # another process maps the same files
        return map_samples, self.source

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        which = bisect.bisect_right(self.starts, index) - 1
        row = self.batches[which].slice(index - self.starts[which], 1).to_pylist()[0]
        return EncodedSample(*(row[name] for name in COLUMNS[:5]))

    def __iter__(self):
        for batch in self.batches:
            for start in range(0, batch.num_rows, READ_ROWS):
                part = batch.slice(start, READ_ROWS)
                for row in zip(*(part.column(name).to_pylist() for name in COLUMNS[:5])):
                    yield EncodedSample(*row)

    def lengths(self) -> list:
        """Tokens of every sample, in order."""
        return self.table.column("length").to_pylist()

    def trained_token_count(self) -> int:
        import pyarrow.compute as pc

        return int(pc.sum(self.table.column("trained")).as_py() or 0)

    def origins(self) -> tuple[list, list]:
        """(origin, origins) columns: the row's origin, and a pre-training row's documents."""
        return self.table.column("origin").to_pylist(), self.table.column("origins").to_pylist()


def sample_digest(input_ids, labels) -> bytes:
    """sha256 of one encoded sample's input_ids and labels (as int32)."""
    return hashlib.sha256(array("i", input_ids).tobytes() + array("i", labels).tobytes()).digest()


def fingerprint_samples(samples) -> dict:
    """Count and sha256 of encoded samples, in order (the sha256 of their digests): the value a
    checkpoint records, so that --resume notices changed training data."""
    digest = hashlib.sha256()
    count = 0
    if isinstance(samples, ArrowSamples):
        for chunk in samples.table.column("digest").chunks:
            for value in chunk.to_pylist():
                digest.update(value)
                count += 1
    else:
        for sample in samples:
            digest.update(sample_digest(sample.input_ids, sample.labels))
            count += 1
    return {"samples": count, "sha256": digest.hexdigest()}


def sample_lengths(samples) -> list:
    """Tokens of every encoded sample, in order (read from the lengths column when mapped)."""
    if isinstance(samples, ArrowSamples):
        return samples.lengths()
    return [len(s.input_ids) for s in samples]


def trained_token_count(samples) -> int:
    if isinstance(samples, ArrowSamples):
        return samples.trained_token_count()
    return sum(s.trained_tokens for s in samples)


def first_token_at_least(samples, limit: int) -> tuple[str, int] | None:
    """(origin, id) of the first sample holding a token id >= `limit` (an input embedding's row
    count), or None: a mapped file's ids are compared as Arrow arrays, the samples read one by
    one only to name the one that fails."""
    if isinstance(samples, ArrowSamples):
        import pyarrow.compute as pc

        largest = (pc.max(chunk.flatten()).as_py() for chunk in samples.table.column("input_ids").chunks)
        if all(value is None or value < limit for value in largest):
            return None
    for sample in samples:
        ids = (
            sample.prompt_ids + sample.chosen_ids + (sample.rejected_ids or [])
            if hasattr(sample, "chosen_ids")
            else sample.input_ids
        )
        outside = [token for token in ids if token >= limit]
        if outside:
            return sample.origin, outside[0]
    return None
