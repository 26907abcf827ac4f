"""Read datasets and normalise every row to one shape: {"messages": [...], "tools": [...]}.

Four row formats are understood (detected per dataset, or forced with --format):
  messages        {"messages": [{"role": "system|user|assistant|tool", "content": ...,
                   "tool_calls": [...]}], "tools": [...]}                (OpenAI style)
  sharegpt        {"conversations": [{"from": "human|gpt|system|function_call|observation",
                   "value": ...}], "system": ..., "tools": ...}
  alpaca          {"instruction", "input", "output", "system", "history": [[q, a], ...]}
  query-response  {"query", "response", "system", "history": [[q, a], ...]}
Files: .jsonl, .json (a list of rows), .csv and .parquet; anything else is a hub dataset id.
Every row keeps its origin ("file.jsonl:12") so problems can be reported by line.

A problem is an error when the row cannot be trained on as written (bad JSON, invalid UTF-8, a
missing field, an unknown role, roles out of order, an empty reply, no final assistant turn): the
row is not used. It is a warning when the row is read correctly anyway: a byte-order mark, CRLF
line endings, no newline at the end of the file, blank lines, fields the format does not use.
"""
from __future__ import annotations

import csv
import difflib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import bundled_data_dir
from ..errors import DataError

BUNDLED = {"self-cognition": "self_cognition.jsonl"}
FORMATS = ("messages", "sharegpt", "alpaca", "query-response")
PLACEHOLDERS = {"{{NAME}}": "model_name", "{{AUTHOR}}": "model_author"}
KNOWN_FIELDS = {"messages": {"messages", "tools"},
                "sharegpt": {"conversations", "system", "tools"},
                "alpaca": {"instruction", "input", "output", "system", "history"},
                "query-response": {"query", "response", "system", "history"}}
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id", "name"}
TURN_FIELDS = {"from", "value"}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "observation": "tool", "tool": "tool",
                   "function_call": "assistant"}


@dataclass
class Sample:
    """One conversation, normalised, with the place it came from."""
    messages: list
    origin: str
    tools: list | None = None


@dataclass
class Problem:
    origin: str
    reason: str

    def __str__(self):
        return f"{self.origin}: {self.reason}"


