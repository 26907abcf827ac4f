"""Read the rows of a dataset file exactly as written, each paired with its origin ("file:line").

One reader per file type: .jsonl (one row per line), .json (a list of rows, or one row object),
.csv (a header and one row per record) and .parquet; anything else is a hub dataset id. A row that
cannot be read (bad JSON, invalid UTF-8, a duplicate key, a lone surrogate, nesting too deep for
Python) becomes a `Bad` row with its reason, so the loader reports it by line and reads on. Only a
file that cannot be read at all raises DataError.

Streamed (stream=True), .jsonl, .csv, .parquet (a row group batch at a time), a .json list of
rows (JSON_BLOCK_BYTES of text at a time) and hub datasets (memory-mapped by `datasets`) come one
row at a time; a .json file holding one row object is read whole.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from ..paths import BUNDLED_DATA, bundled_data_dir

MAX_DEPTH = 100
"""Deepest nesting of lists and objects a row may have (real rows nest a handful of levels)."""
CSV_JSON_COLUMNS = {"messages", "conversations", "conversation", "history", "chosen", "rejected"}
"""CSV columns that hold JSON (a list or object); every other cell is kept as its exact text."""
_SURROGATE = re.compile("[\ud800-\udfff]")
BLANK = object()
"""jsonl_row's answer for a blank line (a line may hold JSON null)."""


class Bad:
    """A row that could not be read, with the reason."""

    def __init__(self, reason: str):
        self.reason = reason


class _Object(dict):
    """A JSON object that remembers the keys it held more than once."""

    duplicates: tuple = ()


def _object_pairs(pairs):
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen, twice = set(), []
        for key, _ in pairs:
            if key in seen and key not in twice:
                twice.append(key)
            seen.add(key)
        obj.duplicates = tuple(twice)
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_object_pairs)


def value_problem(value) -> str | None:
    """Why a parsed value cannot be used as written: a key given twice (JSON keeps only the last,
    so the row would silently lose text), a lone surrogate, or nesting deeper than MAX_DEPTH."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH and isinstance(item, (dict, list)):
            return f"nested more than {MAX_DEPTH} levels deep"
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return (
                    f"contains a lone surrogate \\u{ord(found.group()):04x}, which is not "
                    f"valid Unicode; fix the escape sequence"
                )
        elif isinstance(item, dict):
            twice = getattr(item, "duplicates", ())
            if twice:
                return (
                    f"key `{twice[0]}` appears twice in one object; JSON keeps only the last "
                    f"value, so remove or rename one"
                )
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return None


def parse_json_text(text: str):
    """A JSON value read strictly: returns the value, or Bad with the reason."""
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        return Bad(f"bad JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})")
    except RecursionError:
        return Bad(f"nested too deeply to read (more than {MAX_DEPTH} levels)")
    problem = value_problem(value)
    return Bad(problem) if problem else value


def read_rows(source: str, warnings: list | None = None, stream: bool = False) -> list[tuple[object, str]]:
    """Rows of a file or hub dataset, each paired with its origin ("file.jsonl:3").

    File-level remarks (byte-order mark, CRLF, final newline) are appended to `warnings`.
    stream=True: a .jsonl file's rows come one line at a time (an iterator), never all held."""
    warnings = warnings if warnings is not None else []
    path = source_path(source)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".csv", ".parquet"):
        if not path.is_file():
            raise DataError(f"--data {source}: file not found.")
        if suffix != ".parquet":
            warnings += text_file_warnings(path)
        if suffix == ".json":
            return read_json(path, warnings, stream)
        rows = {".jsonl": iter_jsonl, ".csv": lambda p: iter_csv(p, warnings), ".parquet": iter_parquet}[suffix](path)
        return rows if stream else list(rows)
    if path.exists() or source.startswith((".", "/", "~")):
        raise DataError(f"--data {source}: unsupported file type; use .jsonl, .json, .csv or .parquet.")
    rows = iter_hub(source)
    return rows if stream else list(rows)


