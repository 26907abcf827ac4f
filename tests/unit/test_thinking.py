"""Qwen3 thinking-aware labels: ids equal the real Qwen3 chat template in both modes, the empty
think block carries no loss, a reasoning block does, and earlier turns follow the rendered text."""

import shutil
from pathlib import Path

import pytest

from lora_lab.data.encode import IGNORE_INDEX, encode_sample
from lora_lab.data.formats import Sample, normalise_row
from lora_lab.errors import DataError
from lora_lab.paths import shipped_tokenizer_dir

QWEN3_ASSETS = Path(__file__).parents[1] / "assets" / "qwen3-tokenizer"
THINK, END_THINK, IM_END = 151667, 151668, 151645


def build_qwen3_tokenizer(folder: Path) -> Path:
    """Qwen3's tokenizer: the Qwen2.5 vocabulary and merges with Qwen3's tokenizer_config.json
    (its added tokens and chat template); SOURCE.md in the assets says why that is Qwen3's."""
    shutil.copy(shipped_tokenizer_dir() / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(QWEN3_ASSETS / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_qwen3_tokenizer(tmp_path_factory.mktemp("q3")))


def trained_text(tokenizer, encoded) -> list:
    """The trained stretches, decoded, in order."""
    pieces, run = [], []
    for token, label in zip(encoded.input_ids, encoded.labels):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    if run:
        pieces.append(tokenizer.decode(run))
    return pieces


PLAIN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
]
HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "times 10?"},
    {"role": "assistant", "content": "40", "reasoning_content": "4 x 10 = 40."},
]


def test_qwen3_tokenizer_has_the_documented_ids(qwen3):
    assert len(qwen3) == 151669
    assert qwen3.convert_tokens_to_ids(["<tool_response>", "</tool_response>", "<think>", "</think>"]) == [
        151665,
        151666,
        151667,
        151668,
    ]
    assert qwen3("<think>\n\n</think>\n\n")["input_ids"] == [THINK, 271, END_THINK, 271]


@pytest.mark.parametrize("mode", ["false", "true", "auto"])
def test_plain_reply_ids_equal_template_and_empty_think_has_no_loss(qwen3, mode):
    encoded = encode_sample(qwen3, Sample(PLAIN, "t:1"), 512, enable_thinking=mode)
    expected = qwen3.apply_chat_template(PLAIN, tokenize=True, return_dict=False, enable_thinking=mode == "true")
    assert encoded.input_ids == list(expected)
    start = encoded.input_ids.index(THINK)
    assert encoded.input_ids[start : start + 4] == [THINK, 271, END_THINK, 271]
    assert encoded.labels[start : start + 4] == [IGNORE_INDEX] * 4
    assert trained_text(qwen3, encoded) == ["Hello!<|im_end|>"]


