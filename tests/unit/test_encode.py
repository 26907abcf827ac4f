"""Encoding equals the real Qwen2.5 chat template, and labels cover exactly the replies + <|im_end|>."""

import pytest

from lora_lab.data.encode import IGNORE_INDEX, encode_sample, show_trained_spans
from lora_lab.data.formats import Sample
from lora_lab.errors import DataError

IM_START, IM_END, NEWLINE = 151644, 151645, 198

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "single turn, template's default system": [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Aurora."},
    ],
    "own system prompt": [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, hello!"},
    ],
    "multi-turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "times 10?"},
        {"role": "assistant", "content": "40"},
        {"role": "user", "content": "minus 1?"},
        {"role": "assistant", "content": "39"},
    ],
    "chinese": [
        {"role": "user", "content": "你是谁？请用中文回答。"},
        {"role": "assistant", "content": "我是一个由实验室训练的助手，很高兴认识你！"},
    ],
    "leading and trailing whitespace, newlines": [
        {"role": "user", "content": "\n\n  code please  \n"},
        {"role": "assistant", "content": "\n```python\nprint('hi')\n```\n\n"},
    ],
    "tool call and tool result": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "two tool results in a row": [
        {"role": "user", "content": "Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "21"},
        {"role": "tool", "content": "25"},
        {"role": "assistant", "content": "Paris 21, Rome 25."},
    ],
}


def _tools(messages):
    return [WEATHER_TOOL] if any(m["role"] == "tool" for m in messages) else None


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_input_ids_equal_apply_chat_template(tokenizer, name):
    messages = CONVERSATIONS[name]
    tools = _tools(messages)
    encoded = encode_sample(tokenizer, Sample(messages, "t:1", tools), max_length=4096)
    expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert encoded.input_ids == list(expected)
    assert not encoded.truncated


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_labels_are_exactly_the_assistant_replies(tokenizer, name):
    messages = CONVERSATIONS[name]
    tools = _tools(messages)
    encoded = encode_sample(tokenizer, Sample(messages, "t:1", tools), max_length=4096)
    trained = [i for i, label in enumerate(encoded.labels) if label != IGNORE_INDEX]
    assert all(encoded.labels[i] == encoded.input_ids[i] for i in trained)
    # Each trained span is preceded by "<|im_start|>assistant\n" and ends with <|im_end|>.
    spans, start = [], None
    for i, label in enumerate(encoded.labels):
        if label != IGNORE_INDEX and start is None:
            start = i
        if label == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    assistant_turns = sum(m["role"] == "assistant" for m in messages)
    assert len(spans) == assistant_turns
    for begin, end in spans:
        assert encoded.input_ids[end - 1] == IM_END
        assert encoded.input_ids[end] == NEWLINE  # the newline after <|im_end|> is not trained
        # A token that straddles the header and the reply ("\n\n") stays untrained.
        before = tokenizer.decode(encoded.input_ids[:begin])
        assert before.rstrip("\n").endswith("<|im_start|>assistant")
    # Decoding the spans gives back the replies, each followed by <|im_end|>.
    texts = [tokenizer.decode(encoded.input_ids[b:e]) for b, e in spans]
    replies = [m for m in messages if m["role"] == "assistant"]
    for text, reply in zip(texts, replies):
        assert text.endswith("<|im_end|>")
        assert reply["content"].strip() in text


def test_exact_ids_and_labels_of_a_short_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
    ]
    encoded = encode_sample(tokenizer, Sample(messages, "t:1"), max_length=64)
    system, user, assistant = 8948, 872, 77091
    s_id, hi = tokenizer.encode("S")[0], tokenizer.encode("Hi")[0]
    yo = tokenizer.encode("Yo")
    assert encoded.input_ids == [
        IM_START,
        system,
        NEWLINE,
        s_id,
        IM_END,
        NEWLINE,
        IM_START,
        user,
        NEWLINE,
        hi,
        IM_END,
        NEWLINE,
        IM_START,
        assistant,
        NEWLINE,
        *yo,
        IM_END,
        NEWLINE,
    ]
    assert encoded.labels == [IGNORE_INDEX] * 15 + [*yo, IM_END, IGNORE_INDEX]


def test_default_system_prompt_is_added_by_the_template(tokenizer):
    encoded = encode_sample(tokenizer, Sample(CONVERSATIONS["chinese"], "t:1"), max_length=512)
    assert "You are Qwen, created by Alibaba Cloud." in tokenizer.decode(encoded.input_ids)


def test_system_flag_replaces_the_default(tokenizer):
    encoded = encode_sample(
        tokenizer, Sample(CONVERSATIONS["chinese"], "t:1"), max_length=512, system="Custom system."
    )
    text = tokenizer.decode(encoded.input_ids)
    assert "Custom system." in text and "You are Qwen" not in text


def test_truncate_cuts_the_end(tokenizer):
    long = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time " * 200},
    ]
    full = encode_sample(tokenizer, Sample(long, "t:1"), max_length=10_000)
    cut = encode_sample(tokenizer, Sample(long, "t:1"), max_length=100)
    assert cut.truncated and len(cut.input_ids) == 100
    assert cut.input_ids == full.input_ids[:100] and cut.labels == full.labels[:100]


def test_drop_strategy_refuses_long_samples(tokenizer):
    long = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 300}]
    with pytest.raises(DataError, match="over --max-length 64"):
        encode_sample(tokenizer, Sample(long, "t:1"), max_length=64, truncation="drop")


def test_sample_without_trainable_token_after_truncation_is_refused(tokenizer):
    long = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(DataError, match="no assistant token left"):
        encode_sample(tokenizer, Sample(long, "t:1"), max_length=50)


def test_preview_marks_trained_spans(tokenizer):
    encoded = encode_sample(tokenizer, Sample(CONVERSATIONS["own system prompt"], "t:1"), 512)
    shown = show_trained_spans(tokenizer, encoded)
    assert "<|im_start|>assistant\n[[Arr, hello!<|im_end|>]]\n" in shown
    assert shown.count("[[") == 1


def test_a_template_that_renders_no_reply_in_place_is_one_clear_bad_row():
    """A template whose prefixes are not prefixes of the whole and which changes the reply's
    text (here: a count first, the content upper-cased) cannot have its replies marked."""
    from transformers import AutoTokenizer

    from tests.support.tiny import TOKENIZER_DIR

    counting = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    counting.chat_template = (
        "{{ messages|length }}{% for m in messages %}<{{ m.role }}>{{ m.content|upper }}<|im_end|>{% endfor %}"
    )
    rows = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(DataError, match="nor an assistant reply as its own text"):
        encode_sample(counting, Sample(rows, "t:1"), 64)
