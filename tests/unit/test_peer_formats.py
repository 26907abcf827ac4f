"""The demo data LLaMA-Factory and ms-swift ship, read as their authors document it (issue #18).

Fixtures are real rows (tests/assets/peers/SOURCE.md). Token ids are compared with the real
Qwen2.5 tokenizer's apply_chat_template; labels with the spans the template renders.
"""

import json
import shutil

import pytest

from lora_lab.config import DataArgs
from lora_lab.data import load_samples, prepare_data
from lora_lab.data.encode import IGNORE_INDEX, encode_sample
from lora_lab.data.reading import load_dataset_spec
from lora_lab.errors import DataError
from tests.support.tiny import ASSETS, write_jsonl

PEERS = ASSETS / "peers"
INFO = PEERS / "dataset_info.json"
AREA_TOOL = {
    "name": "calculate_area",
    "description": "Calculate the area of a given shape",
    "parameters": {
        "type": "object",
        "properties": {
            "shape": {"type": "string", "description": "The shape for which to calculate the area"},
            "dimensions": {
                "type": "array",
                "items": {"type": "number"},
                "description": "The dimensions required to calculate the area",
            },
        },
        "required": ["shape", "dimensions"],
    },
}


def template_ids(tokenizer, messages, tools=None):
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def spans_of(labels):
    spans, start = [], None
    for i, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        if label == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize("spec", [str(PEERS / "glaive_toolcall_en_demo.json"), f"{INFO}:glaive_toolcall_en_demo"])
def test_glaive_bare_tool_schemas_are_wrapped_as_openai_functions(tokenizer, spec):
    loaded = load_dataset_spec(spec)
    assert not loaded.problems and len(loaded.samples) == 1
    sample = loaded.samples[0]
    assert sample.origin.endswith("glaive_toolcall_en_demo.json:2")
    assert sample.tools[0] == {"type": "function", "function": AREA_TOOL}
    assert [t["function"]["name"] for t in sample.tools] == ["calculate_area", "calculate_discount"]
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "tool", "assistant"] * 3
    assert sample.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}},
            }
        ],
    }
    encoded = encode_sample(tokenizer, sample, max_length=4096)
    assert encoded.input_ids == template_ids(tokenizer, sample.messages, sample.tools)
    text = tokenizer.decode(encoded.input_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "calculate_area"' in text
    # the served system prompt: each tool is 34 characters longer than the bare schema
    bare = tokenizer.apply_chat_template(sample.messages, tools=[AREA_TOOL], tokenize=False)
    wrapped = tokenizer.apply_chat_template(sample.messages, tools=sample.tools[:1], tokenize=False)
    assert len(wrapped) - len(bare) == len('{"type": "function", "function": }')
    # six trained spans: 3 tool calls and 3 answers, each ending with <|im_end|>
    assert len(spans_of(encoded.labels)) == 6
    assert loaded.formats[0][1] in ("sharegpt", "LLaMA-Factory sharegpt (dataset_info.json:glaive_toolcall_en_demo)")


def test_empty_tool_list_string_means_no_tools(tmp_path):
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": "[]"}
    assert load_dataset_spec(str(write_jsonl(tmp_path / "d.jsonl", [row]))).samples[0].tools is None


def test_ms_swift_agent_roles(tokenizer):
    loaded = load_dataset_spec(str(PEERS / "swift_agent.jsonl"))
    assert not loaded.problems and not loaded.warnings
    sample = loaded.samples[0]

    def call(city):
        return {"type": "function", "function": {"name": "realtime_aqi", "arguments": {"city": city}}}

    assert sample.messages == [
        {"role": "user", "content": "What is the weather like in Beijing and Shanghai today?"},
        {"role": "assistant", "content": "", "tool_calls": [call("Beijing"), call("Shanghai")]},
        {"role": "tool", "content": '{"city": "Beijing", "aqi": "10", "unit": "celsius"}'},
        {"role": "tool", "content": '{"city": "Shanghai", "aqi": "72", "unit": "fahrenheit"}'},
        {
            "role": "assistant",
            "content": "According to the weather forecast tool, the air "
            "quality index (AQI) in Beijing is 10, which indicates "
            "good air quality; whereas in Shanghai, the AQI is 72, "
            "indicating mild pollution.",
        },
    ]
    assert sample.tools[0]["function"]["name"] == "realtime_aqi"
    encoded = encode_sample(tokenizer, sample, max_length=4096)
    assert encoded.input_ids == template_ids(tokenizer, sample.messages, sample.tools)
    spans = spans_of(encoded.labels)
    assert len(spans) == 2
    assert tokenizer.decode(encoded.input_ids[slice(*spans[0])]).count("<tool_call>") == 2


def test_consecutive_assistant_messages_are_joined_with_a_warning(tmp_path, tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": "<think>\nI check.\n</think>\n"},
            {"role": "tool_call", "content": '{"name": "clock", "arguments": {}}'},
            {"role": "tool_response", "content": "11:00"},
            {"role": "assistant", "content": "It is "},
            {"role": "assistant", "content": "11 o'clock."},
        ]
    }
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    loaded = load_dataset_spec(str(path))
    assert loaded.samples[0].messages == [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": "<think>\nI check.\n</think>\n",
            "tool_calls": [{"type": "function", "function": {"name": "clock", "arguments": {}}}],
        },
        {"role": "tool", "content": "11:00"},
        {"role": "assistant", "content": "It is 11 o'clock."},
    ]
    assert [(w.origin, w.reason.split(" follows")[0]) for w in loaded.warnings] == [(f"{path}:1", "message 6")]


