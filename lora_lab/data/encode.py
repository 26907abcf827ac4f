"""Encode conversations with the model's own chat template, and mark what the model learns.

input_ids are exactly what `tokenizer.apply_chat_template(messages)` produces (a template that
prints today's date reads TEMPLATE_DAY: a sample encodes the same on every day). Labels are -100
everywhere except on each assistant reply and the end-of-turn token that closes it, so the model
learns what to say and when to stop. Spans are found by rendering each prefix of the conversation
with the template and mapping character offsets to tokens, which works for any template whose
rendering of a prefix is a prefix of the whole. A turn the template renders differently once later
turns follow (Qwen3 drops the think blocks of earlier replies) ends at its first end-of-turn token
in the whole text, so labels follow what the model reads. A template whose prefixes are not
prefixes of the whole at all (Mistral's moves the system prompt into the last user turn) has
each such reply found in place, by rendering the conversation with that reply replaced by a
marker. A reply is trained up to the end-of-turn token that closes it, not the newline after
it. A reply with `loss: false` stays context only.

Thinking templates (those that take `enable_thinking`, as Qwen3's and SmolLM3's do): a reply
opening with the empty think block (`<think>\n\n</think>\n\n`, SmolLM3's one newline shorter)
carries no loss on that block, so non-reasoning data does not teach the model to skip or never
close its thinking; a reply with reasoning (`reasoning_content`, or a `<think>...</think>` block
at the start of its content) keeps its think block trained. A template that never reads
reasoning_content (SmolLM3's) gets it as a think block at the front of the content. An assistant
tool call the template does not render is refused, never trained as an empty reply.
`enable_thinking` (the row's own field, else data.enable_thinking) picks the mode: auto =
thinking for rows with reasoning, false = non-thinking with every reasoning dropped,
true = thinking for every row; it is passed to the template, so input_ids stay exactly what
`apply_chat_template(messages, enable_thinking=...)` gives.

Pre-training documents (Sample.text) skip the template: each is tokenised and closed with the
end-of-sequence token, and a dataset's documents are concatenated and cut into rows of exactly
max_length tokens (the last may be shorter), loss on every token: nothing is cut off or padded.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from ..errors import DataError
from ..registry import END_OF_TURN_TOKENS
from .formats import Problem, Sample

IGNORE_INDEX = -100
EMPTY_THINK = "<think>\n\n</think>\n\n"
EMPTY_THINKS = (EMPTY_THINK, "<think>\n\n</think>\n")
"""The empty think blocks templates write: Qwen3's (and Qwen3.5's), SmolLM3's."""
THINKING_MODES = ("auto", "true", "false")


@dataclass
class EncodedSample:
    input_ids: list
    labels: list
    origin: str
    truncated: bool = False
    origins: list | None = None
    """Pre-training rows: the origin of every document with tokens in this row."""

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class EncodeReport:
    samples: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    """Origins of samples cut to max_length."""
    problems: list = field(default_factory=list)
    """Samples that were not kept, with reason."""
    fingerprint: dict | None = None
    """Count and sha256 of the samples, when the cache recorded them (arrow.fingerprint_samples)."""

    def summary(self, max_length: int) -> str:
        return (
            f"{len(self.samples)} samples encoded; {len(self.truncated)} cut to "
            f"--max-length {max_length}; {len(self.problems)} not used"
        )


TEMPLATE_DAY = datetime.datetime(2026, 1, 1)
"""The day a chat template's clock reads when training data is encoded. Templates that print
today's date (Llama 3.x's "Today Date", SmolLM3's metadata block: transformers' strftime_now)
would otherwise encode a sample differently on each day, so a run resumed after midnight would
see its data change, the data cache would miss, and two nodes could disagree."""
_DATE_DIRECTIVES = ("%d", "%B", "%b", "%Y", "%y", "%m", "%A", "%a", "%H", "%M", "%S", "%p")
_FIXED_CLOCK = (
    "{%- macro strftime_now(format) -%}{{ format"
    + "".join(f"|replace({d!r}, {TEMPLATE_DAY.strftime(d)!r})" for d in _DATE_DIRECTIVES)
    + " }}{%- endmacro -%}\n"
)
"""A macro that shadows transformers' strftime_now inside one template (transformers passes
template arguments as text, so a function cannot be handed in)."""


