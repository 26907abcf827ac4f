"""Encoded samples as Arrow files, read back memory-mapped.

write_samples writes EncodedSample objects (with each one's length, trained-token count and
digest) to one Arrow file; stream.py's workers write one per chunk of rows. ArrowSamples reads such
files through `datasets` (memory-mapped: the samples are not held in memory) and gives
EncodedSample objects one at a time; the length column answers packing and length questions, and
the digest column the resume fingerprint, without reading a single token.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

from .encode import EncodedSample

COLUMNS = ("input_ids", "labels", "origin", "truncated", "origins", "length", "trained", "digest")
WRITE_BATCH = 1000
WRITE_TOKENS = 200_000
"""A batch is written once it holds this many tokens (Python lists of ints cost ~36 bytes each)."""
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


def features():
    from datasets import Features, Sequence as ListOf, Value

    return Features({"input_ids": ListOf(Value("int32")), "labels": ListOf(Value("int32")),
                     "origin": Value("string"), "truncated": Value("bool"),
                     "origins": ListOf(Value("string")), "length": Value("int32"),
                     "trained": Value("int32"), "digest": Value("binary")})


def write_samples(path: Path, samples) -> int:
    """EncodedSample objects into one Arrow file (the stream format `datasets` maps)."""
    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=features(), path=str(path))
    batch, count, tokens = {name: [] for name in COLUMNS}, 0, 0
    for sample in samples:
        for name in COLUMNS[:5]:
            batch[name].append(getattr(sample, name))
        batch["length"].append(len(sample.input_ids))
        batch["trained"].append(sample.trained_tokens)
        batch["digest"].append(sample_digest(sample.input_ids, sample.labels))
        count += 1
        tokens += len(sample.input_ids)
        if len(batch["origin"]) == WRITE_BATCH or tokens >= WRITE_TOKENS:
            writer.write_batch(batch)
            batch, tokens = {name: [] for name in COLUMNS}, 0
    if batch["origin"] or not count:
        writer.write_batch(batch)
    writer.finalize()
    writer.close()
    return count


def write_taken(folder: Path, files: list, rows, name: str) -> list:
    """Rows `rows` (indices into `files` read in order) written in that order to
    NAME-00000.arrow ...; returns the new files."""
    import pyarrow as pa

    table = map_samples(folder, files).dataset.data.table
    out, written = [], 0
    for start in range(0, max(len(rows), 1), TAKE_ROWS):
        taken = table.take(pa.array(rows[start:start + TAKE_ROWS], type=pa.int64()))
        path = Path(folder) / f"{name}-{len(out):05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(taken, max_chunksize=WRITE_BATCH)
        out.append(path.name)
        written += len(taken)
    return out


def map_samples(folder: Path, files: list) -> "ArrowSamples":
    """The samples of `files` (in order), memory-mapped."""
    from datasets import Dataset, concatenate_datasets

    parts = [Dataset.from_file(str(Path(folder) / name), in_memory=False) for name in files]
    return ArrowSamples(concatenate_datasets(parts) if len(parts) > 1 else parts[0])


class ArrowSamples(Sequence):
    """Encoded samples read from memory-mapped Arrow files, one EncodedSample per index."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return _sample(self.dataset[int(index)])

    def __iter__(self):
        for batch in self.dataset.iter(batch_size=WRITE_BATCH):
            for row in zip(*(batch[name] for name in COLUMNS[:5])):
                yield EncodedSample(*row)

    def lengths(self) -> list:
        """Tokens of every sample, in order."""
        return self.dataset.data.column("length").to_pylist()

    def trained_token_count(self) -> int:
        import pyarrow.compute as pc

        return int(pc.sum(self.dataset.data.column("trained")).as_py() or 0)

    def origins(self) -> tuple[list, list]:
        """(origin, origins) columns: the row's origin, and a pre-training row's documents."""
        data = self.dataset.data
        return data.column("origin").to_pylist(), data.column("origins").to_pylist()


def _sample(row: dict) -> EncodedSample:
    return EncodedSample(row["input_ids"], row["labels"], row["origin"], row["truncated"],
                         row["origins"])


def sample_digest(input_ids, labels) -> bytes:
    """sha256 of one encoded sample's input_ids and labels (as int32)."""
    return hashlib.sha256(array("i", input_ids).tobytes() + array("i", labels).tobytes()).digest()


def fingerprint_samples(samples) -> dict:
    """Count and sha256 of encoded samples, in order (the sha256 of their digests): the value a
    checkpoint records, so that --resume notices changed training data."""
    digest = hashlib.sha256()
    count = 0
    if isinstance(samples, ArrowSamples):
        for chunk in samples.dataset.data.column("digest").chunks:
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
