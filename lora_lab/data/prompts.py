"""Prompt data for --task grpo: the prompts completions are sampled for, and the columns their
rewards read (docs/grpo.md).

Row forms:
  {"messages": [..., the user's turn], ...}   a conversation ending with the user (ms-swift's
                                              GRPO rows); a final assistant message is refused
  {"prompt": text or messages, ...}           TRL's; a text prompt is the user's message
  {"conversations": [...]}                    sharegpt; {"instruction", "input"}: alpaca
Every other field of the row (`solution`, `answer`, ...) reaches the reward functions as a
keyword argument of that name, one value per completion, as TRL hands a dataset's columns to
them. A row that cannot be used is reported with file:line and the reason.

Encoding: the prompt's ids are apply_chat_template(prompt, add_generation_prompt=True) with the
template arguments of prompt_template_kwargs, the ids TRL's GRPOTrainer generates from.
data.max_length bounds the prompt; grpo.max_completion_length the completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DataError
from .encode import IGNORE_INDEX, EncodeReport, add_encoded, render
from .pairs import _check_prompt, _conversation, read_object_rows
from .reading import LoadedData, open_spec

FORM_FIELDS = ("messages", "prompt", "conversations", "instruction", "input", "system")
"""Fields a row form reads its prompt from; the others go to the rewards."""
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""Keyword arguments TRL gives every reward function itself: no column may take their names."""


@dataclass
class PromptSample:
    prompt: list
    """The conversation the completion continues (messages, ending with the user's turn)."""
    origin: str
    columns: dict = field(default_factory=dict)
    """The row's other fields, for the rewards."""


@dataclass
class EncodedPrompt:
    prompt_ids: list
    prompt: list
    columns: dict
    origin: str
    truncated: bool = False
    origins = None

    @property
    def input_ids(self) -> list:
        return self.prompt_ids

    @property
    def labels(self) -> list:
        """No token of a prompt is trained on (the data fingerprint reads the labels)."""
        return [IGNORE_INDEX] * len(self.prompt_ids)

    @property
    def trained_tokens(self) -> int:
        return 0

    def row(self) -> dict:
        """The row TRL's GRPOTrainer reads: the prompt as messages and the reward columns."""
        return {"prompt": self.prompt, **self.columns}


def load_prompt_spec(spec: str, seed: int = 42) -> LoadedData:
    """One --data entry of prompt rows (opened by reading.open_spec), each checked; `#N`
    samples N of them."""
    return read_object_rows(open_spec(spec), prompt_sample, "grpo prompts", seed)


def prompt_sample(row: dict, origin: str) -> PromptSample:
    """One raw row -> PromptSample; raises DataError naming the field at fault."""
    if not any(key in row for key in FORM_FIELDS[:4]):
        raise DataError(
            "no prompt: --task grpo reads `messages` ending with the user's turn, or `prompt` "
            "(text or messages), `conversations` or `instruction`"
        )
    if "tools" in row:
        raise DataError("field `tools`: --task grpo samples plain replies; tool calls are not run")
    prompt = _conversation(row)
    if prompt and prompt[-1]["role"] == "assistant":
        raise DataError(
            "the conversation ends with an assistant message; a GRPO prompt ends with the user's turn "
            "(the completions are sampled). Put a reference answer in a column such as `solution` "
            "for the rewards"
        )
    _check_prompt(prompt)
    columns = {key: value for key, value in row.items() if key not in FORM_FIELDS}
    taken = sorted(set(columns) & set(REWARD_ARGUMENTS))
    if taken:
        raise DataError(f"field `{taken[0]}` has the name of an argument TRL gives every reward itself; rename it")
    return PromptSample(prompt, origin, columns)


def prompt_template_kwargs(tokenizer, enable_thinking) -> dict:
    """The chat template's arguments for the prompts: data.enable_thinking true or false where
    the template reads it; auto leaves the template's own default."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    mode = str(enable_thinking).lower()
    if "enable_thinking" not in template or mode == "auto":
        return {}
    return {"enable_thinking": mode == "true"}


def encode_prompt(tokenizer, sample: PromptSample, max_length: int, system: str | None, template: dict):
    prompt = sample.prompt
    if system and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system}] + prompt
    text = render(tokenizer, prompt, add_generation_prompt=True, **template)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_length:
        raise DataError(f"the prompt has {len(ids)} tokens, over --max-length {max_length} (a prompt is never cut)")
    return EncodedPrompt(ids, prompt, sample.columns, sample.origin)


def encode_prompts(tokenizer, samples: list, max_length: int, system: str | None, enable_thinking) -> EncodeReport:
    report = EncodeReport()
    template = prompt_template_kwargs(tokenizer, enable_thinking)
    for sample in samples:
        add_encoded(
            report, sample, lambda sample=sample: encode_prompt(tokenizer, sample, max_length, system, template)
        )
    return report
