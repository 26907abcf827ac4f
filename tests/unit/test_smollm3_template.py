"""SmolLM3-3B's real chat template (tests/assets/smollm3-template, its SOURCE.md) through
lora-lab's encoder, with Qwen3's tokenizer standing in for SmolLM3's (not reachable here): the
trained text of each thinking mode, its empty think block masked, reasoning_content kept, the
date of its system block fixed, and tool calls it would drop refused."""

from pathlib import Path

import pytest

from lora_lab.data.encode import IGNORE_INDEX, encode_sample, with_inline_reasoning
from lora_lab.data.formats import Sample
from lora_lab.errors import DataError
from tests.unit.test_thinking import HISTORY, PLAIN, REASONING, TOOL_TALK, build_qwen3_tokenizer, trained_text

TEMPLATE = Path(__file__).parents[1] / "assets" / "smollm3-template" / "HuggingFaceTB-SmolLM3-3B.jinja"


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_qwen3_tokenizer(tmp_path_factory.mktemp("smol3")))
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def test_a_non_thinking_reply_trains_without_its_one_newline_empty_think_block(smollm3):
    encoded = encode_sample(smollm3, Sample(PLAIN, "t:1"), 1024, enable_thinking="false")
    text = smollm3.decode(encoded.input_ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\nHello!<|im_end|>\n")
    assert "Reasoning Mode: /no_think" in text
    think = encoded.input_ids.index(smollm3.convert_tokens_to_ids("<think>"))
    assert encoded.labels[think : think + 4] == [IGNORE_INDEX] * 4
    assert trained_text(smollm3, encoded) == ["Hello!<|im_end|>"]


@pytest.mark.parametrize("mode", ["auto", "true"])
def test_reasoning_content_is_trained_as_the_think_block_the_template_never_writes(smollm3, mode):
    """The template ignores reasoning_content (the reply would train without its reasoning):
    it goes to the front of the content, as the template writes an empty block."""
    encoded = encode_sample(smollm3, Sample(REASONING, "t:1"), 1024, enable_thinking=mode)
    assert trained_text(smollm3, encoded) == ["<think>\nTwo plus two is four.\n</think>\n4<|im_end|>"]
    folded = [REASONING[0], with_inline_reasoning(REASONING[1])]
    assert folded[1] == {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\n4"}
    assert smollm3.decode(encoded.input_ids) == smollm3.apply_chat_template(
        folded,
        tokenize=False,
        enable_thinking=True,
        chat_template=TEMPLATE.read_text().replace('strftime_now("%d %B %Y")', '"01 January 2026"'),
    )


def test_earlier_think_blocks_stay_and_non_thinking_mode_drops_every_one(smollm3):
    thinking = encode_sample(smollm3, Sample(HISTORY, "t:1"), 1024, enable_thinking="auto")
    assert trained_text(smollm3, thinking) == [
        "<think>\nAdd them.\n</think>\n\n4<|im_end|>",
        "<think>\n4 x 10 = 40.\n</think>\n40<|im_end|>",
    ]
    plain = encode_sample(smollm3, Sample(HISTORY, "t:1"), 1024, enable_thinking="false")
    assert trained_text(smollm3, plain) == ["4<|im_end|>", "40<|im_end|>"]


def test_the_system_block_reads_a_fixed_day_so_a_sample_encodes_the_same_every_day(smollm3):
    text = smollm3.decode(encode_sample(smollm3, Sample(PLAIN, "t:1"), 1024).input_ids)
    assert "Knowledge Cutoff Date: June 2025\nToday Date: 01 January 2026\nReasoning Mode: /no_think\n" in text


def test_a_tool_call_the_template_does_not_render_is_refused(smollm3):
    with pytest.raises(DataError, match="does not render the tool_calls.*get_weather is not in the text"):
        encode_sample(smollm3, Sample(TOOL_TALK, "t:1"), 1024)