def source_path(source: str) -> Path:
    """The file a --data source names (a bundled dataset's name: the file lora-lab ships)."""
    return bundled_data_dir() / BUNDLED_DATA[source] if source in BUNDLED_DATA else Path(source).expanduser()


def text_file_warnings(path: Path) -> list:
    """A byte-order mark; in JSONL also CRLF endings, blank lines, no final newline. All are
    read correctly: they are warnings, not errors."""
    found, crlf, blank, last, number = [], [], [], b"\n", 0
    with open(path, "rb") as handle:
        if handle.read(3) == b"\xef\xbb\xbf":
            found.append(
                Problem(
                    f"{path}:1",
                    "the file starts with a UTF-8 byte-order mark; it is skipped and the row read correctly",
                )
            )
        if path.suffix.lower() != ".jsonl":
            return found  # CSV uses CRLF by its standard; JSON ignores whitespace
        handle.seek(0)
        for number, raw in enumerate(handle, start=1):
            crlf += [number] if raw.endswith(b"\r\n") else []
            blank += [number] if not raw.strip() else []
            last = raw
    if crlf:
        found.append(
            Problem(
                f"{path}:{crlf[0]}",
                f"{len(crlf)} line(s) end with CRLF (Windows line endings); they are read correctly",
            )
        )
    if blank:
        found.append(Problem(f"{path}:{blank[0]}", f"{len(blank)} blank line(s) ignored"))
    if not last.endswith(b"\n"):
        found.append(
            Problem(
                f"{path}:{number}",
                "no newline at the end of the file; the last row is read, but check the file is not cut short",
            )
        )
    return found


def iter_jsonl(path: Path):
    """(row, origin) of every non-blank line, read one line at a time."""
    for number, raw in iter_lines(path):
        row = jsonl_row(raw, number)
        if row is not BLANK:
            yield row, f"{path}:{number}"


def iter_lines(path: Path):
    """(line number, bytes) of every line of a file, one at a time."""
    with open(path, "rb") as handle:
        yield from enumerate(handle, start=1)


def jsonl_row(raw: bytes, number: int):
    """Line `number` of a .jsonl file as a row (a value or Bad); BLANK for a blank line."""
    if number == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Bad(f"invalid UTF-8 at byte {exc.start}")
    return parse_json_text(text) if text.strip() else BLANK


JSON_BLOCK_BYTES = 1 << 20
"""A .json list of rows is read this many bytes at a time."""


def read_json(path: Path, warnings: list, stream: bool = False):
    """A JSON list of rows, each with the line its object starts on (stream=True: an iterator
    that holds one block of the file and the row being read, never the whole list); or one row
    object, which is read whole."""
    window = _TextWindow(path)
    start = window.skip_space(0)
    if window.text[start : start + 1] == "[":
        rows = _iter_json_list(path, window, start + 1)
        return rows if stream else list(rows)
    while window.more():
        pass
    text = window.text
    value = parse_json_text(text)
    if isinstance(value, Bad):
        raise DataError(
            f"{path}: {value.reason}. A .json file must hold a list of rows; use .jsonl for one row per line."
        )
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON list of rows, got {kind_of(value)}.")
    line = text.count("\n", 0, start) + 1
    warnings.append(
        _warning(f"{path}:{line}", "the file holds one row object, not a list of rows; it is read as one row")
    )
    return [(value, f"{path}:{line}")]


