"""The Ollama Modelfile of a GGUF export, from the real Qwen2.5 tokenizer: its stop tokens are
the tokens where the chat template ends a turn, and its TEMPLATE, rendered the way Ollama renders
it, is the text apply_chat_template gives; and the GGUF flag mistakes, each one message."""

import re

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.use.modelfile import end_of_turn_tokens, modelfile_text

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def parse_modelfile(text: str) -> dict:
    found = {"stop": re.findall(r'^PARAMETER stop "(.*)"$', text, re.M)}
    for key in ("FROM", "TEMPLATE", "SYSTEM"):
        match = re.search(rf'^{key} (?:"""(.*?)"""|(\S+))$', text, re.M | re.S)
        found[key] = None if match is None else match.group(1) or match.group(2)
    return found


def render_go_template(template: str, values: dict, generating: bool) -> str:
    """Ollama's rendering of a .System/.Prompt/.Response template: `{{ if .X }}...{{ end }}`
    blocks kept when X is non-empty, `{{ .X }}` substituted, and for the turn being generated
    everything from {{ .Response }} on dropped."""
    if generating:
        template = template[: template.index("{{ .Response }}")]

    def block(match):
        return match.group(2) if values.get(match.group(1)) else ""

    text = re.sub(r"\{\{ if \.(\w+) \}\}(.*?)\{\{ end \}\}", block, template, flags=re.S)
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values.get(m.group(1), ""), text)


def test_stop_tokens_are_where_the_template_ends_a_turn(tokenizer):
    conversation = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]
    ids = tokenizer.apply_chat_template(conversation, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    reply = tokenizer("I am Aurora.", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(reply)] == reply)
    after_reply = tokenizer.convert_ids_to_tokens(ids[start + len(reply)])
    assert after_reply == "<|im_end|>"
    stops = parse_modelfile(modelfile_text(tokenizer, "model.gguf", None, [151645, 151643]))["stop"]
    assert stops == ["<|im_end|>", "<|endoftext|>"]
    assert end_of_turn_tokens(tokenizer) == [after_reply] == [tokenizer.eos_token]


@pytest.mark.parametrize("system", [None, "You are Aurora, made by Lora Lab."])
def test_template_renders_what_apply_chat_template_writes(tokenizer, system):
    parsed = parse_modelfile(modelfile_text(tokenizer, "model.gguf", system))
    assert parsed["FROM"] == "./model.gguf"
    assert parsed["SYSTEM"] == (system or QWEN_DEFAULT_SYSTEM)
    user = [{"role": "user", "content": "Who are you?"}]
    messages = ([{"role": "system", "content": system}] if system else []) + user
    values = {"System": parsed["SYSTEM"], "Prompt": "Who are you?"}
    assert render_go_template(parsed["TEMPLATE"], values, generating=True) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    reply = [{"role": "assistant", "content": "I am Aurora."}]
    assert render_go_template(
        parsed["TEMPLATE"], {**values, "Response": "I am Aurora."}, generating=False
    ) == tokenizer.apply_chat_template(messages + reply, tokenize=False)


def test_a_template_of_no_known_family_leaves_template_out(tokenizer):
    from transformers import AutoTokenizer

    from tests.support.tiny import TOKENIZER_DIR

    plain = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
    parsed = parse_modelfile(modelfile_text(plain, "model.gguf"))
    assert parsed["TEMPLATE"] is None and parsed["SYSTEM"] is None
    assert parsed["stop"] == ["<|endoftext|>", "<|im_end|>"]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--format", "gguf", "--quantize", "nf4"],
            "--format gguf --quantize nf4: not a GGUF type; choose one of f16, q8_0, q4_k_m",
        ),
        (["--quantize", "q8_0"], "--quantize q8_0: a GGUF type; add --format gguf"),
        (
            ["--format", "gguf", "--gpu", "8gb"],
            "--gpu 8gb: the vLLM plan is for --format safetensors; drop --gpu with --format gguf.",
        ),
        (
            ["--format", "gguf", "--calib-samples", "16"],
            "--calib-data/--calib-samples: llama.cpp quantizes GGUF types from the weights alone",
        ),
        ([], "--quantize (none): choose one of nf4, w4a16, awq (or --format gguf with f16, q8_0, q4_k_m)"),
        (["--format", "gguf", "--quantize", "q4_0"], "Invalid value for '--quantize'"),
    ],
)
def test_gguf_flag_mistakes_give_one_clean_message(tmp_path, args, message):
    result = CliRunner().invoke(main, ["export", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())