@dataclass
class LoadedData:
    samples: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    """Rows that could not be used, each with file:line and reason."""
    warnings: list = field(default_factory=list)
    """Things read correctly but worth fixing (BOM, CRLF, unused fields), with file:line."""


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'data.jsonl#500' -> ('data.jsonl', 500)."""
    match = re.fullmatch(r"(.+)#(\d+)", spec.strip())
    if match:
        return match.group(1), int(match.group(2))
    return spec.strip(), None


def load_dataset_spec(spec: str, row_format: str = "auto", seed: int = 42,
                      fill: dict | None = None) -> LoadedData:
    """Read one --data entry, normalise its rows, sample `#N` if asked."""
    source, count = parse_spec(spec)
    loaded = LoadedData()
    raw_rows = read_rows(source, loaded.warnings)
    if not raw_rows:
        raise DataError(f"--data {spec}: the dataset has no rows.")
    fmt = row_format if row_format != "auto" else detect_format(raw_rows, source)
    unused: dict = {}
    for row, origin in raw_rows:
        try:
            loaded.samples.append(normalise_row(row, fmt, origin))
        except DataError as exc:
            loaded.problems.append(Problem(origin, str(exc)))
        for name in unknown_fields(row, fmt):
            unused.setdefault(name, []).append(origin)
    loaded.warnings += unused_field_warnings(unused, fmt)
    fill_placeholders(loaded.samples, fill or {}, spec)
    if count is not None:
        loaded.samples = sample_rows(loaded.samples, count, seed)
    return loaded


def read_rows(source: str, warnings: list | None = None) -> list[tuple[object, str]]:
    """Rows of a file or hub dataset, each paired with its origin ("file.jsonl:3").

    File-level remarks (byte-order mark, CRLF, final newline) are appended to `warnings`."""
    if source in BUNDLED:
        path = bundled_data_dir() / BUNDLED[source]
    else:
        path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".csv", ".parquet"):
        if not path.is_file():
            raise DataError(f"--data {source}: file not found.")
        reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv,
                  ".parquet": _read_parquet}[suffix]
        if suffix != ".parquet" and warnings is not None:
            warnings += text_file_warnings(path)
        return reader(path)
    if path.exists() or source.startswith((".", "/", "~")):
        raise DataError(f"--data {source}: unsupported file type; use .jsonl, .json, .csv or "
                        f".parquet.")
    return _read_hub(source)


def text_file_warnings(path: Path) -> list:
    """A byte-order mark; in JSONL also CRLF endings, blank lines, no final newline. All are
    read correctly: they are warnings, not errors."""
    found, crlf, blank, last, number = [], [], [], b"\n", 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                found.append(Problem(f"{path}:1", "the file starts with a UTF-8 byte-order mark; "
                                                  "it is skipped and the row read correctly"))
            crlf += [number] if raw.endswith(b"\r\n") else []
            blank += [number] if not raw.strip() else []
            last = raw
    if path.suffix.lower() != ".jsonl":
        return found  # CSV uses CRLF by its standard; JSON ignores whitespace
    if crlf:
        found.append(Problem(f"{path}:{crlf[0]}", f"{len(crlf)} line(s) end with CRLF (Windows "
                                                  f"line endings); they are read correctly"))
    if blank:
        found.append(Problem(f"{path}:{blank[0]}", f"{len(blank)} blank line(s) ignored"))
    if not last.endswith(b"\n"):
        found.append(Problem(f"{path}:{number}", "no newline at the end of the file; the last "
                                                 "row is read, but check the file is not cut "
                                                 "short"))
    return found


def _read_jsonl(path: Path) -> list:
    rows = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            origin = f"{path}:{number}"
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                rows.append((_Bad(f"invalid UTF-8 at byte {exc.start}"), origin))
                continue
            if not text.strip():
                continue
            try:
                rows.append((json.loads(text), origin))
            except json.JSONDecodeError as exc:
                rows.append((_Bad(f"bad JSON ({exc.msg.removesuffix(' at')} at column "
                                  f"{exc.colno})"), origin))
    return rows


def _read_json(path: Path) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc}). A .json file must hold a list of rows; "
                        f"use .jsonl for one row per line.") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows.")
    return [(row, f"{path}[{index}]") for index, row in enumerate(data)]


def _read_csv(path: Path) -> list:
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        start = 2
        for row in reader:
            rows.append(({k: _maybe_json(v) for k, v in row.items() if k}, f"{path}:{start}"))
            start = reader.line_num + 1
    return rows


def _read_parquet(path: Path) -> list:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [(row, f"{path}[row {index}]") for index, row in enumerate(table)]


def _read_hub(source: str) -> list:
    name, _, split = source.partition(":")
    try:
        import datasets

        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - any hub/network failure becomes one message
        raise DataError(f"--data {source}: not a local file, and loading it as a hub dataset "
                        f"failed ({type(exc).__name__}: {str(exc)[:200]}). Check the path or "
                        f"the dataset id (NAME or NAME:SPLIT).") from None
    return [(row, f"{source}[row {index}]") for index, row in enumerate(dataset)]


def _maybe_json(value):
    """CSV cells holding JSON (history, messages) are decoded; others stay text."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


class _Bad:
    """A row that could not even be parsed."""

    def __init__(self, reason):
        self.reason = reason