@pytest.mark.parametrize(
    "messages",
    [REASONING, [REASONING[0], {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\n\n4"}]],
    ids=["reasoning_content", "think block in content"],
)
def test_reasoning_reply_keeps_its_think_block_trained(qwen3, messages):
    encoded = encode_sample(qwen3, Sample(messages, "t:1"), 512)
    expected = qwen3.apply_chat_template(messages, tokenize=True, return_dict=False, enable_thinking=True)
    assert encoded.input_ids == list(expected)
    assert trained_text(qwen3, encoded) == ["<think>\nTwo plus two is four.\n</think>\n\n4<|im_end|>"]


def test_multi_turn_labels_follow_the_rendered_text(qwen3):
    encoded = encode_sample(qwen3, Sample(HISTORY, "t:1"), 512)
    expected = qwen3.apply_chat_template(HISTORY, tokenize=True, return_dict=False, enable_thinking=True)
    assert encoded.input_ids == list(expected)
    # the template drops the think block of the earlier reply: it is neither read nor trained
    assert encoded.input_ids.count(THINK) == 1
    assert trained_text(qwen3, encoded) == ["4<|im_end|>", "<think>\n4 x 10 = 40.\n</think>\n\n40<|im_end|>"]


def test_non_thinking_mode_drops_reasoning(qwen3):
    encoded = encode_sample(qwen3, Sample(HISTORY, "t:1"), 512, enable_thinking="false")
    plain = [HISTORY[0], {"role": "assistant", "content": "4"}, HISTORY[2], {"role": "assistant", "content": "40"}]
    expected = qwen3.apply_chat_template(plain, tokenize=True, return_dict=False, enable_thinking=False)
    assert encoded.input_ids == list(expected)
    assert trained_text(qwen3, encoded) == ["4<|im_end|>", "40<|im_end|>"]


def test_the_rows_own_flag_wins(qwen3):
    forced = encode_sample(qwen3, Sample(REASONING, "t:1", enable_thinking=False), 512, enable_thinking="true")
    assert trained_text(qwen3, forced) == ["4<|im_end|>"]
    assert THINK in forced.input_ids and END_THINK in forced.input_ids  # the empty block
    with pytest.raises(DataError, match="enable_thinking must be one of"):
        encode_sample(qwen3, Sample(PLAIN, "t:1"), 512, enable_thinking="maybe")


def test_rows_carry_reasoning_content_and_enable_thinking():
    sample = normalise_row({"messages": REASONING, "enable_thinking": False}, "messages", "f:1")
    assert sample.messages[1]["reasoning_content"] == "Two plus two is four."
    assert sample.enable_thinking is False
    with pytest.raises(DataError, match="`enable_thinking` must be true or false"):
        normalise_row({"messages": PLAIN, "enable_thinking": "no"}, "messages", "f:1")


def test_templates_without_thinking_ignore_the_setting(tokenizer):
    encoded = encode_sample(tokenizer, Sample(PLAIN, "t:1"), 512, enable_thinking="false")
    assert encoded.input_ids == list(tokenizer.apply_chat_template(PLAIN, tokenize=True, return_dict=False))


def test_tiny_qwen3_trains_on_reasoning_and_plain_rows(tmp_path, qwen3):
    """Three steps of the real Trainer on a tiny random Qwen3 with the Qwen3 tokenizer."""
    import json

    import torch
    from click.testing import CliRunner
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lora_lab.cli import main

    model_dir = tmp_path / "tiny-qwen3"
    model_dir.mkdir()
    build_qwen3_tokenizer(model_dir)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    rows = [{"messages": HISTORY}, {"messages": PLAIN}, {"messages": PLAIN, "enable_thinking": True}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--model",
                model_dir,
                "--data",
                data,
                "--max-steps",
                3,
                "--grad-accum",
                1,
                "--lora-rank",
                4,
                "--output-dir",
                tmp_path,
                "--run-name",
                "r",
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "adapter" / "adapter_model.safetensors").is_file()
    summary = json.loads((tmp_path / "r" / "run_summary.json").read_text())
    trained = [
        "4<|im_end|>",
        "<think>\n4 x 10 = 40.\n</think>\n\n40<|im_end|>",
        "Hello!<|im_end|>",
        "Hello!<|im_end|>",
    ]  # no empty think block among them
    assert summary["global_step"] == 3
    assert summary["trained_tokens"] == sum(len(qwen3(text)["input_ids"]) for text in trained)


TOOL_TALK = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "21"},
    {"role": "assistant", "content": "21 degrees."},
]


def test_tool_call_turns_follow_the_rendered_text(qwen3):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    messages = TOOL_TALK
    encoded = encode_sample(qwen3, Sample(messages, "t:1", [tool]), 1024)
    expected = qwen3.apply_chat_template(
        messages, tools=[tool], tokenize=True, return_dict=False, enable_thinking=False
    )
    assert encoded.input_ids == list(expected)
    assert trained_text(qwen3, encoded) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "21 degrees.<|im_end|>",
    ]