def render(tokenizer, messages: list, tools=None, add_generation_prompt: bool = False, **template_kwargs) -> str:
    """The template's text for `messages`, its clock at TEMPLATE_DAY."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "strftime_now" in template:
        template_kwargs["chat_template"] = _FIXED_CLOCK + template
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def reasoning_of(message: dict) -> str:
    """The reasoning of an assistant message, read as Qwen3's template reads it."""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"]
    content = message.get("content")
    if isinstance(content, str) and "</think>" in content:
        return content.split("</think>")[0].split("<think>")[-1]
    return ""


def without_reasoning(message: dict) -> dict:
    message = {key: value for key, value in message.items() if key != "reasoning_content"}
    if isinstance(message.get("content"), str) and "</think>" in message["content"]:
        message["content"] = message["content"].split("</think>")[-1].lstrip("\n")
    return message


def with_inline_reasoning(message: dict) -> dict:
    """`reasoning_content` moved to the front of the content as a think block, written as the
    template writes its empty one (`<think>\n\n</think>\n`: the reasoning between the two
    newlines), for a thinking template that never reads reasoning_content (SmolLM3's)."""
    reasoning = message.get("reasoning_content")
    message = {key: value for key, value in message.items() if key != "reasoning_content"}
    if isinstance(reasoning, str) and reasoning.strip():
        message["content"] = f"<think>\n{reasoning.strip()}\n</think>\n{message.get('content') or ''}"
    return message