def test_content_parts_loss_weight_and_lowercase_placeholders(tokenizer):
    args = DataArgs(model_name="Aurora", model_author="Lab X")
    loaded = load_samples([str(PEERS / "v1_sft_demo.jsonl")], args, seed=0)
    assert not loaded.problems and not loaded.warnings
    assert [s.messages for s in loaded.samples[:2]] == [
        [
            {"role": "user", "content": q},
            {
                "role": "assistant",
                "content": "Hello! I am Aurora, an AI assistant developed by Lab X. How can I assist you today?",
            },
        ]
        for q in ("hi", "hello")
    ]
    assert loaded.samples[2].messages[1]["content"] == (
        "您好，我是 Aurora，一个由 Lab X 开发的 AI 助手，很高兴认识您。请问我能为您做些什么？"
    )
    unfilled = load_dataset_spec(str(PEERS / "v1_sft_demo.jsonl"))
    assert [w.origin.rsplit(":", 1)[1] for w in unfilled.warnings] == ["1", "2", "3"]
    assert "pass --model-author and --model-name" in unfilled.warnings[0].reason


def test_per_message_loss_false_is_not_trained(tmp_path, tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Really?"},
        {"role": "assistant", "content": "4"},
    ]
    flagged = json.loads(json.dumps(messages))
    flagged[1]["loss"] = False
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": flagged}, {"messages": messages}])
    with_flag, without = load_dataset_spec(str(path)).samples
    assert with_flag.messages == without.messages == messages
    assert with_flag.trained == [False, False, False, True] and without.trained is None
    a, b = (encode_sample(tokenizer, s, 512) for s in (with_flag, without))
    assert a.input_ids == b.input_ids == template_ids(tokenizer, messages)
    assert spans_of(a.labels) == spans_of(b.labels)[1:]
    assert [x for x, y in zip(a.labels, b.labels) if x != y] == [IGNORE_INDEX] * 2  # "5", im_end


def test_loss_flags_that_cannot_be_honoured_are_errors(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q", "loss": True}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_weight": 0.5}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss": False}]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    reasons = [(p.origin, p.reason) for p in load_dataset_spec(str(path)).problems]
    assert reasons == [
        (
            f"{path}:1",
            "message 1: loss on a user message; lora-lab trains on assistant replies "
            "only (remove the flag, or make it the assistant's)",
        ),
        (
            f"{path}:2",
            "message 2: `loss_weight` must be 0 or 1 (lora-lab does not weight the loss); got a number (0.5)",
        ),
        (f"{path}:3", "every assistant reply has `loss: false`; nothing to train on"),
    ]


def test_identity_through_dataset_info_is_alpaca():
    loaded = load_dataset_spec(f"{INFO}:identity")
    assert loaded.formats == [(f"{INFO}:identity", "LLaMA-Factory alpaca (dataset_info.json:identity)")]
    assert loaded.samples[0].messages == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Hello! I am NAME, an AI assistant developed by AUTHOR. How can I assist you today?",
        },
    ]


