"""The real tokenizers and chat templates of Phi-3, Mistral, Llama 3 and Qwen3 (tests/support/
families.py; tests/assets/SOURCE.md says where each came from): their ids equal an independent
reference, and lora-lab's encoder gives apply_chat_template's ids and trains exactly each reply
and the token that closes it."""

import pytest

from lora_lab.data.encode import IGNORE_INDEX, encode_sample
from lora_lab.data.formats import Sample
from tests.support import families

ONE_TURN = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]
TWO_TURNS = ONE_TURN + [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "Made by Lora Lab."}]
SYSTEM = [{"role": "system", "content": "Be brief."}]


def trained_runs(encoded) -> list:
    """The trained stretches of ids, in order."""
    runs, run = [], []
    for token, label in zip(encoded.input_ids, encoded.labels):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def encode(tokenizer, messages):
    encoded = encode_sample(tokenizer, Sample(messages, "t:1"), 512)
    expected = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, chat_template=families.on_template_day(tokenizer.chat_template)
    )
    assert encoded.input_ids == list(expected)
    return encoded


@pytest.fixture(scope="module")
def phi3():
    return families.phi3_tokenizer()


@pytest.fixture(scope="module")
def phi35():
    return families.phi3_tokenizer("phi-3.5")


@pytest.fixture(scope="module")
def mistral():
    return families.mistral_tokenizer()


@pytest.fixture(scope="module")
def llama3():
    return families.llama3_tokenizer()


# ---- the vocabularies against llama.cpp's reference ids (from each model's own HF tokenizer)


@pytest.mark.parametrize("name", ["phi3", "llama3", "qwen3"])
def test_ids_equal_llama_cpp_reference_ids(name, request, tmp_path):
    if name == "qwen3":
        from transformers import AutoTokenizer

        from tests.unit.test_thinking import build_qwen3_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(build_qwen3_tokenizer(tmp_path))
    else:
        tokenizer = request.getfixturevalue(name)
    gguf, folder = {
        "phi3": ("ggml-vocab-phi-3.gguf", families.PHI3),
        "llama3": ("ggml-vocab-llama-bpe.gguf", families.LLAMA3),
        "qwen3": ("ggml-vocab-qwen2.gguf", families.QWEN3),
    }[name]
    cases = families.llama_cpp_cases(gguf, folder)
    assert len(cases) == 47  # code, emoji, CJK, runs of spaces and newlines, digits
    wrong = [text for text, ids in cases if tokenizer.encode(text, add_special_tokens=False) != ids]
    assert wrong == []


def test_mistral_ids_equal_mistral_common_but_for_texts_with_leading_or_repeated_spaces(mistral):
    """mistral-common 1.13.1 (Mistral's own encoder, ids stored beside the tokenizer) on
    llama.cpp's 47 texts: equal on every text but the 15 that start with a space or hold a run
    of spaces before a word, where the tokenizer.json converted from the SentencePiece model merges the spaces
    differently (" Hello": [23325] here, [29473, 23325] there)."""
    import json
    import re

    reference = json.loads((families.MISTRAL / "mistral-common-ids.json").read_text())["ids"]
    cases = families.llama_cpp_cases("ggml-vocab-phi-3.gguf", families.PHI3)
    assert len(reference) == len(cases) == 47
    wrong = {text for (text, _), ids in zip(cases, reference) if mistral.encode(text, add_special_tokens=False) != ids}
    spaced = {text for text, _ in cases if re.search(r"^ | {2,}\S", text)}
    assert wrong == spaced and len(wrong) == 15


# ---- chat templates through lora-lab's encoder


def test_phi3_own_template_trains_each_reply_to_its_end_token(phi3):
    """Phi-3-mini-4k's template (from its GGUF) drops the system turn and closes each reply with
    <|end|> (32007) then a newline: the newline after <|end|> is not trained."""
    encoded = encode(phi3, SYSTEM + TWO_TURNS)
    assert encoded.input_ids == [
        1,
        32010,
        29871,
        13,
        22110,
        526,
        366,
        29973,
        32007,
        29871,
        13,
        32001,
        29871,
        13,
        29902,
        626,
        23266,
        2207,
        29889,
        32007,
        29871,
        13,
        32010,
        29871,
        13,
        2855,
        29973,
        32007,
        29871,
        13,
        32001,
        29871,
        13,
        29924,
        1943,
        491,
        365,
        2207,
        12016,
        29889,
        32007,
        29871,
        13,
    ]
    assert trained_runs(encoded) == [
        [29902, 626, 23266, 2207, 29889, 32007],
        [29924, 1943, 491, 365, 2207, 12016, 29889, 32007],
    ]
    assert phi3.convert_ids_to_tokens([32010, 32001, 32007, 32000]) == [
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
        "<|endoftext|>",
    ]


