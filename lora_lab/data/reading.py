"""The one reader of --data entries (files, hub datasets, dataset_info.json entries).

An entry is opened once (open_spec: `#N` parsed, the file found, its rows up to the first object
read to tell the format), its rows taken in chunks (a .jsonl file as raw lines, parsed by
parse_items, in a worker process when the encoding is streamed), normalised (normalise_rows, or
pairs.py for preference rows) and reported (report_spec: warnings, the format line, the bundled
identity set's check). Every reader goes through these: the streamed encoding of a run and of
the data commands (stream.StreamedEncoding.read_spec), load_dataset_spec (samples held in
memory: validation without a model, evaluation, calibration) and pairs.load_preference_spec.
`#N` sampling (sample_indices) picks the same rows in all of them.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import identity_problem
from ..errors import DataError
from ..paths import IDENTITY_DATA
from .formats import detect_format, normalise_row, unknown_fields, unused_field_warnings
from .placeholders import fill_placeholders
from .readers import BLANK, Problem, iter_lines, jsonl_row, read_rows, source_path, text_file_warnings

if TYPE_CHECKING:
    from .dataset_info import DatasetInfoEntry

__all__ = ["LoadedData", "load_dataset_spec", "open_spec", "parse_spec", "sample_rows"]


@dataclass
class LoadedData:
    """--data entries read into memory."""

    samples: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    """Rows that could not be used, each with file:line and reason."""
    warnings: list = field(default_factory=list)
    """Things read correctly but worth knowing, with file:line."""
    formats: list = field(default_factory=list)
    """(--data entry, detected row format) for each dataset."""

    @property
    def items(self) -> list:
        """What a choice of rows is made of here: the samples (data.build_prepared)."""
        return self.samples


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'data.jsonl#500' -> ('data.jsonl', 500)."""
    match = re.fullmatch(r"(.+)#(\d+)", spec.strip())
    if match:
        return match.group(1), int(match.group(2))
    return spec.strip(), None


@dataclass
class NormalisedRows:
    """Rows normalised in order: the samples, and what the reader reports about them."""

    samples: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    """Remarks on rows read correctly (Sample.notes), in row order."""
    unused: dict = field(default_factory=dict)
    """Field the format does not read -> [origin of its first row, rows holding it]."""
    unfilled: list = field(default_factory=list)
    """Rows that keep a {{NAME}} / {{AUTHOR}} placeholder."""


def normalise_rows(
    raw_rows, fmt: str, entry=None, fill: dict | None = None, require_reply: bool = True
) -> NormalisedRows:
    """(row, origin) pairs -> samples (placeholders filled from `fill`); a row that cannot be
    used is a problem with its origin. require_reply=False: prompts (formats.normalise_row)."""
    out = NormalisedRows()
    for row, origin in raw_rows:
        for name in [] if entry else unknown_fields(row, fmt):
            seen = out.unused.setdefault(name, [origin, 0])
            seen[1] += 1
        try:
            sample = normalise_row(entry.remap(row) if entry else row, fmt, origin, require_reply)
        except DataError as exc:
            out.problems.append(Problem(origin, str(exc)))
            continue
        except RecursionError:
            out.problems.append(Problem(origin, "nested too deeply to read"))
            continue
        out.samples.append(sample)
        out.notes += [Problem(origin, note) for note in sample.notes]
    out.unfilled = fill_placeholders(out.samples, fill or {})
    return out


def identity_unfilled(spec: str, source: str, fill: dict) -> DataError:
    """A bundled identity set exists to be filled (resolve_config says so first)."""
    problem = identity_problem([source], fill.get("model_name"), fill.get("model_author"))
    return DataError(f"--data {spec}: {problem}")


@dataclass
class OpenedSpec:
    """One --data entry, opened: where its rows come from and the first of them."""

    spec: str
    source: str
    count: int | None
    """`#N`: how many samples to take (None: all)."""
    entry: DatasetInfoEntry | None
    """The dataset_info.json entry whose columns the rows are mapped from, if any."""
    path: str | None
    """A .jsonl file whose rows are raw (line number, bytes) pairs, parsed by parse_items."""
    head: list
    """(row, origin) pairs up to the first object: what tells the format."""
    items: object
    """Every row again (the head included), read as it is taken."""
    warnings: list
    """Remarks on the file (byte-order mark, CRLF); a .csv adds to them as it is read."""

    def sft_format(self, row_format: str) -> tuple[str, str]:
        """The rows' format (--format, the entry's, or detected) and the line that names it."""
        if self.entry:
            return self.entry.row_format(self.head, self.spec), self.entry.describe()
        fmt = row_format if row_format != "auto" else detect_format(self.head, self.spec)
        return fmt, fmt if row_format == "auto" else f"{fmt} (--format)"

    def chunks(self, sizes):
        """Lists of the entry's items, of the sizes `sizes` yields, until the rows run out."""
        for rows in sizes:
            chunk = list(itertools.islice(self.items, rows))
            if not chunk:
                return
            yield chunk


