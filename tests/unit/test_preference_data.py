"""Preference rows in the peers' documented forms: read, checked by line, encoded to the exact
token ids of the chat template; and the memory plan of a preference task."""

import dataclasses
import json

import pytest

from lora_lab.config import RunConfig
from lora_lab.data import prepare_data
from lora_lab.data.pairs import encode_preference, load_preference_spec, normalise_preference_row
from lora_lab.errors import DataError
from lora_lab.planning.memory import plan_memory
from tests.support.tiny import ASSETS, write_jsonl

PEERS = ASSETS / "peers"
INFO = PEERS / "dataset_info.json"
USER = [{"role": "user", "content": "Hi?"}]
PAIR_FORMS = {
    "trl": {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."},
    "trl-conversational": {
        "prompt": USER,
        "chosen": [{"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    },
    "trl-implicit-prompt": {
        "chosen": USER + [{"role": "assistant", "content": "Hello!"}],
        "rejected": USER + [{"role": "assistant", "content": "Go away."}],
    },
    "messages-chosen-rejected": {"messages": USER, "chosen": "Hello!", "rejected": "Go away."},
    "ms-swift": {"messages": USER + [{"role": "assistant", "content": "Hello!"}], "rejected_response": "Go away."},
    "llama-factory-sharegpt": {
        "conversations": [{"from": "human", "value": "Hi?"}],
        "chosen": {"from": "gpt", "value": "Hello!"},
        "rejected": {"from": "gpt", "value": "Go away."},
    },
    "llama-factory-alpaca": {"instruction": "Hi?", "input": "", "chosen": "Hello!", "rejected": "Go away."},
}


def load(tmp_path, rows, task="dpo"):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    return path, load_preference_spec(str(path), task)


@pytest.mark.parametrize("form", sorted(PAIR_FORMS))
def test_every_pair_form_reads_to_the_same_pair(tmp_path, form):
    _, loaded = load(tmp_path, [PAIR_FORMS[form]])
    assert loaded.problems == []
    [sample] = loaded.samples
    assert (sample.prompt, sample.chosen, sample.rejected) == (USER, "Hello!", "Go away.")


def test_llama_factory_demo_files_and_dataset_info_entries(tokenizer):
    direct = load_preference_spec(str(PEERS / "dpo_en_demo.json"), "dpo").samples[0]
    entry = load_preference_spec(f"{INFO}:dpo_en_demo", "dpo").samples[0]
    assert (direct.prompt, direct.chosen, direct.rejected) == (entry.prompt, entry.chosen, entry.rejected)
    assert direct.prompt == [{"role": "user", "content": "How can I best prepare for a job interview?"}]
    assert direct.chosen.startswith("Preparing for a job interview requires")
    kto_direct = load_preference_spec(str(PEERS / "kto_en_demo.json"), "kto").samples[0]
    kto_entry = load_preference_spec(f"{INFO}:kto_en_demo", "kto").samples[0]
    raw = json.loads((PEERS / "kto_en_demo.json").read_text())[0]
    assert (
        (kto_direct.prompt, kto_direct.chosen, kto_direct.label)
        == (kto_entry.prompt, kto_entry.chosen, kto_entry.label)
        == (raw["messages"][:1], raw["messages"][1]["content"], raw["label"])
    )


def test_kto_forms(tmp_path):
    rows = [
        {"prompt": "Hi?", "completion": "Hello!", "label": True},
        {"messages": USER + [{"role": "assistant", "content": "Go away."}], "label": False},
    ]
    _, loaded = load(tmp_path, rows, "kto")
    assert [(s.prompt, s.chosen, s.label) for s in loaded.samples] == [
        (USER, "Hello!", True),
        (USER, "Go away.", False),
    ]


def test_bad_rows_are_reported_with_file_line_and_reason(tmp_path):
    good = PAIR_FORMS["trl"]
    rows = [
        good,
        {"prompt": "Hi?", "chosen": "Hello!"},
        {**good, "chosen": "  "},
        {**good, "rejected": "Hello!"},
        {"prompt": "Hi?", "completion": "x", "label": True},
        {"messages": USER + [{"role": "assistant", "content": "Hello!"}], "rejected_response": ""},
    ]
    path, loaded = load(tmp_path, rows)
    assert [s.origin for s in loaded.samples] == [f"{path}:1"]
    assert [(p.origin, p.reason) for p in loaded.problems] == [
        (f"{path}:2", "missing field `rejected`"),
        (f"{path}:3", "the chosen answer is empty"),
        (f"{path}:4", "the chosen and rejected answers are the same text: nothing to prefer"),
        (
            f"{path}:5",
            "a KTO row (`label` true/false, no rejected answer); --task dpo needs a "
            "chosen and a rejected answer per row. Train it with --task kto.",
        ),
        (f"{path}:6", "the rejected answer is empty"),
    ]
    path, loaded = load(tmp_path, [{"prompt": "Hi?", "completion": "x", "label": "yes"}, good], "kto")
    assert [(p.origin, p.reason) for p in loaded.problems] == [
        (f"{path}:1", "`label` must be true or false; got text"),
        (
            f"{path}:2",
            "a preference pair (chosen / rejected); --task kto reads labelled answers "
            "(`label` true/false). Train pairs with --task dpo.",
        ),
    ]


def test_sft_refuses_pairs_naming_the_task(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR_FORMS["trl"]])
    args = dataclasses.replace(RunConfig().data, datasets=[str(path)])  # a config is frozen
    with pytest.raises(DataError, match="train it with `--task dpo`"):
        prepare_data(args, tokenizer)


def test_pair_ids_are_the_chat_templates_own(tokenizer):
    prompt = [{"role": "system", "content": "Be brief."}] + USER
    sample = normalise_preference_row({"messages": prompt, "chosen": "Hello!", "rejected": "Go away."}, "dpo", "x:1")
    pair = encode_preference(tokenizer, sample, max_length=100)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert pair.prompt_ids == tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for answer, ids in (("Hello!", pair.chosen_ids), ("Go away.", pair.rejected_ids)):
        full = tokenizer.apply_chat_template(
            prompt + [{"role": "assistant", "content": answer}], tokenize=True, return_dict=False
        )
        assert pair.prompt_ids + ids == full[:-1]  # all but the template's closing newline
        assert ids[-1] == end and tokenizer.decode(ids) == f"{answer}<|im_end|>"
    cut = encode_preference(tokenizer, sample, max_length=len(pair.prompt_ids) + 2)
    assert cut.truncated and cut.chosen_ids == pair.chosen_ids[:2]
    with pytest.raises(DataError, match="over --max-length"):
        encode_preference(tokenizer, sample, len(pair.prompt_ids) + 2, truncation="drop")


@pytest.mark.parametrize("task, sequences", [("sft", 1), ("dpo", 2), ("orpo", 2), ("kto", 2)])
def test_memory_plan_counts_every_sequence_and_the_reference_pass(task, sequences):
    values = {"model.name": "qwen2.5-7b", "data.max_length": 1024, "train.engine": "ddp", "train.task": task}
    config = RunConfig().with_changes(values, "test")
    plan = plan_memory(config, 80)
    assert plan.tokens_per_micro_batch == 1024 * sequences
    reference = plan.parts_gib.get("reference forward, no gradients (counted)")
    if task in ("dpo", "kto"):  # 7B: hidden 3584, intermediate 18944; 2 bytes
        assert reference == pytest.approx(2048 * 2 * (4 * 3584 + 2 * 18944) / 2**30)
    else:
        assert reference is None


def test_data_validate_checks_rows_as_the_task_reads_them(tmp_path):
    from click.testing import CliRunner

    from lora_lab.cli import main

    path = write_jsonl(tmp_path / "p.jsonl", [PAIR_FORMS["ms-swift"], {"prompt": "q", "chosen": "a"}])
    result = CliRunner().invoke(main, ["data", "validate", str(path), "--task", "dpo"])
    assert result.exit_code == 2
    assert f"{path}:2: error: missing field `rejected`" in result.output
    assert "1 rows usable, 1 errors" in result.output
    sft = CliRunner().invoke(main, ["data", "validate", str(path)])
    assert sft.exit_code == 2 and "`--task dpo`" in sft.output


def test_a_preference_task_drops_a_presets_packing_and_refuses_given_packing():
    from lora_lab.config import resolve_config
    from lora_lab.errors import ConfigError

    flags = {"data.datasets": ["p.jsonl"], "train.task": "dpo"}
    config = resolve_config("24gb", flags=flags)
    assert config.data.packing is False
    assert config.sources["data.packing"] == "--task dpo (no packing)"
    with pytest.raises(ConfigError) as error:
        resolve_config("24gb", flags={**flags, "train.task": "kto"}, sets=["data.packing=true"])
    assert "--task kto trains on prompt + answer sequences, not packed rows" in str(error.value)
    assert "--task kto estimates its KL term" in str(error.value)  # micro-batch 1 of the preset
    with pytest.raises(ConfigError, match="--from-run .*pass --task dpo"):
        resolve_config("cpu", flags={"data.datasets": ["p.jsonl"], "train.from_run": "r"})