def test_phi35_template_closes_the_conversation_with_eos_and_earlier_replies_stay_apart(phi35):
    """Phi-3.5's template ends a conversation with <|endoftext|>: an earlier reply ends at its
    own <|end|> (not at the conversation's eos, which would train the user turn between)."""
    encoded = encode(phi35, SYSTEM + TWO_TURNS)
    assert encoded.input_ids[:9] == [32006, 29871, 13, 3629, 11473, 29889, 32007, 29871, 13]
    assert trained_runs(encoded) == [
        [29902, 626, 23266, 2207, 29889, 32007],
        [29924, 1943, 491, 365, 2207, 12016, 29889, 32007, 29871, 13, 32000],
    ]


# mistral-common 1.13.1's encode_chat_completion (finetuning mode) of each conversation
MISTRAL_COMMON_IDS = {
    "one turn": [1, 3, 7294, 1228, 1136, 29572, 4, 1083, 1605, 26703, 4196, 29491, 2],
    "system, one turn": [
        1,
        3,
        2507,
        7585,
        29491,
        781,
        781,
        12215,
        1228,
        1136,
        29572,
        4,
        1083,
        1605,
        26703,
        4196,
        29491,
        2,
    ],
    "two turns": [
        1,
        3,
        7294,
        1228,
        1136,
        29572,
        4,
        1083,
        1605,
        26703,
        4196,
        29491,
        2,
        3,
        1783,
        29572,
        4,
        17738,
        1254,
        1161,
        4196,
        10844,
        29491,
        2,
    ],
    # the v3 template moves the system prompt into the last user turn: no prefix of this
    # conversation renders as a prefix of the whole, and the first reply is found in place
    "system, two turns": [
        1,
        3,
        7294,
        1228,
        1136,
        29572,
        4,
        1083,
        1605,
        26703,
        4196,
        29491,
        2,
        3,
        2507,
        7585,
        29491,
        781,
        781,
        3235,
        29572,
        4,
        17738,
        1254,
        1161,
        4196,
        10844,
        29491,
        2,
    ],
}


@pytest.mark.parametrize("name", list(MISTRAL_COMMON_IDS))
def test_mistral_ids_equal_mistral_common_and_each_reply_is_trained_with_eos(mistral, name):
    messages = {
        "one turn": ONE_TURN,
        "system, one turn": SYSTEM + ONE_TURN,
        "two turns": TWO_TURNS,
        "system, two turns": SYSTEM + TWO_TURNS,
    }[name]
    encoded = encode(mistral, messages)
    assert encoded.input_ids == MISTRAL_COMMON_IDS[name]
    replies = [[1083, 1605, 26703, 4196, 29491, 2], [17738, 1254, 1161, 4196, 10844, 29491, 2]]
    assert trained_runs(encoded) == replies[: len(messages) // 2]
    assert mistral.convert_ids_to_tokens([3, 4, 2]) == ["[INST]", "[/INST]", "</s>"]


def test_llama3_template_trains_each_reply_to_eot(llama3):
    """Llama 3.2's template: a system block with the knowledge cut-off and today's date (read as
    encode.TEMPLATE_DAY, whatever day it is), then header-wrapped turns each closed by <|eot_id|>
    (128009), which is trained."""
    encoded = encode(llama3, SYSTEM + TWO_TURNS)
    text = llama3.decode(encoded.input_ids)
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2026\n\n"
    )
    assert text.endswith(
        "\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Who are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
        "\n\nI am Aurora.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "And?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Made by Lora Lab.<|eot_id|>"
    )
    assert trained_runs(encoded) == [[40, 1097, 47892, 13, 128009], [41581, 555, 445, 6347, 11868, 13, 128009]]
    assert llama3.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    ) == [128000, 128006, 128007, 128009]


def test_qwen3_template_equals_llama_cpp_copy_of_qwen3_0_6b(tmp_path):
    """llama.cpp's copy of Qwen/Qwen3-0.6B's template (an earlier revision: no `is string`
    checks) renders the same text as tests/assets' template in both modes, with and without a
    generation prompt, tools and reasoning."""
    from transformers import AutoTokenizer

    from tests.unit.test_thinking import HISTORY, PLAIN, REASONING, build_qwen3_tokenizer

    qwen3 = AutoTokenizer.from_pretrained(build_qwen3_tokenizer(tmp_path))
    other = (families.QWEN3 / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    tools = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object"}}}]
    called = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    for messages, tool_list in [(PLAIN, None), (REASONING, None), (HISTORY, None), (called, tools)]:
        for thinking in (True, False):
            for prompt in (False, True):
                rows = messages[:-1] if prompt else messages
                kwargs = dict(tools=tool_list, tokenize=False, enable_thinking=thinking, add_generation_prompt=prompt)
                assert qwen3.apply_chat_template(rows, **kwargs) == qwen3.apply_chat_template(
                    rows, chat_template=other, **kwargs
                )
