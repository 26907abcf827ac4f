"""Encode conversations with the model's own chat template, and mark what the model learns.

input_ids are exactly what `tokenizer.apply_chat_template(messages)` produces. Labels are -100
everywhere except on each assistant reply and the end-of-turn token that closes it, so the model
learns what to say and when to stop. Spans are found by rendering each prefix of the conversation
with the template and mapping character offsets to tokens, which works for any template whose
rendering of a prefix is a prefix of the whole. A reply with `loss: false` stays context only.

Pre-training documents (Sample.text) skip the template: each is tokenised and closed with the
end-of-sequence token, and a dataset's documents are concatenated and cut into rows of exactly
max_length tokens (the last may be shorter), loss on every token: nothing is cut off or padded.
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

    def summary(self, max_length: int) -> str:
        return (f"{len(self.samples)} samples encoded; {len(self.truncated)} cut to "
                f"--max-length {max_length}; {len(self.problems)} not used")


def render(tokenizer, messages: list, tools=None, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list, tools=None,
                    trained: list | None = None) -> tuple[str, list]:
    """The rendered text and the (start, end) character span of every trained assistant turn.

    A span starts after the template's assistant header and ends after its end-of-turn token.
    """
    text = render(tokenizer, messages, tools)
    eos = tokenizer.eos_token or ""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or (trained is not None and not trained[index]):
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
    messages, trained = sample.messages, sample.trained
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
        trained = [False] + trained if trained is not None else None
    text, spans = assistant_spans(tokenizer, messages, sample.tools, trained)
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
    documents = []
    for sample in samples:
        if sample.text is not None:
            documents.append(sample)
            continue
        try:
            encoded = encode_sample(tokenizer, sample, max_length, truncation, system)
        except DataError as exc:
            report.problems.append(Problem(sample.origin, str(exc)))
            continue
        except (TypeError, ValueError, RecursionError, UnicodeError) as exc:
            # the template or tokenizer refused a value the reader let through: one bad row
            report.problems.append(Problem(sample.origin, f"the chat template could not render "
                                                          f"this row ({type(exc).__name__}: "
                                                          f"{str(exc)[:200]})"))
            continue
        report.samples.append(encoded)
        if encoded.truncated:
            report.truncated.append(sample.origin)
    report.samples += pack_documents(tokenizer, documents, max_length, report.problems)
    return report


def pack_documents(tokenizer, documents: list, max_length: int, problems: list) -> list:
    """Pre-training documents, each closed by EOS, concatenated and cut into max_length rows."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream, owners = [], []
    for sample in documents:
        try:
            ids = list(tokenizer(sample.text, add_special_tokens=False)["input_ids"]) + eos
        except (TypeError, ValueError, UnicodeError) as exc:
            problems.append(Problem(sample.origin, f"the tokenizer could not read this document "
                                                   f"({type(exc).__name__}: {str(exc)[:200]})"))
            continue
        stream += ids
        owners += [sample.origin] * len(ids)
    rows = []
    for start in range(0, len(stream), max_length):
        ids = stream[start:start + max_length]
        origins = list(dict.fromkeys(owners[start:start + max_length]))
        rows.append(EncodedSample(ids, list(ids), origins[0], origins=origins))
    return rows


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