def thinking_setup(tokenizer, messages: list, mode) -> tuple[list, dict]:
    """The messages to render and the template kwargs for thinking mode `mode`
    (auto/true/false or a row's bool); templates without `enable_thinking` get none."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "enable_thinking" not in template:
        return messages, {}
    mode = str(mode).lower()
    if mode not in THINKING_MODES:
        raise DataError(f"enable_thinking must be one of {', '.join(THINKING_MODES)} or a boolean; got {mode!r}")
    thinking = mode == "true" or (
        mode == "auto" and any(reasoning_of(m).strip() for m in messages if m["role"] == "assistant")
    )
    if not thinking:
        messages = [without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    elif "reasoning_content" not in template:
        messages = [with_inline_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    return messages, {"enable_thinking": thinking}


def unrendered_tool_calls(text: str, messages: list) -> list:
    """The names of assistant tool calls the rendered text does not hold (SmolLM3's template
    drops an assistant message's tool_calls: the reply would train as empty)."""
    calls = [call for m in messages if m["role"] == "assistant" for call in m.get("tool_calls") or []]
    names = [str((call.get("function") or call).get("name", "")) for call in calls if isinstance(call, dict)]
    return [name for name in names if name not in text]


def _think_opened(head: str) -> int:
    """How much of the empty think block an assistant header already wrote: Qwen3.5 and Qwen3.6's
    thinking-mode headers end in `<think>\n` (the model writes its reasoning from there, so that
    is never trained); Qwen3's write none of it."""
    return next((len(p) for p in ("<think>\n", "<think>") if head.endswith(p)), 0)


def _closed_at(text: str, end: int, closers: tuple) -> int:
    """`end`, pulled back over trailing whitespace when that follows an end-of-turn token: the
    reply is trained up to the token that closes it, not the newline a template puts after it."""
    stripped = text[:end].rstrip()
    return len(stripped) if stripped.endswith(closers) else end


_NOT_PREFIXES = (
    "the chat template does not render prefixes of a conversation as prefixes of "
    "the whole, nor an assistant reply as its own text; cannot mark the assistant "
    "spans. Keep such rows to one user turn"
)
_MARK = "\ue000lora-lab reply\ue001"


def _reply_in_place(
    tokenizer, messages: list, index: int, tools, text: str, closers: tuple, template_kwargs: dict
) -> tuple:
    """The span of reply `index` found in the whole text, for a template whose earlier turns
    change once later turns follow (Mistral's moves the system prompt into the last user turn):
    the conversation is rendered with that reply's content replaced by a marker, and the text
    around the marker must equal the whole text's. The span takes in the whitespace the template
    writes before the reply (SentencePiece joins it to the first word) and the end-of-turn token
    after it."""
    content = messages[index].get("content")
    if not isinstance(content, str) or not content:
        raise DataError(_NOT_PREFIXES)
    marked = [dict(m, content=_MARK) if i == index else m for i, m in enumerate(messages)]
    marked_text = render(tokenizer, marked, tools, **template_kwargs)
    at = marked_text.find(_MARK)
    after = marked_text[at + len(_MARK) :]
    if at < 0 or _MARK in after or not (text.startswith(marked_text[:at]) and text.endswith(after)):
        raise DataError(_NOT_PREFIXES)
    start, end = at, len(text) - len(after)
    while start > 0 and text[start - 1] == " ":
        start -= 1
    closer = next((c for c in closers if text.startswith(c, end)), "")
    return start, end + len(closer)


def assistant_spans(
    tokenizer, messages: list, tools=None, trained: list | None = None, **template_kwargs
) -> tuple[str, list]:
    """The rendered text and the (start, end) character span of every trained assistant turn.

    A span starts after the template's assistant header (and after an empty think block, the part
    of it the header opened included) and ends after its end-of-turn token. The header is rendered in thinking mode: a non-thinking
    header ends in the empty think block, which earlier turns do not carry. A prefix that the
    template closes with the end-of-sequence token (Phi-3.5 ends the conversation so) ends where
    the whole text goes on with the next turn.
    """
    text = render(tokenizer, messages, tools, **template_kwargs)
    dropped = unrendered_tool_calls(text, messages)
    if dropped:
        raise DataError(
            f"the chat template does not render the tool_calls of an assistant reply ({', '.join(dropped)} is "
            "not in the text): the reply would train as empty. Write the call into that reply's content in "
            "the model's own format, or use a model whose template renders tool_calls"
        )
    eos = tokenizer.eos_token or ""
    closers = tuple(t for t in (*END_OF_TURN_TOKENS, eos) if t)
    head_kwargs = {**template_kwargs, "enable_thinking": True} if template_kwargs else {}
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or (trained is not None and not trained[index]):
            continue
        head = render(tokenizer, messages[:index], tools, add_generation_prompt=True, **head_kwargs)
        upto = (
            text if index == len(messages) - 1 else render(tokenizer, messages[: index + 1], tools, **template_kwargs)
        )
        unclosed = upto.rstrip()[: -len(eos)] if eos and upto.rstrip().endswith(eos) else ""
        closed_by_eos = len(unclosed) > len(head) and text.startswith(unclosed)
        turn_end = text.find(eos, len(head)) if eos else -1
        if not text.startswith(head):
            spans.append(_reply_in_place(tokenizer, messages, index, tools, text, closers, template_kwargs))
            continue
        if not (text.startswith(upto) or closed_by_eos or turn_end >= 0):
            raise DataError(_NOT_PREFIXES)
        if text.startswith(upto):
            end = len(upto)
        elif closed_by_eos:
            end = len(unclosed)
        else:  # rendered differently once later turns follow
            end = turn_end + len(eos)
        start = len(head)
        opened = _think_opened(head)  # Qwen3.5/3.6: a thinking header opens the block itself
        empty = next((e for e in EMPTY_THINKS if text.startswith(e, start - opened)), "")
        start += max(len(empty) - opened, 0)
        spans.append((start, _closed_at(text, end, closers)))
    return text, spans


def encode_sample(
    tokenizer,
    sample: Sample,
    max_length: int,
    truncation: str = "truncate",
    system: str | None = None,
    enable_thinking="auto",
) -> EncodedSample:
    """One conversation -> input_ids and labels. Raises DataError if it cannot be used."""
    messages, trained = sample.messages, sample.trained
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
        trained = [False] + trained if trained is not None else None
    mode = enable_thinking if sample.enable_thinking is None else sample.enable_thinking
    messages, template_kwargs = thinking_setup(tokenizer, messages, mode)
    text, spans = assistant_spans(tokenizer, messages, sample.tools, trained, **template_kwargs)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for position, (start, end) in enumerate(encoding["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start and end <= spans[span_index][1] and end > start:
            labels[position] = input_ids[position]
    truncated = len(input_ids) > max_length
    if truncated:
        if truncation == "drop":
            raise DataError(f"{len(input_ids)} tokens, over --max-length {max_length} (--truncation drop)")
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(f"no assistant token left to train on after cutting to --max-length {max_length}")
    return EncodedSample(input_ids, labels, sample.origin, truncated)


def encode_samples(
    tokenizer,
    samples: list,
    max_length: int,
    truncation: str = "truncate",
    system: str | None = None,
    enable_thinking="auto",
) -> EncodeReport:
    report = EncodeReport()
    documents = []
    for sample in samples:
        if sample.text is not None:
            documents.append(sample)
            continue
        add_encoded(
            report,
            sample,
            lambda sample=sample: encode_sample(tokenizer, sample, max_length, truncation, system, enable_thinking),
        )
    report.samples += pack_documents(tokenizer, documents, max_length, report.problems)
    return report


def add_encoded(report: EncodeReport, sample, encode) -> None:
    """encode() one sample into the report: a row that fails is a problem with its origin."""
    try:
        encoded = encode()
    except DataError as exc:
        report.problems.append(Problem(sample.origin, str(exc)))
        return
    except (TypeError, ValueError, RecursionError, UnicodeError) as exc:
        # the template or tokenizer refused a value the reader let through: one bad row
        report.problems.append(
            Problem(
                sample.origin, f"the chat template could not render this row ({type(exc).__name__}: {str(exc)[:200]})"
            )
        )
        return
    report.samples.append(encoded)
    if encoded.truncated:
        report.truncated.append(sample.origin)


def pack_documents(tokenizer, documents: list, max_length: int, problems: list) -> list:
    """Pre-training documents, each closed by EOS, concatenated and cut into max_length rows."""
    tokenised = (
        (ids, sample.origin) for sample in documents if (ids := document_ids(tokenizer, sample, problems)) is not None
    )
    return list(cut_documents(tokenised, max_length))


def document_ids(tokenizer, sample: Sample, problems: list) -> list | None:
    """A document's tokens closed by EOS; None (and a problem) if the tokenizer refuses it."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        return list(tokenizer(sample.text, add_special_tokens=False)["input_ids"]) + eos
    except (TypeError, ValueError, UnicodeError) as exc:
        problems.append(
            Problem(
                sample.origin, f"the tokenizer could not read this document ({type(exc).__name__}: {str(exc)[:200]})"
            )
        )
        return None


def cut_documents(documents, max_length: int):
    """(ids, origin) of documents, in order, concatenated and cut into rows of exactly
    max_length tokens (the last may be shorter); each row names every document it holds."""
    stream, owners = [], []

    def row(ids, origins):
        origins = list(dict.fromkeys(origins))
        return EncodedSample(ids, list(ids), origins[0], origins=origins)

    for ids, origin in documents:
        stream += ids
        owners += [origin] * len(ids)
        while len(stream) >= max_length:
            yield row(stream[:max_length], owners[:max_length])
            del stream[:max_length], owners[:max_length]
    if stream:
        yield row(stream, owners)


def show_trained_spans(tokenizer, encoded: EncodedSample, mark=("[[", "]]")) -> str:
    """The decoded sample with trained tokens wrapped in markers (for `lora-lab data preview`)."""
    pieces, inside = [], False
    for token, label in zip(encoded.input_ids, encoded.labels):
        trained = label != IGNORE_INDEX
        if trained != inside:
            pieces.append(mark[0] if trained else mark[1])
            inside = trained
        pieces.append(tokenizer.decode([token]))
    if inside:
        pieces.append(mark[1])
    return "".join(pieces)