def detect_format(rows: list, source: str) -> str:
    for row, _ in rows:
        if not isinstance(row, dict):
            continue
        if "messages" in row:
            return "messages"
        if "conversations" in row:
            return "sharegpt"
        if "instruction" in row:  # output / response may be absent in inference prompts
            return "alpaca"
        if "query" in row:
            return "query-response"
        keys = ", ".join(sorted(row))
        raise DataError(f"--data {source}: cannot tell the row format from its fields ({keys}). "
                        f"Expected messages, conversations, instruction/output or "
                        f"query/response; or pass --format.")
    row, origin = rows[0]
    reason = row.reason if isinstance(row, _Bad) else f"expected an object, got {type(row).__name__}"
    raise DataError(f"--data {source}: no row could be parsed ({len(rows)} rows; first: "
                    f"{origin}: {reason}).")


def normalise_row(row, fmt: str, origin: str, require_reply: bool = True) -> Sample:
    """One raw row -> Sample. With require_reply=False (inference prompts) a conversation may
    end with the user; a final assistant reply, if any, is kept as the reference."""
    if isinstance(row, _Bad):
        raise DataError(row.reason)
    if not isinstance(row, dict):
        raise DataError(f"expected an object, got {type(row).__name__}")
    if fmt == "messages":
        messages = _messages_from_openai(row)
    elif fmt == "sharegpt":
        messages = _messages_from_sharegpt(row)
    else:
        prompt, reply = ("instruction", "output") if fmt == "alpaca" else ("query", "response")
        if not (fmt == "alpaca" and row.get("input")):
            _require(row, prompt)
        if require_reply:
            _require(row, reply)
        messages = _messages_from_pairs(row, fmt)
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    if not require_reply and messages and messages[-1]["role"] == "assistant" and not (
            messages[-1]["content"].strip() or messages[-1].get("tool_calls")):
        messages = messages[:-1]
    check_messages(messages, require_reply)
    return Sample(messages=messages, origin=origin, tools=tools or None)


def unknown_fields(row, fmt: str) -> list[str]:
    """Fields the format does not read ("id", "messages[].weight"): ignored, reported."""
    if not isinstance(row, dict):
        return []
    names = sorted(set(row) - KNOWN_FIELDS[fmt])
    nested = {"messages": ("messages", MESSAGE_FIELDS), "sharegpt": ("conversations", TURN_FIELDS)}
    if fmt in nested and isinstance(row.get(nested[fmt][0]), list):
        key, known = nested[fmt]
        extra = {k for turn in row[key] if isinstance(turn, dict) for k in turn} - known
        names += [f"{key}[].{k}" for k in sorted(extra)]
    return names


def unused_field_warnings(unused: dict, fmt: str) -> list:
    """One warning per unknown field: where it first appears, how often, a likely spelling."""
    warnings = []
    for name, origins in unused.items():
        known = KNOWN_FIELDS[fmt] | (MESSAGE_FIELDS if fmt == "messages" else TURN_FIELDS)
        close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(known), n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        more = f" ({len(origins)} rows)" if len(origins) > 1 else ""
        warnings.append(Problem(origins[0], f"field `{name}` is not used by the {fmt} format and "
                                            f"was ignored{more}{hint}"))
    return warnings


def _require(row: dict, name: str) -> None:
    if name not in row or row[name] is None:
        raise DataError(f"missing field `{name}`")


def _messages_from_openai(row: dict) -> list:
    _require(row, "messages")
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise DataError("field `messages` must be a list")
    out = []
    for index, turn in enumerate(messages, start=1):
        if not isinstance(turn, dict) or "role" not in turn:
            raise DataError(f"message {index}: missing field `role`")
        if turn.get("content") is None and not turn.get("tool_calls"):
            raise DataError(f"message {index}: missing field `content`")
        message = {"role": turn["role"], "content": turn.get("content") or ""}
        if turn.get("tool_calls"):
            message["tool_calls"] = [_tool_call(c) for c in turn["tool_calls"]]
        out.append(message)
    return out


