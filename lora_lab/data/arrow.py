"""Encoded samples as Arrow files: written by worker processes, read back memory-mapped.

A list of normalised samples is cut into contiguous shards; each of data.num_proc processes
(forked, so the tokenizer and samples are shared, not pickled) encodes its shards with
encode.encode_sample and writes one Arrow file per shard. Shards keep the samples' order, so the
files, read in order, hold exactly what encode.encode_samples returns in one process, and the
problems come back in the same order. Pre-training documents are packed into rows in the parent
(packing crosses shards) and written last, as encode_samples appends them.

ArrowSamples reads such files through `datasets` (memory-mapped: the samples are not held in
memory) and gives EncodedSample objects one at a time; the lengths column answers packing and
length questions without reading a single token.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Sequence
from pathlib import Path

from .encode import EncodedSample, EncodeReport, add_encoded, encode_sample, pack_documents
from .formats import Problem

COLUMNS = ("input_ids", "labels", "origin", "truncated", "origins", "length", "trained")
WRITE_BATCH = 1000
MAX_NUM_PROC = 8
"""data.num_proc 0 (auto) uses the machine's cores up to this many: tokenising is CPU bound and
each worker holds its own copy of the tokenizer's state."""
SAMPLES_PER_WORKER = 2000
"""Auto num_proc starts no more workers than this many samples each keep busy (a fork costs
about as much as encoding a few hundred samples)."""
_JOB: dict = {}
"""What forked workers encode: set in the parent just before the pool starts."""


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
                     "trained": Value("int32")})


def write_samples(path: Path, samples) -> int:
    """EncodedSample objects into one Arrow file (the stream format `datasets` maps)."""
    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=features(), path=str(path))
    batch, count = {name: [] for name in COLUMNS}, 0
    for sample in samples:
        for name in COLUMNS[:5]:
            batch[name].append(getattr(sample, name))
        batch["length"].append(len(sample.input_ids))
        batch["trained"].append(sample.trained_tokens)
        count += 1
        if len(batch["origin"]) == WRITE_BATCH:
            writer.write_batch(batch)
            batch = {name: [] for name in COLUMNS}
    if batch["origin"] or not count:
        writer.write_batch(batch)
    writer.finalize()
    writer.close()
    return count


def _encode_shard(task: tuple) -> tuple[list, list]:
    """Encode samples[start:stop] into `path`: (problems, truncated origins) of the shard."""
    start, stop, path = task
    job = _JOB
    report = EncodeReport()

    def encoded():
        for sample in job["samples"][start:stop]:
            if sample.text is not None:
                continue
            add_encoded(report, sample, lambda: encode_sample(job["tokenizer"], sample,
                                                              *job["settings"]))
            while report.samples:
                yield report.samples.pop(0)

    write_samples(Path(path), encoded())
    return ([(p.origin, p.reason) for p in report.problems], report.truncated)


def encode_to_arrow(tokenizer, samples: list, settings: tuple, folder: Path, name: str,
                    num_proc: int) -> tuple[list, dict]:
    """Encode `samples` (settings = max_length, truncation, system, enable_thinking) into Arrow
    files `folder/NAME-00000.arrow` ... in `num_proc` processes (1: in this process).
    Returns the files in order and {"problems", "truncated"}, as encode_samples reports them."""
    folder = Path(folder)
    shards = max(1, min(len(samples), num_proc * 4)) if num_proc > 1 else 1
    bounds = [len(samples) * i // shards for i in range(shards + 1)]
    tasks = [(bounds[i], bounds[i + 1], str(folder / f"{name}-{i:05d}.arrow"))
             for i in range(shards)]
    _JOB.update(tokenizer=tokenizer, samples=samples, settings=settings)
    try:
        if num_proc > 1:
            with multiprocessing.get_context("fork").Pool(num_proc) as pool:
                results = pool.map(_encode_shard, tasks, chunksize=1)
        else:
            results = [_encode_shard(task) for task in tasks]
    finally:
        _JOB.clear()
    problems = [Problem(*p) for shard_problems, _ in results for p in shard_problems]
    truncated = [origin for _, shard_truncated in results for origin in shard_truncated]
    files = [Path(task[2]).name for task in tasks]
    documents = [s for s in samples if s.text is not None]
    if documents:
        rows = pack_documents(tokenizer, documents, settings[0], problems)
        write_samples(folder / f"{name}-documents.arrow", rows)
        files.append(f"{name}-documents.arrow")
    return files, {"problems": problems, "truncated": truncated}


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


def fingerprint_samples(samples) -> dict:
    """Count and sha256 of encoded samples, in order (input_ids and labels): the value a
    checkpoint records, so that --resume notices changed training data."""
    digest = hashlib.sha256()
    count = 0
    if isinstance(samples, ArrowSamples):
        for batch in samples.dataset.select_columns(["input_ids", "labels"]).iter(
                batch_size=WRITE_BATCH):
            for ids, labels in zip(batch["input_ids"], batch["labels"]):
                digest.update(json.dumps([ids, labels]).encode())
                count += 1
    else:
        for sample in samples:
            digest.update(json.dumps([sample.input_ids, sample.labels]).encode())
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

        largest = (pc.max(chunk.flatten()).as_py()
                   for chunk in samples.dataset.data.column("input_ids").chunks)
        if all(value is None or value < limit for value in largest):
            return None
    for sample in samples:
        ids = (sample.prompt_ids + sample.chosen_ids + (sample.rejected_ids or [])
               if hasattr(sample, "prompt_ids") else sample.input_ids)
        outside = [token for token in ids if token >= limit]
        if outside:
            return sample.origin, outside[0]
    return None