def open_spec(spec: str) -> OpenedSpec:
    """An entry opened: a .jsonl file is read as lines, anything else through read_rows."""
    from .dataset_info import DatasetInfoEntry

    source, count = parse_spec(spec)
    warnings: list = []
    entry = DatasetInfoEntry.from_source(source)
    path = None if entry else source_path(source)
    if path is not None and path.suffix.lower() == ".jsonl" and path.is_file():
        warnings += text_file_warnings(path)
        head, items = peek_lines(path)
    else:
        path = None
        rows = entry.read_rows(warnings, stream=True) if entry else read_rows(source, warnings, stream=True)
        head, items = peek_rows(rows)
    if not head:
        raise DataError(f"--data {spec}: the dataset has no rows.")
    return OpenedSpec(spec, source, count, entry, None if path is None else str(path), head, items, warnings)


def parse_items(path: str | None, items):
    """(row, origin) pairs of a chunk of an entry's items: a .jsonl file's raw lines parsed,
    blank lines skipped."""
    if path is None:
        yield from items
        return
    for number, raw in items:
        row = jsonl_row(raw, number)
        if row is not BLANK:
            yield row, f"{path}:{number}"


def report_spec(opened: OpenedSpec, fmt: str, label: str, rows: NormalisedRows, pretraining: int, fill: dict):
    """(warnings, formats) of an entry whose rows are normalised into `rows`; a bundled
    identity set left unfilled is refused."""
    if rows.unfilled and opened.source in IDENTITY_DATA:
        raise identity_unfilled(opened.spec, opened.source, fill)
    if pretraining and fmt != "text":
        label += f" ({pretraining} pre-training rows)"
    warnings = opened.warnings + rows.notes + unused_field_warnings(rows.unused, fmt) + rows.unfilled
    return warnings, [(opened.spec, label)]


def load_dataset_spec(spec: str, row_format: str = "auto", seed: int = 42, fill: dict | None = None) -> LoadedData:
    """One --data entry read into memory: its rows normalised, `#N` sampled."""
    fill = fill or {}
    opened = open_spec(spec)
    fmt, label = opened.sft_format(row_format)
    rows = normalise_rows(parse_items(opened.path, opened.items), fmt, opened.entry, fill)
    pretraining = sum(1 for s in rows.samples if s.text is not None)
    warnings, formats = report_spec(opened, fmt, label, rows, pretraining, fill)
    samples = rows.samples if opened.count is None else sample_rows(rows.samples, opened.count, seed)
    return LoadedData(samples, rows.problems, warnings, formats)


def peek_lines(path: Path) -> tuple[list, object]:
    """The rows of a .jsonl file up to its first object (parsed), and every (line number,
    bytes) pair again, as an iterator that reads the rest only when it gets there."""
    lines = iter_lines(path)
    head, seen = [], []
    for number, raw in lines:
        seen.append((number, raw))
        row = jsonl_row(raw, number)
        if row is BLANK:
            continue
        head.append((row, f"{path}:{number}"))
        if isinstance(row, dict):
            break
    return head, itertools.chain(seen, lines)


def peek_rows(rows) -> tuple[list, object]:
    """The rows up to and including the first object (all of them if none is), and every row
    again, as an iterator that reads the rest only when it gets there."""
    rows = iter(rows)
    head = []
    for row in rows:
        head.append(row)
        if isinstance(row[0], dict):
            break
    return head, itertools.chain(head, rows)


def sample_rows(samples: list, count: int, seed: int) -> list:
    """`#N`: N rows; past the dataset size whole copies plus a random remainder."""
    return [samples[i] for i in sample_indices(len(samples), count, seed)]


def sample_indices(rows: int, count: int, seed: int) -> list:
    """The rows `#N` takes out of `rows`, in order (random.sample picks by index, so the rows
    are the same whether it is given the samples or their indices)."""
    if not rows:
        return []
    whole, remainder = divmod(count, rows)
    return list(range(rows)) * whole + random.Random(seed).sample(range(rows), remainder)
