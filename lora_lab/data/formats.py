"""Normalise every row to one shape: a conversation (messages + tools) or a text document.

Row formats, detected per dataset from the first readable row (or forced with --format); every
field and what it maps to is in docs/data.md:
  messages        {"messages": [{"role", "content", "tool_calls", "loss"}], "tools"}
                  (OpenAI style; ms-swift's agent roles tool_call / tool_response; content as a
                  list of text parts; ms-swift `loss` and LLaMA-Factory `loss_weight` flags)
  sharegpt        {"conversations": [{"from", "value"}], "system", "tools"}  (LLaMA-Factory)
  swift-sharegpt  {"conversation": [{"human", "assistant"}], "system"}          (ms-swift)
  alpaca          {"instruction", "input", "output", "system", "history", "tools"}
  query-response  {"query", "response", "system", "history", "tools"}
  text            {"text"}: continued pre-training, loss on every token
Rows of one assistant message, or a response without a query, are pre-training text too
(ms-swift's pre-training form). A LLaMA-Factory `dataset_info.json:NAME` entry maps its columns
and tags onto these (dataset_info.py). Preference data (chosen / rejected, KTO labels) is
recognised and refused with the command that trains it.

A problem is an error when the row cannot be trained on as written: it is not used. It is a
warning when the row is read, with a remark: consecutive assistant messages joined, a placeholder
left unfilled, fields the format does not use. Nothing is changed without one or the other.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..errors import DataError
from .preference import refuse_preference
from .readers import Bad, Problem, kind_of, read_rows
from .tools import calls_from_json_text, normalise_tool_calls, normalise_tools

__all__ = ["FORMATS", "Problem", "Sample", "detect_format", "normalise_row", "read_rows"]

FORMATS = ("messages", "sharegpt", "swift-sharegpt", "alpaca", "query-response", "text")
KNOWN_FIELDS = {
    "messages": {"messages", "tools", "enable_thinking"},
    "sharegpt": {"conversations", "system", "tools", "enable_thinking"},
    "swift-sharegpt": {"conversation", "system", "tools", "enable_thinking"},
    "alpaca": {"instruction", "input", "output", "system", "history", "tools", "enable_thinking"},
    "query-response": {"query", "response", "system", "history", "tools", "enable_thinking"},
    "text": {"text"},
}
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id", "name", "loss", "loss_weight", "reasoning_content"}
TURN_FIELDS = {"from", "value"}
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}
_ROLES = ("system", "user", "assistant", "tool", "tool_call", "tool_response")


@dataclass
class Sample:
    """One conversation (or, with `text`, one pre-training document), normalised."""

    messages: list
    origin: str
    tools: list | None = None
    """OpenAI function tools, as the chat template receives them."""
    trained: list | None = None
    """Per message: whether its tokens carry loss (assistant replies only); None = all replies."""
    text: str | None = None
    """A pre-training document: no chat template, loss on every token."""
    notes: list = field(default_factory=list)
    """Remarks on how the row was read (become warnings with the row's origin)."""
    enable_thinking: bool | None = None
    """The row's own thinking mode for templates that take one; None = data.enable_thinking."""


def detect_format(rows: list, source: str) -> str:
    """The format of the first readable row; preference data is refused here, by name."""
    for row, _ in rows:
        if not isinstance(row, dict):
            continue
        refuse_preference(row, f"--data {source}")
        for key, fmt in (
            ("messages", "messages"),
            ("conversations", "sharegpt"),
            ("conversation", "swift-sharegpt"),
            ("instruction", "alpaca"),
            ("query", "query-response"),
            ("response", "query-response"),
            ("text", "text"),
        ):
            if key in row:
                return fmt
        keys = ", ".join(sorted(map(str, row)))
        raise DataError(
            f"--data {source}: cannot tell the row format from its fields ({keys}). "
            f"Expected messages, conversations, conversation, instruction/output, "
            f"query/response or text; or pass --format (docs/data.md lists them)."
        )
    row, origin = rows[0]
    reason = row.reason if isinstance(row, Bad) else f"expected an object, got {kind_of(row)}"
    raise DataError(f"--data {source}: no row could be parsed ({len(rows)} rows; first: {origin}: {reason}).")


def normalise_row(row, fmt: str, origin: str, require_reply: bool = True) -> Sample:
    """One raw row -> Sample. With require_reply=False (inference prompts) a conversation may
    end with the user; a final assistant reply, if any, is kept as the reference."""
    if isinstance(row, Bad):
        raise DataError(row.reason)
    if not isinstance(row, dict):
        raise DataError(f"expected an object, got {kind_of(row)}")
    refuse_preference(row, "this row")
    notes: list = []
    if fmt == "text":
        return Sample([], origin, text=_document(row.get("text"), "text"))
    if fmt == "messages":
        messages, trained = _messages_from_openai(row, notes)
    elif fmt == "sharegpt":
        messages, trained = _messages_from_sharegpt(row), None
    elif fmt == "swift-sharegpt":
        messages, trained = _messages_from_swift_sharegpt(row), None
    elif fmt in ("alpaca", "query-response"):
        if require_reply and _is_response_only(row, fmt):
            return Sample([], origin, text=_document(row.get("response"), "response"))
        messages, trained = _messages_from_pairs(row, fmt, require_reply), None
    else:
        raise DataError(f"unknown row format {fmt!r}; expected one of {', '.join(FORMATS)}")
    tools = normalise_tools(row.get("tools"))
    if (
        fmt == "messages"
        and require_reply
        and len(messages) == 1
        and messages[0]["role"] == "assistant"
        and not messages[0].get("tool_calls")
        and not tools
    ):  # ms-swift's pre-training row
        return Sample([], origin, text=_document(messages[0]["content"], "content"), notes=notes)
    if (
        not require_reply
        and messages
        and messages[-1]["role"] == "assistant"
        and not (messages[-1]["content"].strip() or messages[-1].get("tool_calls"))
    ):
        messages = messages[:-1]
        trained = trained[:-1] if trained else trained
    check_messages(messages, require_reply, trained)
    empty = [
        str(i)
        for i, m in enumerate(messages, start=1)
        if m["role"] == "user" and not str(m.get("content") or "").strip()
    ]
    if empty:
        notes.append(
            f"user message {', '.join(empty)} is empty: the model learns to answer an "
            f"empty prompt (fill it in, or drop the row)"
        )
    thinking = row.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise DataError(f"field `enable_thinking` must be true or false; got {kind_of(thinking)}")
    return Sample(
        messages=messages, origin=origin, tools=tools, trained=trained, notes=notes, enable_thinking=thinking
    )


def _document(value, name: str) -> str:
    if value is None:
        raise DataError(f"missing field `{name}`")
    if not isinstance(value, str):
        raise DataError(f"field `{name}` must be text; got {kind_of(value)}")
    if not value.strip():
        raise DataError(f"field `{name}` is empty")
    return value


def _is_response_only(row: dict, fmt: str) -> bool:
    """ms-swift's pre-training form: a response with no query (and no history)."""
    return fmt == "query-response" and "query" not in row and "response" in row and not row.get("history")


def unknown_fields(row, fmt: str) -> list[str]:
    """Fields the format does not read ("id", "messages[].weight"): ignored, reported."""
    if not isinstance(row, dict) or fmt not in KNOWN_FIELDS:
        return []
    names = sorted(str(k) for k in set(row) - KNOWN_FIELDS[fmt])
    nested = {"messages": ("messages", MESSAGE_FIELDS), "sharegpt": ("conversations", TURN_FIELDS)}
    if fmt in nested and isinstance(row.get(nested[fmt][0]), list):
        key, known = nested[fmt]
        extra = {k for turn in row[key] if isinstance(turn, dict) for k in turn} - known
        names += [f"{key}[].{k}" for k in sorted(extra)]
    return names


def unused_field_warnings(unused: dict, fmt: str) -> list:
    """One warning per unknown field ({name: [first origin, rows]}): where it first appears,
    how often, a likely spelling."""
    warnings = []
    for name, (first, rows) in unused.items():
        known = KNOWN_FIELDS[fmt] | (MESSAGE_FIELDS if fmt == "messages" else TURN_FIELDS)
        close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(known), n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        more = f" ({rows} rows)" if rows > 1 else ""
        warnings.append(Problem(first, f"field `{name}` is not used by the {fmt} format and was ignored{more}{hint}"))
    return warnings


def _text(value, where: str, allow_parts: bool = False) -> str:
    """Exact text: a string, or (messages) a list of text parts joined. Anything else is an
    error: a number or an object is not silently turned into text or an empty turn."""
    if isinstance(value, str):
        return value
    if allow_parts and isinstance(value, list) and value:
        return "".join(_text_part(part, f"{where}, part {i}") for i, part in enumerate(value, start=1))
    raise DataError(f"{where} must be text{' or a list of text parts' if allow_parts else ''}; got {kind_of(value)}")


def _text_part(part, where: str) -> str:
    """{"type": "text", "text": ...} (OpenAI) or {"type": "text", "value": ...} (LLaMA-Factory)."""
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else kind_of(part)
        raise DataError(f'{where}: only text parts ({{"type": "text", "text": ...}}) can be trained on; got {kind!r}')
    key = "text" if "text" in part else "value"
    if not isinstance(part.get(key), str):
        raise DataError(f"{where}: `text` must be text; got {kind_of(part.get(key))}")
    return part[key]


def _loss_flag(turn: dict, role: str, where: str) -> bool | None:
    """ms-swift `loss: true/false`, LLaMA-Factory `loss_weight: 0.0/1.0`; None when absent."""
    flag = turn.get("loss")
    if flag is not None and not isinstance(flag, bool):
        raise DataError(f"{where}: `loss` must be true or false; got {kind_of(flag)}")
    weight = turn.get("loss_weight")
    if weight is not None:
        if isinstance(weight, bool) or weight not in (0, 1):
            raise DataError(
                f"{where}: `loss_weight` must be 0 or 1 (lora-lab does not weight the loss); got {kind_of(weight)}"
            )
        if flag is not None and flag != bool(weight):
            raise DataError(f"{where}: `loss` and `loss_weight` disagree")
        flag = bool(weight)
    if flag and role not in ("assistant", "tool_call"):  # a tool_call is part of the reply
        raise DataError(
            f"{where}: loss on a {role} message; lora-lab trains on assistant "
            f"replies only (remove the flag, or make it the assistant's)"
        )
    return flag


def _messages_from_openai(row: dict, notes: list) -> tuple[list, list | None]:
    if row.get("messages") is None:
        raise DataError("missing field `messages`")
    if not isinstance(row["messages"], list):
        raise DataError(f"field `messages` must be a list; got {kind_of(row['messages'])}")
    out: list[dict] = []
    trained: list[bool | None] = []
    for index, turn in enumerate(row["messages"], start=1):
        where = f"message {index}"
        if not isinstance(turn, dict) or "role" not in turn:
            raise DataError(
                f"{where}: missing field `role`"
                if isinstance(turn, dict)
                else f"{where}: expected an object with `role` and `content`, got {kind_of(turn)}"
            )
        role = turn["role"]
        if not isinstance(role, str) or role not in _ROLES:
            raise DataError(f"{where}: unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        flag = _loss_flag(turn, role, where)
        if role == "tool_call":  # ms-swift: the call as a JSON string, part of the reply
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": calls_from_json_text(turn.get("content"), where),
            }
        else:
            role = "tool" if role == "tool_response" else role
            content = turn.get("content")
            if content is None and not (role == "assistant" and turn.get("tool_calls")):
                raise DataError(f"{where}: missing field `content`")
            message = {
                "role": role,
                "content": "" if content is None else _text(content, f"{where}: `content`", allow_parts=True),
            }
            if turn.get("tool_calls") is not None:
                if role != "assistant":
                    raise DataError(f"{where}: only assistant messages have `tool_calls`")
                message["tool_calls"] = normalise_tool_calls(turn["tool_calls"], where)
            if role == "assistant" and turn.get("reasoning_content") is not None:
                message["reasoning_content"] = _text(turn["reasoning_content"], f"{where}: `reasoning_content`")
        if out and out[-1]["role"] == message["role"] == "assistant":
            _join_reply(out[-1], message, trained, flag, index, notes if turn["role"] == "assistant" else [])
            continue
        out.append(message)
        trained.append(flag)
    if all(flag is None for flag in trained):
        return out, None
    return out, [flag is not False if m["role"] == "assistant" else False for m, flag in zip(out, trained)]


def _join_reply(previous: dict, message: dict, trained: list, flag, index: int, notes: list) -> None:
    """Consecutive assistant messages are one reply, as ms-swift joins them. A `tool_call`
    message after the reply's text is the documented agent form; two assistant texts in a row
    get a note. Text after a tool call cannot be kept in order, so it is an error."""
    if previous.get("tool_calls") and message["content"]:
        raise DataError(
            f"message {index}: assistant text after a tool call in the same reply; "
            f"the chat template puts calls after the text, so reorder them"
        )
    if flag is not None and trained[-1] is not None and flag != trained[-1]:
        raise DataError(f"message {index}: joins the assistant message before it, but their loss flags differ")
    previous["content"] += message["content"]
    if message.get("tool_calls"):
        previous["tool_calls"] = previous.get("tool_calls", []) + message["tool_calls"]
    trained[-1] = trained[-1] if trained[-1] is not None else flag
    notes.append(
        f"message {index} follows an assistant message and was joined to it as one "
        f"reply (text concatenated, tool calls appended)"
    )


def _messages_from_sharegpt(row: dict) -> list:
    if row.get("conversations") is None:
        raise DataError("missing field `conversations`")
    turns = row["conversations"]
    if not isinstance(turns, list):
        raise DataError(f"field `conversations` must be a list; got {kind_of(turns)}")
    out = _system(row)
    for index, turn in enumerate(turns, start=1):
        where = f"turn {index}"
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if not isinstance(speaker, str) or speaker not in _SHAREGPT_ROLES:
            shown = repr(speaker) if isinstance(speaker, (str, type(None))) else kind_of(speaker)
            raise DataError(f"{where}: unknown speaker {shown}; expected one of {', '.join(_SHAREGPT_ROLES)}")
        if turn.get("value") is None:
            raise DataError(f"{where}: missing field `value`")
        if speaker == "function_call":
            calls = calls_from_json_text(turn["value"], f"{where} (function_call)")
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            out.append({"role": _SHAREGPT_ROLES[speaker], "content": _text(turn["value"], f"{where}: `value`")})
    return out


def _messages_from_swift_sharegpt(row: dict) -> list:
    """ms-swift: {"system", "conversation": [{"human": q, "assistant": a}, ...]}."""
    turns = row.get("conversation")
    if not isinstance(turns, list):
        raise DataError(f'field `conversation` must be a list of {{"human", "assistant"}} pairs; got {kind_of(turns)}')
    out = _system(row)
    for index, turn in enumerate(turns, start=1):
        where = f"turn {index}"
        if not isinstance(turn, dict) or "human" not in turn or set(turn) - {"human", "assistant"}:
            raise DataError(f'{where}: expected {{"human": ..., "assistant": ...}}')
        out.append({"role": "user", "content": _text(turn["human"], f"{where}: `human`")})
        if turn.get("assistant") is not None:
            out.append({"role": "assistant", "content": _text(turn["assistant"], f"{where}: `assistant`")})
    return out


def _system(row: dict) -> list:
    system = row.get("system")
    if system is None or system == "":
        return []
    return [{"role": "system", "content": _text(system, "field `system`")}]


def _messages_from_pairs(row: dict, fmt: str, require_reply: bool) -> list:
    prompt_key, reply_key = ("instruction", "output") if fmt == "alpaca" else ("query", "response")
    prompt = row.get(prompt_key)
    prompt = "" if prompt is None else _text(prompt, f"field `{prompt_key}`")
    if fmt == "alpaca" and row.get("input") is not None:
        extra = _text(row["input"], "field `input`")
        prompt = f"{prompt}\n{extra}" if prompt and extra else prompt or extra
    if not prompt and row.get(prompt_key) is None:
        raise DataError(f"missing field `{prompt_key}`")
    reply = row.get(reply_key)
    if reply is None and require_reply:
        raise DataError(f"missing field `{reply_key}`")
    out = _system(row)
    history = row.get("history")
    if history is not None and not isinstance(history, list):
        raise DataError(f"`history` must be a list of [question, answer] pairs; got {kind_of(history)}")
    for index, pair in enumerate(history or [], start=1):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DataError(f"`history` item {index} must be a [question, answer] pair; got {kind_of(pair)}")
        out += [
            {"role": "user", "content": _text(pair[0], f"history {index} question")},
            {"role": "assistant", "content": _text(pair[1], f"history {index} answer")},
        ]
    out += [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "" if reply is None else _text(reply, f"field `{reply_key}`")},
    ]
    return out


def check_messages(messages: list, require_reply: bool = True, trained: list | None = None) -> None:
    """Roles known and in order, replies not empty, the conversation ends with the assistant."""
    if not messages:
        raise DataError("the conversation is empty")
    previous = None
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system" and index != 0:
            raise DataError(f"message {index + 1}: a system message may only come first")
        if role == "assistant" and previous not in ("user", "tool"):
            raise DataError(f"message {index + 1}: an assistant reply must follow a user or tool message")
        if role == "tool" and previous not in ("assistant", "tool"):
            raise DataError(f"message {index + 1}: a tool result must follow an assistant tool call")
        if role == "assistant" and not message["content"].strip() and not message.get("tool_calls"):
            raise DataError(f"message {index + 1}: empty assistant reply")
        if role == "user" and previous == "user":
            raise DataError(f"message {index + 1}: two user messages in a row")
        previous = role
    if require_reply and previous != "assistant":
        raise DataError("the last message must be the assistant's reply")
    if not require_reply and previous not in ("user", "assistant", "tool"):
        raise DataError("a prompt must end with a user message")
    if require_reply and trained is not None and not any(trained):
        raise DataError("every assistant reply has `loss: false`; nothing to train on")
