"""Encode conversations with the model's own chat template, and mark what the model learns.

input_ids are exactly what `tokenizer.apply_chat_template(messages)` produces. Labels are -100
everywhere except on each assistant reply and the end-of-turn token that closes it, so the model
learns what to say and when to stop. Spans are found by rendering each prefix of the conversation
with the template and mapping character offsets to tokens, which works for any template whose
rendering of a prefix is a prefix of the whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DataError
from .formats import Problem, Sample

IGNORE_INDEX = -100


@dataclass
class EncodedSample:
    input_ids: list
    labels: list
    origin: str
    truncated: bool = False

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

    def summary(self, max_length: int) -> str:
        return (f"{len(self.samples)} samples encoded; {len(self.truncated)} cut to "
                f"--max-length {max_length}; {len(self.problems)} not used")


def render(tokenizer, messages: list, tools=None, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list, tools=None) -> tuple[str, list]:
    """The rendered text and the (start, end) character span of every assistant turn.

    A span starts after the template's assistant header and ends after its end-of-turn token.
    """
    text = render(tokenizer, messages, tools)
    eos = tokenizer.eos_token or ""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:index], tools, add_generation_prompt=True)
        upto = render(tokenizer, messages[:index + 1], tools)
        if not (text.startswith(head) and text.startswith(upto)):
            raise DataError("the chat template does not render prefixes of a conversation as "
                            "prefixes of the whole; cannot mark the assistant spans")
        end = len(upto.rstrip())
        if eos and not upto.rstrip().endswith(eos):
            end = len(upto)
        spans.append((len(head), end))
    return text, spans


def encode_sample(tokenizer, sample: Sample, max_length: int, truncation: str = "truncate",
                  system: str | None = None) -> EncodedSample:
    """One conversation -> input_ids and labels. Raises DataError if it cannot be used."""
    messages = sample.messages
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    text, spans = assistant_spans(tokenizer, messages, sample.tools)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for position, (start, end) in enumerate(encoding["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start and end <= spans[
                span_index][1] and end > start:
            labels[position] = input_ids[position]
    truncated = len(input_ids) > max_length
    if truncated:
        if truncation == "drop":
            raise DataError(f"{len(input_ids)} tokens, over --max-length {max_length} "
                            f"(--truncation drop)")
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(f"no assistant token left to train on after cutting to --max-length "
                        f"{max_length}")
    return EncodedSample(input_ids, labels, sample.origin, truncated)


def encode_samples(tokenizer, samples: list, max_length: int, truncation: str = "truncate",
                   system: str | None = None) -> EncodeReport:
    report = EncodeReport()
    for sample in samples:
        try:
            encoded = encode_sample(tokenizer, sample, max_length, truncation, system)
        except DataError as exc:
            report.problems.append(Problem(sample.origin, str(exc)))
            continue
        report.samples.append(encoded)
        if encoded.truncated:
            report.truncated.append(sample.origin)
    return report


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