@pytest.mark.parametrize(
    "spec, command",
    [
        (str(PEERS / "dpo_en_demo.json"), "`--task dpo`"),
        (f"{INFO}:dpo_en_demo", "`--task dpo`"),
        (str(PEERS / "kto_en_demo.json"), "`--task kto`"),
        (f"{INFO}:kto_en_demo", "`--task kto`"),
    ],
)
def test_preference_data_is_refused_by_sft_naming_the_task(spec, command):
    with pytest.raises(DataError) as error:
        load_dataset_spec(spec)
    message = str(error.value)
    assert message.startswith(f"--data {spec}: ")
    assert ("preference data" in message or "KTO data" in message) and command in message


def test_ms_swift_preference_row_in_an_sft_file_is_a_row_error(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {**good, "rejected_response": "no"}, {**good, "label": False}])
    loaded = load_dataset_spec(str(path))
    assert [s.origin for s in loaded.samples] == [f"{path}:1"]
    assert [p.origin for p in loaded.problems] == [f"{path}:2", f"{path}:3"]
    assert "`--task dpo`" in loaded.problems[0].reason
    assert "`--task kto`" in loaded.problems[1].reason


def test_ms_swift_sharegpt_and_query_response(tmp_path):
    rows = [
        {"system": "S", "conversation": [{"human": "q1", "assistant": "a1"}, {"human": "q2", "assistant": "a2"}]},
        {"system": "S", "query": "q2", "response": "a2", "history": [["q1", "a1"]]},
    ]
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    for index, row in enumerate(rows):
        loaded = load_dataset_spec(str(write_jsonl(tmp_path / f"{index}.jsonl", [row])))
        assert loaded.samples[0].messages == expected
    assert loaded.formats[0][1] == "query-response"


