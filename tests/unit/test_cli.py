"""The CLI: clean one-message errors (exit 2, no traceback), presets, data encode and preview."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import TOKENIZER_DIR, write_jsonl


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["run", "--model", "qwen2.5-1.8b", "--data", "x.jsonl"],
            "--model qwen2.5-1.8b: Qwen2.5 has no 1.8B size (1.8B is a Qwen1.5 size)",
        ),
        (
            ["run", "--data", "self-cognition", "--lora-rank", "zero"],
            "--lora-rank zero: expected a whole number, got 'zero'.",
        ),
        (
            ["run", "--data", "self-cognition", "--set", "lora.rnak=4"],
            "--set lora.rnak=4: unknown key `lora.rnak`. Did you mean `lora.rank`?",
        ),
        (["run", "--preset", "15gb", "--data", "x"], "--preset 15gb: no such preset."),
        (["run", "--data", "self-cognition", "--config", "missing.yaml"], "--config missing.yaml: file not found."),
        (["run"], "--data: no training data."),
    ],
)
def test_user_mistakes_give_one_clean_message(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


IDENTITY_MESSAGE = (
    "the bundled self-cognition rows say {{NAME}} and {{AUTHOR}} where the "
    "model's new name and its author go; pass --model-name and --model-author, "
    "e.g. --model-name Aurora --model-author 'Lab X'"
)


def test_self_cognition_without_a_name_is_refused_before_anything_is_printed_or_loaded(tmp_path):
    """The default --model is a hub id this machine cannot reach: the identity mistake must be
    the one message, said before the config is printed or a model or tokenizer is looked for."""
    both = "(--model-name and --model-author not given)"
    for command, said in (
        (
            ["run", "--data", "self-cognition", "--output-dir", tmp_path],
            f"--data self-cognition: {IDENTITY_MESSAGE} {both}",
        ),
        (
            ["run", "--data", "self-cognition#40", "--model-name", "Aurora"],
            f"--data self-cognition#40: {IDENTITY_MESSAGE} (--model-author not given)",
        ),
        (
            ["data", "encode", "self-cognition", "--output", tmp_path / "e.jsonl"],
            f"--data self-cognition: {IDENTITY_MESSAGE} {both}",
        ),
    ):
        result = invoke(*command)
        assert result.exit_code == 2, result.output
        assert said in result.output and "Traceback" not in result.output
        assert "resolved config" not in result.output and "lora.rank" not in result.output
    assert not (tmp_path / "e.jsonl").exists()


def test_data_commands_that_only_look_show_stand_ins_for_the_identity(tmp_path):
    note = (
        "note: --data self-cognition: {{NAME}} and {{AUTHOR}} shown as <NAME> and <AUTHOR> "
        "(--model-name and --model-author not given; a run needs --model-name and "
        "--model-author)"
    )
    result = invoke("data", "preview", "self-cognition", "--model", TOKENIZER_DIR)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(note + "\n") and "<NAME>" in result.output
    assert "{{NAME}}" not in result.output.split("\n", 1)[1]
    result = invoke("data", "stats", "self-cognition", "--model", TOKENIZER_DIR)
    assert result.exit_code == 0 and note in result.output and "samples 120" in result.output
    result = invoke("data", "validate", "self-cognition")
    assert result.exit_code == 0 and note in result.output
    assert "120 rows usable, 0 errors, 0 warnings" in result.output
    # the user's own placeholders are not stood in for: they keep their warning
    own = write_jsonl(tmp_path / "own.jsonl", [{"query": "Who?", "response": "{{NAME}}."}])
    result = invoke("data", "validate", own, "--no-strict")
    assert "note:" not in result.output and "placeholder {{NAME}} is not filled" in result.output


def test_data_errors_are_clean_too(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    result = invoke("run", "--model", tiny_model_dir, "--data", bad, "--output-dir", tmp_path)
    assert result.exit_code == 2
    assert f"no row could be parsed (1 rows; first: {bad}:1: bad JSON" in result.output


def test_presets_lists_every_tier():
    result = invoke("presets")
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.output.splitlines()]
    assert {"cpu", "16gb", "24gb"} <= set(names)


def test_run_help_lists_the_named_flags():
    result = invoke("run", "--help")
    for flag in (
        "--max-length",
        "--lora-rank",
        "--lora-alpha",
        "--micro-batch-size",
        "--grad-accum",
        "--lr",
        "--epochs",
        "--max-steps",
        "--dtype",
        "--seed",
        "--config",
        "--set",
        "--val-ratio",
        "--val-data",
        "--model-name",
    ):
        assert flag in result.output


def test_data_encode_writes_the_exact_ids(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "enc.jsonl"
    result = invoke("data", "encode", data, "--model", TOKENIZER_DIR, "--output", out)
    assert result.exit_code == 0, result.output
    encoded = [json.loads(line) for line in out.open()]
    assert encoded[0]["origin"] == f"{data}:1"
    expected = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert encoded[0]["input_ids"] == list(expected)
    trained = [t for t in encoded[0]["labels"] if t != -100]
    assert trained == tokenizer.encode("Yo") + [151645]


def test_data_preview_marks_spans(tmp_path):
    result = invoke(
        "data",
        "preview",
        "self-cognition",
        "--model",
        TOKENIZER_DIR,
        "--model-name",
        "Aurora",
        "--model-author",
        "Lab X",
    )
    assert result.exit_code == 0, result.output
    assert "<|im_start|>assistant\n[[" in result.output and "<|im_end|>]]" in result.output
    assert "Aurora" in result.output


def test_plan_command_reports_and_exits_1_when_it_does_not_fit():
    result = invoke("plan", "--preset", "16gb", "--model", "qwen2.5-7b", "--gpu-memory", "16")
    assert result.exit_code == 0 and "QLoRA nf4" in result.output and "fits in 15.5" in result.output
    # 7B in bf16 in rows of 8192 tokens: planned at 14.74 GiB (measured 14.74 under the 16gb
    # cap, 2026-12-05-fit-7b.jsonl), above a 15 GiB card's 14.5
    result = invoke("plan", "--preset", "16gb", "--gpu-memory", "15", "--quantization", "none")
    assert result.exit_code == 1 and "does NOT fit in 14.5" in result.output
    assert "to fit: --set data.pack_length=6144" in result.output
    assert "--quantization nf4" in result.output
    result = invoke("plan", "--gpu-memory", "24", "--model", "qwen2.5-3b")
    assert "--preset auto: 24gb" in result.output


def test_plan_uses_the_real_length_of_the_data(tmp_path):
    import shutil

    from lora_lab.registry import known_model_config

    result = invoke(
        "plan",
        "--preset",
        "24gb",
        "--model",
        TOKENIZER_DIR,
        "--gpu-memory",
        "24",
        "--data",
        "self-cognition",
        "--set",
        "data.model_name=A",
        "--set",
        "data.model_author=B",
    )
    assert result.exit_code == 2 and "the planner needs the model's config.json" in result.output
    seven_b = tmp_path / "qwen7b-shape"  # config.json of 7B + the tokenizer, no weights
    shutil.copytree(TOKENIZER_DIR, seven_b)
    (seven_b / "config.json").write_text(json.dumps(known_model_config("7b")))
    result = invoke(
        "plan",
        "--preset",
        "24gb",
        "--model",
        seven_b,
        "--gpu-memory",
        "24",
        "--data",
        "self-cognition",
        "--set",
        "data.model_name=A",
        "--set",
        "data.model_author=B",
    )
    assert "longest encoded sample in the data: 68 tokens" in result.output
    assert "68 tokens per micro-batch" in result.output


def test_data_stats_prints_the_distribution():
    result = invoke(
        "data", "stats", "self-cognition", "--model", TOKENIZER_DIR, "--model-name", "A", "--model-author", "B"
    )
    assert result.exit_code == 0, result.output
    assert "samples 120" in result.output and "recommended --max-length 256" in result.output


def test_presets_are_listed_cpu_first_then_by_card_size():
    from lora_lab.config import list_presets

    assert [p["name"] for p in list_presets()] == ["cpu", "8gb", "12gb", "16gb", "24gb"]


def test_chat_says_an_unknown_command_instead_of_sending_it():
    from lora_lab.use.infer import GenerationSettings, chat_loop

    lines, said = iter(["/help", "/quti"]), []
    chat_loop(None, None, GenerationSettings(), lambda _: next(lines, None), said.append)
    assert said[1].startswith("(unknown command /help; commands: /reset")
    assert said[2].startswith("(unknown command /quti;")


def test_plan_takes_the_flags_of_run_and_says_when_packing_sets_the_row():
    result = invoke(
        "plan",
        "--preset",
        "24gb",
        "--gpu-memory",
        "40",
        "--grad-accum",
        "4",
        "--max-length",
        "2048",
        "--micro-batch-size",
        "1",
        "--gpus",
        "4",
        "--engine",
        "deepspeed-zero3",
        "--tuner",
        "full",
    )
    assert "No such option" not in result.output
    assert (
        "packing (preset 24gb): the samples of a step share rows of 8192 tokens "
        "(data.pack_length 8192)" in result.output
    )
    assert "8192 tokens per micro-batch" in result.output
    unpacked = invoke(
        "plan",
        "--preset",
        "24gb",
        "--gpu-memory",
        "40",
        "--max-length",
        "2048",
        "--set",
        "data.packing=false",
        "--gpus",
        "4",
        "--engine",
        "deepspeed-zero3",
        "--tuner",
        "full",
    )
    assert "packing" not in unpacked.output and "2048 tokens per micro-batch" in unpacked.output


def test_run_shows_the_settings_that_differ_and_every_one_with_show_config(tiny_model_dir, tmp_path):
    """A run starts with the settings that are not the defaults, each with where it came from;
    --show-config (-v) lists every resolved setting. (--dry-run: the print, no training.)"""
    data = write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "response": "a"}])
    args = ["run", "--model", tiny_model_dir, "--data", data, "--gpus", 2, "--dry-run", "--seed", 7]
    quiet = invoke(*args, "--output-dir", tmp_path / "a")
    assert quiet.exit_code == 0, quiet.output
    assert "settings that differ from the defaults (preset cpu; every setting: --show-config" in quiet.output
    assert "train.seed                   = 7                                (--seed)" in quiet.output
    assert "data.max_length              = 512                              (preset cpu)" in quiet.output
    assert "train.save_total_limit" not in quiet.output and "lora.use_rslora" not in quiet.output
    for flag in ("--show-config", "-v"):
        full = invoke(*args, flag, "--output-dir", tmp_path / flag)
        assert full.exit_code == 0, full.output
        assert "resolved config (preset cpu):" in full.output
        assert "train.save_total_limit       = 2                                (default)" in full.output
        assert "train.seed                   = 7                                (--seed)" in full.output
