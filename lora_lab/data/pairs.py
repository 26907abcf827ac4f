"""Preference data for --task dpo / orpo / simpo (pairs) and kto (labelled answers): read the
peers' documented row forms, check every row, encode with the chat template.

Row forms (docs/preference.md):
  pairs   {"prompt", "chosen", "rejected"}: TRL's; prompt text or messages, each answer text, an
          assistant message or a list ending with one; without `prompt` the chosen and
          rejected conversations share the prompt (TRL's implicit prompt)
          {"messages", "chosen", "rejected"}: the same with the prompt as messages
          {"messages" ending with the chosen reply, "rejected_response"}: ms-swift
          {"conversations", "chosen": {"from", "value"}, "rejected": {...}}: LLaMA-Factory
          sharegpt (dpo_en_demo); {"instruction", "input", "chosen", "rejected"}: its alpaca form
  labels  {"messages" ending with the answer, "label": true/false}: ms-swift and LLaMA-Factory
          (kto_en_demo; `kto_tag` too); {"prompt", "completion", "label"}: TRL's
A LLaMA-Factory dataset_info.json entry with `ranking: true` (or a `kto_tag` column) maps its
columns onto these. A row that cannot be used is reported with file:line and the reason.

Encoding: prompt_ids are apply_chat_template(prompt, add_generation_prompt=True); an answer's ids
are the tokens the template renders for the assistant reply, through its end-of-turn token, so
that prompt_ids + answer ids is exactly apply_chat_template(prompt + [reply]) without the
template's trailing newline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DataError
from .encode import IGNORE_INDEX, EncodeReport, add_encoded, render
from .formats import Problem, _messages_from_openai, _messages_from_sharegpt, _system, _text, check_messages
from .readers import Bad, kind_of
from .reading import LoadedData, open_spec, parse_items, sample_rows
from .tools import normalise_tools

PAIRED = ("dpo", "orpo", "simpo")


@dataclass
class PreferenceSample:
    prompt: list
    """The conversation up to the answer (messages, ending with the user or a tool result)."""
    origin: str
    chosen: str
    rejected: str | None = None
    """Pairs: the worse answer. None for a labelled (KTO) answer."""
    label: bool | None = None
    """KTO: whether `chosen` is a good answer."""
    tools: list | None = None


@dataclass
class EncodedPair:
    prompt_ids: list
    chosen_ids: list
    """The chosen answer (KTO: the answer) through the end-of-turn token."""
    rejected_ids: list | None
    origin: str
    label: bool | None = None
    truncated: bool = False
    origins = None
    """(Pre-training rows list the documents they hold; a pair is one row.)"""

    @property
    def input_ids(self) -> list:
        """The longest sequence the model reads for this sample (the memory plan's row)."""
        longest = max(self.chosen_ids, self.rejected_ids or [], key=len)
        return self.prompt_ids + longest

    @property
    def labels(self) -> list:
        """Answer tokens of every sequence, for the data fingerprint."""
        return (
            [IGNORE_INDEX] * len(self.prompt_ids)
            + self.chosen_ids
            + ([IGNORE_INDEX] + self.rejected_ids if self.rejected_ids is not None else [int(bool(self.label))])
        )

    @property
    def trained_tokens(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids or [])

    def row(self) -> dict:
        """The row TRL's trainers read (their already-tokenized form)."""
        if self.rejected_ids is None:
            return {"prompt_ids": self.prompt_ids, "completion_ids": self.chosen_ids, "label": bool(self.label)}
        return {"prompt_ids": self.prompt_ids, "chosen_ids": self.chosen_ids, "rejected_ids": self.rejected_ids}


# ----------------------------------------------------------------------------- reading rows


def load_preference_spec(spec: str, task: str, seed: int = 42) -> LoadedData:
    """One --data entry of preference rows (opened by reading.open_spec), each checked; `#N`
    samples N of them."""
    opened = open_spec(spec)
    entry = opened.entry
    kind = "pairs" if task in PAIRED else "labelled answers"
    return read_object_rows(
        opened,
        lambda row, origin: normalise_preference_row(entry.remap_preference(row) if entry else row, task, origin),
        f"preference {kind}" + (f" ({entry.describe()})" if entry else ""),
        seed,
    )


def read_object_rows(opened, convert, fmt: str, seed: int) -> LoadedData:
    """The rows of an opened --data entry, each an object turned into a sample by
    convert(row, origin) or reported as a problem with its origin; `#N` samples N of them."""
    loaded = LoadedData(warnings=opened.warnings)
    for row, origin in parse_items(opened.path, opened.items):
        try:
            if isinstance(row, Bad):
                raise DataError(row.reason)
            if not isinstance(row, dict):
                raise DataError(f"expected an object, got {kind_of(row)}")
            loaded.samples.append(convert(row, origin))
        except DataError as exc:
            loaded.problems.append(Problem(origin, str(exc)))
        except RecursionError:
            loaded.problems.append(Problem(origin, "nested too deeply to read"))
    loaded.formats.append((opened.spec, fmt))
    if opened.count is not None:
        loaded.samples = sample_rows(loaded.samples, opened.count, seed)
    return loaded


def is_pair_row(row: dict) -> bool:
    """A preference pair: chosen and rejected (TRL), or ms-swift's messages ending with the chosen
    reply beside `rejected_response`."""
    return "rejected_response" in row or ("chosen" in row and "rejected" in row)


def normalise_preference_row(row: dict, task: str, origin: str) -> PreferenceSample:
    """One raw row -> PreferenceSample; raises DataError naming the field at fault."""
    labelled = "label" in row or "kto_tag" in row
    if task in PAIRED:
        if labelled and "rejected" not in row and "rejected_response" not in row:
            raise DataError(
                f"a KTO row (`label` true/false, no rejected answer); --task {task} "
                f"needs a chosen and a rejected answer per row. Train it with "
                f"--task kto."
            )
        return _pair(row, origin)
    if not labelled:
        if is_pair_row(row):
            raise DataError(
                "a preference pair (chosen / rejected); --task kto reads labelled "
                "answers (`label` true/false). Train pairs with --task dpo."
            )
        raise DataError("missing field `label` (true: a good answer, false: a bad one)")
    return _labelled(row, origin)


def _pair(row: dict, origin: str) -> PreferenceSample:
    tools = normalise_tools(row.get("tools"))
    if "rejected_response" in row:  # ms-swift: messages end with the chosen reply
        messages = _conversation(row)
        if not messages or messages[-1]["role"] != "assistant":
            raise DataError(
                "`messages` must end with the chosen assistant reply (ms-swift's `rejected_response` form)"
            )
        chosen = messages[-1]["content"]
        prompt, rejected = messages[:-1], _answer(row.get("rejected_response"), "rejected_response")
    else:
        for name in ("chosen", "rejected"):
            if row.get(name) is None:
                raise DataError(f"missing field `{name}`")
        if _has_prompt(row):
            prompt = _conversation(row)
        else:  # TRL's implicit prompt: both answers are whole conversations
            prompt = _implicit_prompt(row)
        chosen, rejected = _answer(row["chosen"], "chosen"), _answer(row["rejected"], "rejected")
    _check_prompt(prompt)
    _check_answer(chosen, "chosen")
    _check_answer(rejected, "rejected")
    if chosen == rejected:
        raise DataError("the chosen and rejected answers are the same text: nothing to prefer")
    return PreferenceSample(prompt, origin, chosen, rejected, tools=tools)


def _labelled(row: dict, origin: str) -> PreferenceSample:
    label = row.get("label", row.get("kto_tag"))
    if not isinstance(label, bool):
        raise DataError(f"`label` must be true or false; got {kind_of(label)}")
    if "completion" in row:  # TRL
        prompt, answer = _conversation(row), _answer(row["completion"], "completion")
    else:
        messages = _conversation(row)
        if not messages or messages[-1]["role"] != "assistant":
            raise DataError("the conversation must end with the assistant answer the label is about")
        prompt, answer = messages[:-1], messages[-1]["content"]
    _check_prompt(prompt)
    _check_answer(answer, "completion" if "completion" in row else "answer")
    return PreferenceSample(prompt, origin, answer, label=label, tools=normalise_tools(row.get("tools")))


def _has_prompt(row: dict) -> bool:
    return any(k in row for k in ("prompt", "messages", "conversations", "instruction"))


def _conversation(row: dict) -> list:
    """The prompt (or whole conversation) of a row, as messages."""
    if "messages" in row:
        messages, _ = _messages_from_openai(row, [])
        return messages
    if "conversations" in row:
        return _messages_from_sharegpt(row)
    if "instruction" in row:  # LLaMA-Factory alpaca ranking
        prompt = _text(row["instruction"], "field `instruction`")
        if row.get("input"):
            prompt = f"{prompt}\n{_text(row['input'], 'field `input`')}"
        return _system(row) + [{"role": "user", "content": prompt}]
    given = row.get("prompt")
    if given is None:
        raise DataError("missing field `prompt`")
    if isinstance(given, str):
        return _system(row) + [{"role": "user", "content": given}]
    messages, _ = _messages_from_openai({"messages": given}, [])
    return messages


def _implicit_prompt(row: dict) -> list:
    """TRL's implicit prompt: chosen and rejected are conversations that differ in the reply."""
    chosen, rejected = row["chosen"], row["rejected"]
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DataError(
            "missing field `prompt` (or `messages`); with text answers the row needs the prompt they answer"
        )
    head_c, _ = _messages_from_openai({"messages": chosen[:-1]}, [])
    head_r, _ = _messages_from_openai({"messages": rejected[:-1]}, [])
    if head_c != head_r:
        raise DataError(
            "`chosen` and `rejected` conversations differ before their last message; they must share the prompt"
        )
    return head_c


def _answer(value, name: str) -> str:
    """An answer: text, an assistant message ({role, content} or {from, value}), or a list of
    messages ending with one."""
    if value is None:
        raise DataError(f"missing field `{name}`")
    if isinstance(value, list):
        if not value:
            raise DataError(f"`{name}` is an empty list")
        value = value[-1]
    if isinstance(value, dict):
        role = value.get("role", value.get("from"))
        if role not in ("assistant", "gpt"):
            raise DataError(f"`{name}` must be the assistant's answer; got a {role!r} message")
        value = value.get("content", value.get("value"))
        if value is None:
            raise DataError(f"`{name}`: missing `content`")
    return _text(value, f"`{name}`", allow_parts=True)


def _check_prompt(prompt: list) -> None:
    if not prompt:
        raise DataError("the prompt is empty: no user message before the answers")
    check_messages(prompt, require_reply=False)
    if prompt[-1]["role"] == "assistant":
        raise DataError(
            "the prompt ends with an assistant message; it must end with the user "
            "message (or tool result) the answers reply to"
        )


def _check_answer(text: str, name: str) -> None:
    if not text.strip():
        raise DataError(f"the {name} answer is empty")


# ----------------------------------------------------------------------------- encoding


def encode_answer(tokenizer, prompt: list, answer: str, tools=None) -> tuple[list, list]:
    """(prompt_ids, answer_ids): the template's tokens of prompt + reply, split where the reply
    starts; the answer runs through the end-of-turn token."""
    head = render(tokenizer, prompt, tools, add_generation_prompt=True)
    full = render(tokenizer, prompt + [{"role": "assistant", "content": answer}], tools)
    if not full.startswith(head):
        raise DataError(
            "the chat template does not render the prompt as a prefix of prompt + "
            "answer; cannot tell the answer's tokens"
        )
    eos = tokenizer.eos_token or ""
    end = len(full.rstrip()) if eos and full.rstrip().endswith(eos) else len(full)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    prompt_ids, answer_ids = [], []
    for token, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"]):
        if stop <= len(head):
            prompt_ids.append(token)
        elif start < len(head):
            raise DataError("a token spans the end of the prompt and the start of the answer")
        elif stop <= end:
            answer_ids.append(token)
    return prompt_ids, answer_ids


def encode_preference(
    tokenizer, sample: PreferenceSample, max_length: int, truncation: str = "truncate", system: str | None = None
) -> EncodedPair:
    prompt = sample.prompt
    if system and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system}] + prompt
    prompt_ids, chosen_ids = encode_answer(tokenizer, prompt, sample.chosen, sample.tools)
    rejected_ids = None
    if sample.rejected is not None:
        other_prompt, rejected_ids = encode_answer(tokenizer, prompt, sample.rejected, sample.tools)
        if other_prompt != prompt_ids:
            raise DataError("the prompt encodes differently before the two answers")
    room = max_length - len(prompt_ids)
    longest = max(len(chosen_ids), len(rejected_ids or []))
    truncated = longest > room
    if truncated:
        if truncation == "drop" or room < 1:
            raise DataError(
                f"{len(prompt_ids) + longest} tokens, over --max-length "
                f"{max_length}"
                + (" (--truncation drop)" if room >= 1 else f"; the prompt alone has {len(prompt_ids)}")
            )
        chosen_ids = chosen_ids[:room]
        rejected_ids = rejected_ids[:room] if rejected_ids is not None else None
    return EncodedPair(prompt_ids, chosen_ids, rejected_ids, sample.origin, sample.label, truncated)


def encode_preferences(
    tokenizer, samples: list, max_length: int, truncation: str = "truncate", system: str | None = None
) -> EncodeReport:
    report = EncodeReport()
    for sample in samples:
        add_encoded(
            report, sample, lambda sample=sample: encode_preference(tokenizer, sample, max_length, truncation, system)
        )
    return report