def test_pre_training_rows_train_every_token_packed(tmp_path, tokenizer):
    docs = ["The first document. " * 20, "第二个文档。", "A third."]
    path = write_jsonl(tmp_path / "pt.jsonl", [{"text": d} for d in docs])
    loaded = load_dataset_spec(str(path))
    assert loaded.formats == [(str(path), "text")]
    assert [s.text for s in loaded.samples] == docs
    prepared = prepare_data(DataArgs(datasets=[str(path)], max_length=64), tokenizer)
    stream = [t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    rows = prepared.train.samples
    assert [len(r.input_ids) for r in rows[:-1]] == [64] * (len(rows) - 1)
    assert [t for r in rows for t in r.input_ids] == stream
    assert all(r.labels == r.input_ids for r in rows)
    assert rows[-1].origins == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert prepared.summary(64).startswith(f"format: {path}: text\n")


def test_response_only_and_assistant_only_rows_are_pre_training_text(tmp_path):
    path = write_jsonl(
        tmp_path / "pt.jsonl",
        [
            {"messages": [{"role": "assistant", "content": "I love music"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        ],
    )
    loaded = load_dataset_spec(str(path))
    assert [s.text for s in loaded.samples] == ["I love music", None]
    assert loaded.formats[0][1] == "messages (1 pre-training rows)"
    path = write_jsonl(tmp_path / "r.jsonl", [{"response": "Coach, I want to play basketball"}])
    assert load_dataset_spec(str(path)).samples[0].text == "Coach, I want to play basketball"


def test_dataset_info_columns_tags_and_pre_training(tmp_path):
    shutil.copy(INFO, tmp_path / "unused.json")
    write_jsonl(tmp_path / "orca.jsonl", [{"question": "q", "response": "a", "system_prompt": "S"}])
    write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "conversation": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
                "system": "ignored: the system turn wins",
            }
        ],
    )
    write_jsonl(tmp_path / "c4.jsonl", [{"text": "a document"}])
    info = {
        "orca": {
            "file_name": "orca.jsonl",
            "columns": {"prompt": "question", "response": "response", "system": "system_prompt"},
        },
        "lmsys": {
            "file_name": "chat.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "conversation", "system": "system"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "system_tag": "system",
            },
        },
        "c4_demo": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    for name in ("orca", "lmsys"):
        loaded = load_dataset_spec(f"{tmp_path}/dataset_info.json:{name}")
        assert not loaded.problems and loaded.samples[0].messages == expected
    loaded = load_dataset_spec(f"{tmp_path}/dataset_info.json:c4_demo#3")
    assert [s.text for s in loaded.samples] == ["a document"] * 3
    assert loaded.formats[0][1] == "LLaMA-Factory text (dataset_info.json:c4_demo)"
    with pytest.raises(DataError, match=r"no dataset `nope` in .* \(it has: c4_demo, lmsys, "):
        load_dataset_spec(f"{tmp_path}/dataset_info.json:nope")


def test_data_validate_prints_the_detected_format(tmp_path):
    from click.testing import CliRunner

    from lora_lab.cli import main

    result = CliRunner().invoke(
        main, ["data", "validate", str(PEERS / "swift_agent.jsonl"), f"{INFO}:glaive_toolcall_en_demo"]
    )
    assert result.exit_code == 0, result.output
    assert f"format: {PEERS / 'swift_agent.jsonl'}: messages\n" in result.output
    assert (
        f"format: {INFO}:glaive_toolcall_en_demo: LLaMA-Factory sharegpt (dataset_info.json:glaive_toolcall_en_demo)\n"
    ) in result.output


def test_a_run_trains_on_pre_training_text(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from lora_lab.cli import main

    data = write_jsonl(tmp_path / "pt.jsonl", [{"text": f"Document {i}. " * 30} for i in range(4)])
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--model",
                tiny_model_dir,
                "--data",
                data,
                "--max-length",
                64,
                "--max-steps",
                2,
                "--lora-rank",
                2,
                "--output-dir",
                tmp_path,
                "--run-name",
                "pt",
            )
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"format: {data}: text" in result.output
    summary = json.loads((tmp_path / "pt" / "run_summary.json").read_text())
    assert summary["train_samples"] == summary["trained_tokens"] // 64 + (summary["trained_tokens"] % 64 > 0)


def test_ms_swift_hermes_system_prompt_length(tmp_path, tokenizer):
    """ms-swift tests/test_align/test_template/test_agent.py::test_hermes: these two tools and this
    system prompt make an 875-character system prompt (the second tool is wrapped unchanged)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["location"],
                },
            },
        },
        {"name_for_model": "tool2", "name_for_human": "工具2", "description": "Tool2的描述"},
    ]
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "How's the weather in Beijing today?"},
        {"role": "assistant", "content": "Sunny."},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages, "tools": tools}])
    sample = load_dataset_spec(str(path)).samples[0]
    assert sample.tools == [tools[0], {"type": "function", "function": tools[1]}]
    text = tokenizer.apply_chat_template(sample.messages, tools=sample.tools, tokenize=False)
    system = text[len("<|im_start|>system\n") : text.index("<|im_end|>")]
    assert len(system) == 875
    encoded = encode_sample(tokenizer, sample, max_length=1024)
    assert encoded.input_ids == template_ids(tokenizer, sample.messages, sample.tools)


def test_stats_preview_and_encode_print_the_format(tmp_path):
    from click.testing import CliRunner

    from lora_lab.cli import main
    from tests.support.tiny import TOKENIZER_DIR

    spec = str(PEERS / "swift_agent.jsonl")
    for command in (["stats"], ["preview"], ["encode", "--output", str(tmp_path / "e.jsonl")]):
        result = CliRunner().invoke(main, ["data", *command, spec, "--model", str(TOKENIZER_DIR)])
        assert result.exit_code == 0, result.output
        lines = [
            line
            for line in result.output.splitlines()  # which tokenizer counts and
            if not line.startswith(("tokenizer: ", "data: "))
        ]  # the data cache: a line each
        assert lines[0] == f"format: {spec}: messages", command


def test_loss_true_on_a_tool_call_is_the_reply_s(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "tool_call", "content": '{"name": "f", "arguments": {}}', "loss": True},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "a"},
        ]
    }
    loaded = load_dataset_spec(str(write_jsonl(tmp_path / "d.jsonl", [row])))
    assert not loaded.problems and loaded.samples[0].trained == [False, True, False, True]


def test_dataset_info_entries_that_cannot_be_read_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    info = {
        "hub": {"hf_hub_url": "no-such-org/no-such-dataset", "split": "train"},
        "modelscope": {"ms_hub_url": "AI-ModelScope/x"},
        "folder": {"file_name": "."},
        "bad_formatting": {"file_name": "d.jsonl", "formatting": "openai"},
    }
    write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    expected = {
        "hub": "loading it as a hub dataset failed",
        "modelscope": "the entry has no file_name or hf_hub_url (ms_hub_url are not "
        "supported); download the data and set file_name.",
        "folder": "is a folder",
        "bad_formatting": "formatting 'openai'; LLaMA-Factory defines alpaca and sharegpt",
    }
    for name, reason in expected.items():
        with pytest.raises(DataError) as error:
            load_dataset_spec(f"{tmp_path}/dataset_info.json:{name}")
        assert reason in str(error.value), name
