"""gpt-oss's harmony chat format with its real tokenizer (openai/gpt-oss-20b's files) and the
harmony template (tests/support/families.py): lora-lab encodes a conversation to exactly the ids
of `apply_chat_template`, and trains each reply from its channel header on: the last one, with its
analysis (thinking), through `<|return|>`, where gpt-oss stops; an earlier one up to the `<|end|>`
the template closes it with once the conversation goes on (gpt-oss itself ends a final answer
with `<|return|>`)."""

from __future__ import annotations

import pytest

from lora_lab.data.encode import Sample, encode_sample
from tests.support import families
from tests.support.families import gpt_oss_tokenizer_dir

TALK = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "thinking": "Two and two make four."},
]


@pytest.fixture(scope="module")
def harmony():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpt_oss_tokenizer_dir())


def trained_spans(tokenizer, encoded) -> list[str]:
    spans, current = [], []
    for token, label in zip(encoded.input_ids, encoded.labels, strict=True):
        if label != -100:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans + ([tokenizer.decode(current)] if current else [])


def test_the_ids_are_the_templates_and_each_reply_trains_from_its_channel(harmony):
    encoded = encode_sample(harmony, Sample(messages=TALK, origin="talk.jsonl:1"), 1024)
    dated = families.on_template_day(harmony.chat_template)
    assert encoded.input_ids == harmony.apply_chat_template(
        TALK, tokenize=True, return_dict=False, chat_template=dated
    )
    assert trained_spans(harmony, encoded) == [
        "<|channel|>final<|message|>Hello!",
        "<|channel|>analysis<|message|>Two and two make four.<|end|><|start|>assistant"
        "<|channel|>final<|message|>4<|return|>",
    ]
    assert harmony.convert_tokens_to_ids("<|return|>") == 200002 == encoded.input_ids[-1]