class _TextWindow:
    """The decoded text of a file from some line on: `text` starts at the beginning of line
    `first_line`; more() reads the next block, drop(position) forgets whole lines before
    position."""

    def __init__(self, path: Path):
        import codecs

        self.path, self.handle = path, open(path, "rb")
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.text, self.first_line, self.eof = "", 1, False
        self.bytes_read = self.newlines_read = 0
        self.counted = (0, 1)  # (position, its line): rows are read in order, lines counted once
        self.more()

    def more(self) -> bool:
        """Read the next block; False at the end of the file."""
        if self.eof:
            return False
        raw = self.handle.read(JSON_BLOCK_BYTES)
        self.eof = not raw
        pending = len(self.decoder.getstate()[0])
        try:
            self.text += self.decoder.decode(raw, final=self.eof)
        except UnicodeDecodeError as exc:
            self.handle.close()
            at = max(0, exc.start - pending)
            line = self.newlines_read + raw[:at].count(b"\n") + 1
            raise DataError(
                f"{self.path}:{line}: invalid UTF-8 at byte "
                f"{self.bytes_read + at}; save the file as UTF-8 (or as .jsonl, "
                f"where a bad row is skipped and reported)."
            ) from None
        finally:
            self.bytes_read += len(raw)
            self.newlines_read += raw.count(b"\n")
        if self.eof:
            self.handle.close()
        return not self.eof

    def skip_space(self, position: int) -> int:
        while True:
            position = _skip_space(self.text, position)
            if position < len(self.text) or not self.more():
                return position

    def drop(self, position: int) -> int:
        """Forget the lines that end before `position`; returns where position now is."""
        cut = self.text.rfind("\n", 0, position) + 1
        if cut < JSON_BLOCK_BYTES:  # a block's worth at a time: dropping stays linear
            return position
        self.first_line += self.text.count("\n", 0, cut)
        self.text = self.text[cut:]
        self.counted = (0, self.first_line)
        return position - cut

    def line_of(self, position: int) -> int:
        start, line = self.counted if self.counted[0] <= position else (0, self.first_line)
        line += self.text.count("\n", start, position)
        self.counted = (position, line)
        return line


def _iter_json_list(path: Path, window: _TextWindow, position: int):
    try:
        yield from _json_list_rows(path, window, position)
    finally:
        window.handle.close()


def _json_list_rows(path: Path, window: _TextWindow, position: int):
    """(row, origin): "file.json:LINE", and ", row N" (N counted from 1) for a row that starts on
    the same line as the row before it (a list written on one line)."""
    row, last_line = 0, 0
    while True:
        position = window.drop(window.skip_space(position))
        if window.text[position : position + 1] == "]":
            break
        if position >= len(window.text):
            raise DataError(f"{path}:{window.line_of(position)}: bad JSON (the list of rows is never closed).")
        line = window.line_of(position)
        while True:
            try:
                value, end = _DECODER.raw_decode(window.text, position)
                if end == len(window.text) and window.more():
                    continue  # a number cut by the block's end reads as a shorter number
                break
            except json.JSONDecodeError as exc:
                if window.more():  # the row may go on in the next block (a bad row is
                    continue  # only known as such at the end of the file)
                raise DataError(
                    f"{path}:{window.first_line + exc.lineno - 1}: bad JSON "
                    f"({exc.msg} at column {exc.colno}); fix the file (or use "
                    f".jsonl, where a bad line is skipped and reported)."
                ) from None
            except RecursionError:  # skip to the end of this row and read on
                closed = _end_of_value(window.text, position)
                if closed is None and window.more():
                    continue
                if closed is None:
                    raise DataError(f"{path}:{line}: bad JSON (a row is never closed).") from None
                end = closed
                value = Bad(f"nested too deeply to read (more than {MAX_DEPTH} levels)")
                break
        problem = None if isinstance(value, Bad) else value_problem(value)
        row += 1
        origin = f"{path}:{line}" + (f", row {row}" if line == last_line else "")
        last_line = line
        yield (Bad(problem) if problem else value), origin
        position = _after_row(path, window, end)
    trailing = window.skip_space(position + 1)
    if trailing < len(window.text):
        raise DataError(f"{path}:{window.line_of(trailing)}: extra data after the list of rows.")


def _after_row(path: Path, window: _TextWindow, position: int) -> int:
    """Past the `,` after a row; at the `]` after the last one."""
    position = window.skip_space(position)
    if window.text[position : position + 1] == ",":
        return position + 1
    if window.text[position : position + 1] != "]":
        raise DataError(f"{path}:{window.line_of(position)}: bad JSON (expected `,` or `]` after a row).")
    return position


