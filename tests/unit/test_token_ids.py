"""A token id outside the model's input embedding stops `lora-lab run` with one message naming
the id, the token, the row and the embedding's size, before the model loads (not an IndexError
inside the forward pass): a Mistral-shaped model (32,768 rows) given the Qwen2.5 tokenizer, and a
tokenizer whose pad token lies outside the embedding."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.data.arrow import first_token_at_least, map_samples, write_samples
from lora_lab.data.encode import EncodedSample
from tests.support import families
from tests.support.tiny import TOKENIZER_DIR, write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}] * 2


def run_cli(model_dir, data, out, *flags):
    return CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--preset",
                "cpu",
                "--model",
                model_dir,
                "--data",
                data,
                "--max-steps",
                1,
                "--max-length",
                64,
                "--output-dir",
                out,
                "--run-name",
                "r",
                *flags,
            )
        ],
    )


@pytest.fixture(scope="module")
def mistral_with_qwen_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("mismatch")
    return families.build_tiny_family(out / "model", "mistral-7b", AutoTokenizer.from_pretrained(TOKENIZER_DIR))


def test_a_tokenizer_of_another_model_is_refused_by_name(mistral_with_qwen_tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = run_cli(mistral_with_qwen_tokenizer, data, tmp_path)
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)
    message = " ".join(result.output.split())
    assert (
        f"the tokenizer gives token id 151644 ('<|im_start|>', in {data}:1), but the "
        f"model's input embedding has 32768 rows (vocab_size in "
        f"{mistral_with_qwen_tokenizer}/config.json)"
    ) in message, result.output
    assert "Traceback" not in result.output and "IndexError" not in result.output
    assert not (tmp_path / "r" / "adapter").exists()


def test_a_pad_token_outside_the_embedding_is_refused(tmp_path):
    """Mistral's own tokenizer, with a pad token added (id 32768) but the embedding not resized:
    the samples fit, the padding the collator adds would not."""
    tokenizer = families.mistral_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<pad-added>"})
    assert tokenizer.pad_token_id == 32768
    model_dir = families.build_tiny_family(tmp_path / "model", "mistral-7b", tokenizer)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = run_cli(model_dir, data, tmp_path)
    assert result.exit_code != 0
    message = " ".join(result.output.split())
    assert (
        "the tokenizer gives token id 32768 ('<pad-added>', in the padding (the tokenizer's "
        "pad token)), but the model's input embedding has 32768 rows"
    ) in message, message


@pytest.mark.parametrize("mapped", [False, True])
def test_first_token_at_least_names_the_first_sample_outside(tmp_path, mapped):
    samples = [
        EncodedSample([1, 2, 3], [-100, 2, 3], "a.jsonl:1"),
        EncodedSample([4, 40000, 50000], [-100, 5, 6], "a.jsonl:2"),
        EncodedSample([60000], [-100], "a.jsonl:3"),
    ]
    if mapped:
        write_samples(tmp_path / "s.arrow", samples)
        samples = map_samples(tmp_path, ["s.arrow"])
    assert first_token_at_least(samples, 32768) == ("a.jsonl:2", 40000)
    assert first_token_at_least(samples, 60001) is None
    assert json.dumps(first_token_at_least(samples, 50001)) == '["a.jsonl:3", 60000]'