def _tool_call(call) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or "name" not in function:
        raise DataError("a tool call needs a function `name`")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise DataError(f"tool call `{function['name']}`: arguments are not JSON") from None
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _messages_from_sharegpt(row: dict) -> list:
    _require(row, "conversations")
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise DataError("field `conversations` must be a list")
    out = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for index, turn in enumerate(turns, start=1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in _SHAREGPT_ROLES:
            raise DataError(f"turn {index}: unknown speaker {speaker!r}; expected one of "
                            f"{', '.join(_SHAREGPT_ROLES)}")
        if turn.get("value") is None:
            raise DataError(f"turn {index}: missing field `value`")
        value = turn["value"]
        if speaker == "function_call":
            try:
                call = json.loads(value)
            except json.JSONDecodeError:
                raise DataError("function_call value is not JSON") from None
            calls = call if isinstance(call, list) else [call]
            out.append({"role": "assistant", "content": "",
                        "tool_calls": [_tool_call(c) for c in calls]})
        else:
            out.append({"role": _SHAREGPT_ROLES[speaker], "content": value})
    return out


def _messages_from_pairs(row: dict, fmt: str) -> list:
    if fmt == "alpaca":
        prompt = row.get("instruction") or ""
        if row.get("input"):
            prompt = f"{prompt}\n{row['input']}" if prompt else row["input"]
        reply = row.get("output")
    else:
        prompt, reply = row.get("query") or "", row.get("response")
    out = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for pair in row.get("history") or []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DataError("`history` must be a list of [question, answer] pairs")
        out += [{"role": "user", "content": str(pair[0])},
                {"role": "assistant", "content": str(pair[1])}]
    out += [{"role": "user", "content": str(prompt)},
            {"role": "assistant", "content": "" if reply is None else str(reply)}]
    return out


def check_messages(messages: list, require_reply: bool = True) -> None:
    """Roles known and in order, replies not empty, the conversation ends with the assistant."""
    if not messages:
        raise DataError("the conversation is empty")
    previous = None
    for index, message in enumerate(messages):
        role = message["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise DataError(f"message {index + 1}: unknown role {role!r}")
        if not isinstance(message["content"], str):
            raise DataError(f"message {index + 1}: content must be text")
        if role == "system" and index != 0:
            raise DataError(f"message {index + 1}: a system message may only come first")
        if role == "assistant" and previous not in ("user", "tool"):
            raise DataError(f"message {index + 1}: an assistant reply must follow a user or "
                            f"tool message")
        if role == "tool" and previous not in ("assistant", "tool"):
            raise DataError(f"message {index + 1}: a tool result must follow an assistant "
                            f"tool call")
        if role == "assistant" and not message["content"].strip() and not message.get(
                "tool_calls"):
            raise DataError(f"message {index + 1}: empty assistant reply")
        if role == "user" and previous == "user":
            raise DataError(f"message {index + 1}: two user messages in a row")
        previous = role
    if require_reply and previous != "assistant":
        raise DataError("the last message must be the assistant's reply")
    if not require_reply and previous not in ("user", "assistant", "tool"):
        raise DataError("a prompt must end with a user message")


def fill_placeholders(samples: list, fill: dict, spec: str) -> None:
    """Replace {{NAME}} / {{AUTHOR}}; fail if a placeholder is used but not given."""
    used = {token for s in samples for m in s.messages for token in PLACEHOLDERS
            if token in m["content"]}
    missing = [key for token, key in PLACEHOLDERS.items() if token in used and not fill.get(key)]
    if missing:
        flags = " and ".join("--" + m.replace("_", "-") for m in missing)
        raise DataError(f"--data {spec}: the rows use {' and '.join(t for t in PLACEHOLDERS if t in used)} placeholders; "
                        f"pass {flags} (e.g. --model-name Aurora --model-author 'Lab X').")
    for sample in samples:
        for message in sample.messages:
            for token, key in PLACEHOLDERS.items():
                message["content"] = message["content"].replace(token, fill.get(key) or token)


def sample_rows(samples: list, count: int, seed: int) -> list:
    """`#N`: N rows; past the dataset size whole copies plus a random remainder."""
    if not samples:
        return samples
    rng = random.Random(seed)
    whole, remainder = divmod(count, len(samples))
    return samples * whole + rng.sample(samples, remainder)
