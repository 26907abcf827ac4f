"""Streamed encoding: rows are read, normalised and encoded in chunks of CHUNK_ROWS, and each chunk
is written to its Arrow file as soon as it is encoded, so memory holds a few chunks, never the
dataset.

The parent reads each --data entry (a .jsonl file as raw lines), tells its format from the first
rows and hands the chunks to data.num_proc forked workers, at most two per worker in flight. A
worker parses, normalises (formats.normalise_rows), fills placeholders and encodes its chunk,
writes stage-NNNNN.arrow and returns what the loader reports (problems, notes, unused fields)
and, for each normalised sample, its row in the file, its problem, or (a pre-training document)
the sample itself. The parent keeps one integer per sample.

`#N` sampling, the mixing of several entries and the val_ratio split then pick sample numbers
with the same random calls on the same counts as reading.sample_rows and build_prepared pick
samples, so they choose exactly the same rows. A report whose rows are a run of stage files in
order uses those files; any other order is written out (arrow.write_taken). Pre-training
documents are tokenised by the workers into stage rows of their own and packed in the chosen
order, after the conversations, as encode_samples packs them.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arrow import map_samples, resolve_num_proc, write_samples, write_taken
from .encode import EncodedSample, EncodeReport, add_encoded, cut_documents, document_ids, encode_sample
from .reading import NormalisedRows, normalise_rows, open_spec, parse_items, report_spec, sample_indices

CHUNK_ROWS = 2000
"""Rows a worker reads, normalises and encodes at a time (a few MiB of text)."""
FIRST_CHUNK_ROWS = 64
IN_FLIGHT_PER_WORKER = 2
PROBLEM = -1
"""A sample with no encoded row: its problem is reported instead."""
_JOB: dict = {}
"""The tokenizer, settings and folder of the encoding in progress (forked workers read it)."""


@dataclass
class SpecsRead:
    """--data entries read: their samples' numbers (after `#N`, in order), and the loader's
    problems, warnings and (entry, format) pairs."""

    numbers: array = field(default_factory=lambda: array("q"))
    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    formats: list = field(default_factory=list)

    @property
    def items(self) -> array:
        """What a choice of rows is made of here: sample numbers (data.build_prepared)."""
        return self.numbers


@dataclass
class ChunkResult:
    file: str
    rows: int
    codes: bytes
    """array("q") per normalised sample: its row in `file`, or PROBLEM."""
    documents: bytes
    """array("b") per normalised sample: 1 for a pre-training document (its row holds its
    tokens, to be packed), else 0."""
    problems: dict
    truncated: dict
    read: NormalisedRows
    """The loader's report on the chunk (its samples left out)."""


def _encode_chunk(task: tuple) -> ChunkResult:
    """Parse (raw .jsonl lines), normalise and encode one chunk into its Arrow file."""
    file, path, items, fmt, entry, fill = task
    read = normalise_rows(parse_items(path, items), fmt, entry, fill)
    codes, documents, problems, truncated = array("q"), array("b"), {}, {}
    tokenizer, settings, written = _JOB["tokenizer"], _JOB["settings"], itertools.count()

    def encoded():
        for index, sample in enumerate(read.samples):
            documents.append(sample.text is not None)
            if sample.text is not None:
                found = []
                ids = document_ids(tokenizer, sample, found)
                if ids is None:
                    codes.append(PROBLEM)
                    problems[index] = found[0]
                    continue
                codes.append(next(written))
                yield EncodedSample(ids, ids, sample.origin)
                continue
            report = EncodeReport()
            add_encoded(report, sample, lambda sample=sample: encode_sample(tokenizer, sample, *settings))
            if report.problems:
                codes.append(PROBLEM)
                problems[index] = report.problems[0]
                continue
            if report.truncated:
                truncated[index] = sample.origin
            codes.append(next(written))
            yield report.samples[0]

    rows = write_samples(Path(_JOB["folder"]) / file, encoded())
    read.samples = []
    return ChunkResult(file, rows, codes.tobytes(), documents.tobytes(), problems, truncated, read)