def _end_of_value(text: str, position: int) -> int | None:
    """The index just past the list or object starting at `position` (strings respected)."""
    depth, in_string, escaped = 0, False, False
    for index in range(position, len(text)):
        char = text[index]
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def iter_csv(path: Path, warnings: list | None = None):
    """Rows of a CSV file, one record at a time, origin = the line the record starts on (the
    header is line 1); a note on blank lines is appended to `warnings` at the end.

    Cells keep their exact text, except the columns in CSV_JSON_COLUMNS, which must hold JSON.
    Invalid UTF-8 is decoded with surrogateescape so the rest of the file is still read, and the
    row holding it is reported."""
    csv.field_size_limit(2**31 - 1)  # a long document is data, not an attack: read it whole
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        yield from _csv_records(path, csv.reader(handle), warnings)


def _csv_records(path: Path, reader, warnings: list | None):
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise DataError(f"{path}:1: the CSV header cannot be read ({exc}).") from None
    if header is None:
        return
    if any(_SURROGATE.search(name) for name in header):
        raise DataError(f"{path}:1: the CSV header is not valid UTF-8; save the file as UTF-8.")
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise DataError(
            f"{path}:1: column `{twice[0]}` appears twice in the CSV header; rename "
            f"one, or a row would keep only the last cell."
        )
    blank: list = []  # [origin of the first blank line, count]
    start = reader.line_num + 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            yield Bad(f"the CSV record cannot be read ({exc})"), f"{path}:{start}"
            start = reader.line_num + 1
            continue
        origin, start = f"{path}:{start}", reader.line_num + 1
        if cells:
            yield _csv_row(header, cells), origin
        elif not blank:
            blank = [origin, 1]
        else:
            blank[1] += 1
    if blank and warnings is not None:
        warnings.append(_warning(blank[0], f"{blank[1]} blank line(s) ignored"))


def _csv_row(header: list, cells: list):
    if len(cells) != len(header):
        return Bad(f"the record has {len(cells)} cells but the header has {len(header)} columns")
    row = {}
    for name, cell in zip(header, cells):
        if _SURROGATE.search(cell):
            return Bad(f"column `{name}` is not valid UTF-8; save the file as UTF-8")
        if name in CSV_JSON_COLUMNS:  # an empty cell is an absent value
            value = parse_json_text(cell) if cell.strip() else None
            if isinstance(value, Bad):
                return Bad(f"column `{name}` must hold JSON: {value.reason}")
            cell = value
        row[name] = cell
    return row


def iter_parquet(path: Path, batch_rows: int = 1000):
    """Rows of a Parquet file, `batch_rows` at a time, origin = "file[row N]"."""

    def unreadable(exc):
        return DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {str(exc)[:200]}).")

    try:
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
    except Exception as exc:
        raise unreadable(exc) from None
    index = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:
            raise unreadable(exc) from None
        if batch is None:
            return
        for row in batch.to_pylist():
            yield row, f"{path}[row {index}]"
            index += 1


def iter_hub(source: str):
    """Rows of a hub dataset (NAME or NAME:SPLIT), loaded now, given one at a time."""
    name, _, split = source.partition(":")
    try:
        import datasets

        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:
        raise DataError(
            f"--data {source}: not a local file, and loading it as a hub dataset "
            f"failed ({type(exc).__name__}: {str(exc)[:200]}). Check the path or "
            f"the dataset id (NAME or NAME:SPLIT)."
        ) from None
    return ((row, f"{source}[row {index}]") for index, row in enumerate(dataset))


def kind_of(value) -> str:
    """'a number (0)', 'a list', 'an object' ... for messages about a value of the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "text"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else "a list"
    return type(value).__name__


@dataclass
class Problem:
    """Something about a row or file, with where it is ("file.jsonl:12")."""

    origin: str
    reason: str

    def __str__(self):
        return f"{self.origin}: {self.reason}"


def _warning(origin: str, reason: str) -> Problem:
    return Problem(origin, reason)
