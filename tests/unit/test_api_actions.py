"""The CLI and the web page call the same API functions for the data check and the export, and
print the same lines (lora_lab.check_data, lora_lab.export_model; use/data_check.py,
use/export_common.py)."""

import json

import pytest
from click.testing import CliRunner

from lora_lab import check_data, export_model
from lora_lab.cli import main
from lora_lab.errors import LoraLabError
from lora_lab.ui import actions
from lora_lab.ui.form import RunForm

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps(GOOD), '{"messages": [{"role": "user", "content": "no reply"}]}', json.dumps({**GOOD, "id": 3})]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_data_validate_prints_the_lines_of_check_data(data_file):
    result = check_data([str(data_file)])
    assert result.problem_lines() == [
        f"{data_file}:2: error: the last message must be the assistant's reply",
        f"{data_file}:3: warning: field `id` is not used by the messages format and was ignored",
    ]
    printed = CliRunner().invoke(main, ["data", "validate", str(data_file), "--no-strict"])
    assert printed.exit_code == 0, printed.output
    assert printed.output == "\n".join(result.lines()) + "\n"


def test_the_page_shows_the_lines_of_check_data(data_file):
    form = RunForm(model="qwen2.5-0.5b", data=[str(data_file)], max_length="64")
    view = actions.check_data(form)
    same = check_data([str(data_file)], model="qwen2.5-0.5b", max_length="64", stats=True)
    assert view.problems == "\n".join(same.problem_lines())
    assert view.summary == "\n".join(same.summary_lines())
    assert view.stats == same.stats.table() and view.longest == same.stats.max


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"quantize": "q8_0"}, "--quantize q8_0: a GGUF type; add --format gguf"),
        ({"quantize": None}, "--quantize (none): choose one of nf4, w4a16, awq"),
        ({"format": "gguf", "quantize": "nf4"}, "--format gguf --quantize nf4: not a GGUF type"),
        ({"format": "gguf", "gpu_tier": "8gb"}, "--gpu 8gb: the vLLM plan is for --format safetensors"),
        ({"format": "onnx"}, "--format onnx: choose one of safetensors, gguf"),
    ],
)
def test_export_model_refuses_what_the_cli_refuses(tmp_path, arguments, message):
    with pytest.raises(LoraLabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_model(tmp_path, **arguments)
    flags = ["--format", arguments.get("format", "safetensors")] if arguments.get("format") != "onnx" else []
    if arguments.get("quantize"):
        flags += ["--quantize", arguments["quantize"]]
    if arguments.get("gpu_tier"):
        flags += ["--gpu", arguments["gpu_tier"]]
    if arguments.get("format") != "onnx":
        printed = CliRunner().invoke(main, ["export", str(tmp_path), *flags])
        assert printed.exit_code == 2 and message in printed.output


def test_export_functions_take_keywords_only():
    from lora_lab.use.export import export_quantized
    from lora_lab.use.gguf_export import export_gguf
    from lora_lab.use.merge import merge_adapter

    for export in (export_model, export_quantized, export_gguf, merge_adapter):
        with pytest.raises(TypeError, match="positional argument"):
            export("folder", "nf4")