class StreamedEncoding:
    """Every sample of the entries read so far, in stage Arrow files in read order; report()
    turns a choice of sample numbers into an EncodeReport. Use as a context manager."""

    def __init__(self, tokenizer, settings: tuple, folder: Path, num_proc: int):
        self.tokenizer, self.settings, self.folder = tokenizer, settings, Path(folder)
        self.processes, self.explicit = resolve_num_proc(num_proc, 2**31), bool(num_proc)
        self.rows = array("q")
        """Per sample: its row in the stage files, or PROBLEM."""
        self.documents = array("b")
        """Per sample: 1 for a pre-training document."""
        self.problems: dict = {}
        self.truncated: dict = {}
        self.files: list = []
        self.ranges: list = []
        self.row_count = 0
        self.file_numbers = itertools.count()
        self.report_files: dict[str, list] = {}
        self.pool: Any = None  # a multiprocessing pool, started with the second chunk
        self.held: tuple | None = None
        self.pending: deque = deque()
        self.used_processes = 1

    def __enter__(self):
        _JOB.update(tokenizer=self.tokenizer, settings=self.settings, folder=str(self.folder))
        return self

    def __exit__(self, *exc_info):
        if self.pool is not None:
            self.pool.terminate() if exc_info[0] else self.pool.close()
            self.pool.join()
        _JOB.clear()
        if exc_info[0] is None:
            used = {name for files in self.report_files.values() for name in files}
            for name in self.files:
                if name not in used:
                    (self.folder / name).unlink(missing_ok=True)

    def read_specs(self, specs: list, args, seed: int) -> SpecsRead:
        """--data entries read and mixed as load_samples mixes them (SFT rows)."""
        out = SpecsRead()
        fill = {"model_name": args.model_name, "model_author": args.model_author}
        for spec in specs:
            read = self.read_spec(spec, args.format, seed, fill)
            out.numbers += read.numbers
            out.problems += read.problems
            out.warnings += read.warnings
            out.formats += read.formats
        return out

    def read_spec(self, spec: str, row_format: str, seed: int, fill: dict) -> SpecsRead:
        """One --data entry, opened and reported by reading.py, its chunks encoded; on an error
        nothing of it is kept."""
        opened = open_spec(spec)
        fmt, label = opened.sft_format(row_format)
        first = len(self.rows)
        totals = NormalisedRows()
        try:
            for chunk in opened.chunks(self.chunk_sizes()):
                name = f"stage-{next(self.file_numbers):05d}.arrow"
                self.submit((name, opened.path, chunk, fmt, opened.entry, fill), totals)
            self.drain(totals)
            warnings, formats = report_spec(opened, fmt, label, totals, sum(self.documents[first:]), fill)
        except BaseException:
            self.drain(None)
            self.forget(first)
            raise
        read = SpecsRead(problems=totals.problems, formats=formats, warnings=warnings)
        samples = len(self.rows) - first
        read.numbers = (
            array("q", range(first, first + samples))
            if opened.count is None
            else array("q", (first + index for index in sample_indices(samples, opened.count, seed)))
        )
        return read

    def chunk_sizes(self):
        """CHUNK_ROWS at a time; with data.num_proc set above 1, the first chunks smaller
        (FIRST_CHUNK_ROWS, doubling), so that a small dataset is still encoded in parallel."""
        rows = FIRST_CHUNK_ROWS if self.explicit and self.processes > 1 else CHUNK_ROWS
        while True:
            yield rows
            rows = min(rows * 2, CHUNK_ROWS)

    def submit(self, task: tuple, totals: NormalisedRows) -> None:
        """Encode a chunk: in this process while one chunk is all there is, else in the pool."""
        if self.processes == 1:
            self.collect(_encode_chunk(task), totals)
            return
        if self.pool is None and self.held is None:
            self.held = task
            return
        if self.pool is None:
            self.pool = multiprocessing.get_context("fork").Pool(self.processes)
            self.used_processes = self.processes
        if self.held is not None:
            self.pending.append(self.pool.apply_async(_encode_chunk, (self.held,)))
            self.held = None
        self.pending.append(self.pool.apply_async(_encode_chunk, (task,)))
        while len(self.pending) > IN_FLIGHT_PER_WORKER * self.processes:
            self.collect(self.pending.popleft().get(), totals)

    def drain(self, totals: NormalisedRows | None) -> None:
        """Every chunk in flight collected, in order (None: waited for and dropped)."""
        if self.held is not None:
            task, self.held = self.held, None
            if totals is not None:
                self.collect(_encode_chunk(task), totals)
        while self.pending:
            result = self.pending.popleft()
            if totals is None:
                result.wait()
            else:
                self.collect(result.get(), totals)

    def collect(self, result: ChunkResult, totals: NormalisedRows) -> None:
        codes = array("q")
        codes.frombytes(result.codes)
        base, start = len(self.rows), self.row_count
        self.rows += array("q", (code + start if code >= 0 else code for code in codes))
        self.documents.frombytes(result.documents)
        for mine, theirs in ((self.problems, result.problems), (self.truncated, result.truncated)):
            mine.update((base + index, value) for index, value in theirs.items())
        self.files.append(result.file)
        self.ranges.append((start, start + result.rows))
        self.row_count += result.rows
        read = result.read
        totals.problems += read.problems
        totals.notes += read.notes
        totals.unfilled += read.unfilled
        for name, (origin, rows) in read.unused.items():
            totals.unused.setdefault(name, [origin, 0])[1] += rows

    def forget(self, first: int) -> None:
        """Samples from number `first` on are not kept (their rows stay, unused)."""
        del self.rows[first:], self.documents[first:]
        for kept in (self.problems, self.truncated):
            for number in [n for n in kept if n >= first]:
                del kept[number]

    def report(self, numbers, name: str) -> EncodeReport:
        """The samples `numbers` (in that order) encoded, as encode_samples reports them; the
        files are recorded in report_files[name]."""
        rows, documents = array("q"), array("q")
        problems: list = []
        document_problems: list = []
        truncated: list = []
        for number in numbers:
            code, document = self.rows[number], self.documents[number]
            if code == PROBLEM:
                (document_problems if document else problems).append(self.problems[number])
            elif document:
                documents.append(code)
            else:
                rows.append(code)
                if number in self.truncated:
                    truncated.append(self.truncated[number])
        problems += document_problems  # encode_samples packs the documents last
        files = self.run_of_files(rows)
        if files is None:
            files = write_taken(self.folder, self.files, rows, name, self.pool.map if self.pool is not None else map)
        else:  # named after the report they now belong to
            for index, stage in enumerate(files):
                files[index] = f"{name}-{index:05d}.arrow"
                os.replace(self.folder / stage, self.folder / files[index])
                self.files[self.files.index(stage)] = files[index]
        if documents:
            stage = map_samples(self.folder, self.files)
            tokenised = ((sample.input_ids, sample.origin) for sample in map(stage.__getitem__, documents))
            write_samples(self.folder / f"{name}-documents.arrow", cut_documents(tokenised, self.settings[0]))
            files.append(f"{name}-documents.arrow")
        self.report_files[name] = files
        return EncodeReport(
            map_samples(self.folder, files),  # type: ignore[arg-type]  # a read-only Sequence, read as the list it annotates
            truncated,
            problems,
        )

    def run_of_files(self, rows: array) -> list | None:
        """The stage files holding exactly `rows`, if they are consecutive whole files."""
        if not rows or rows != array("q", range(rows[0], rows[0] + len(rows))):
            return None
        first, stop = rows[0], rows[0] + len(rows)
        inside = [
            (name, end - start) for name, (start, end) in zip(self.files, self.ranges) if first <= start < end <= stop
        ]
        return [name for name, _ in inside] if sum(n for _, n in inside) == len(rows) else None
