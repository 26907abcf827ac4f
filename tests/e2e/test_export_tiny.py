"""lora-lab export on a tiny model trained by `lora-lab run`: run folder -> nf4 (and w4a16 and awq
where llm-compressor is installed) -> a folder that loads with AutoModelForCausalLM on CPU and still
answers as the 16-bit merged model does; and bench/export_bench.py end to end on CPU.

The tiny model here has hidden size 128 (build_tiny_qwen2's default is 32): bitsandbytes' CPU nf4 kernel
needs at least 64 input columns per layer, and GPTQ groups 128 of them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import build_tiny_qwen2, train_tiny_run

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]
FILES = {
    "chat_template.jinja",
    "config.json",
    "export_report.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny128_dir(tmp_path_factory) -> Path:
    """Wider than the shared tiny model: bitsandbytes' CPU nf4 needs >= 64 input columns and
    GPTQ groups of 128."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny128"), hidden_size=128)


@pytest.fixture(scope="module")
def trained(tiny128_dir, tmp_path_factory):
    """At the shared 1e-2 the run memorises so sharply that 4-bit rounding of this random
    2-layer model moves its first answer token; 5e-3 learns the answer with a margin that
    the 4-bit formats keep, as a real model's does."""
    return train_tiny_run(tiny128_dir, tmp_path_factory.mktemp("export"), ROWS, lr="5e-3")


@pytest.fixture(scope="module")
def merged_fp32(trained):
    """The reference: the run merged in fp32 (lora-lab merge), inside the run folder."""
    run_dir, _ = trained
    result = invoke("merge", run_dir, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    return run_dir / "merged"


def _answer_probabilities(model, ids: list, answer_start: int):
    """Softmax over the vocabulary at every position, and the probability of each answer token."""
    import torch

    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits.float().softmax(-1)[0]
    targets = torch.tensor(ids[answer_start:])
    return probs, probs[answer_start - 1 : -1].gather(-1, targets[:, None])[:, 0]


def _check_loads_and_answers(folder: Path, merged: Path):
    """The exported folder loads on CPU, answers the trained question as the fp32 merged model
    does, gives the trained reply's tokens the same probability within 0.05, and predicts the
    same next token at >= 80% of the positions where the merged model is confident."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_lab.use.infer import ask

    exported = AutoModelForCausalLM.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(merged)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert ask(exported, tokenizer, "Who are you?", 10) == "I am Aurora."
    assert ask(reference, tokenizer, "Who are you?", 10) == "I am Aurora."
    prompt = tokenizer.apply_chat_template(ROWS[0]["messages"][:1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(ROWS[0]["messages"], tokenize=False)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ours, ours_answer = _answer_probabilities(exported, ids, start)
    theirs, theirs_answer = _answer_probabilities(reference, ids, start)
    assert float((ours_answer - theirs_answer).abs().max()) < 0.05
    confident = theirs.max(-1).values >= 0.5
    agreement = (ours.argmax(-1) == theirs.argmax(-1))[confident].float().mean()
    assert float(agreement) >= 0.8
    return exported


def test_nf4_export_of_a_run_folder(trained, merged_fp32):
    import bitsandbytes as bnb

    run_dir, _ = trained
    result = invoke("export", run_dir, "--quantize", "nf4", "--gpu", "8gb")
    # the copy is checked against the trained model at the end: 4 bits of a model this small do
    # not keep its greedy answers, which is said, with a non-zero exit; the copy stays
    out = run_dir / "export-nf4"
    assert result.exit_code == 1, result.output
    said = result.output[result.output.index("check against the trained model:") :].splitlines()
    assert said[1].startswith("nf4 ") and "FAILS: " in said[1] and "(quantized rule)" in said[1]
    assert f"nf4 do(es) not answer as the trained model (parity_report.json says how). The copy stays in {out}" in (
        result.output
    )
    assert json.loads((run_dir / "parity_report.json").read_text())["forms"][-1]["form"] == "nf4"
    assert {p.name for p in out.iterdir()} == FILES
    assert not [p for p in run_dir.iterdir() if p.name.endswith((".partial", ".merged-tmp"))]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["bnb_4bit_quant_type"] == "nf4"
    assert config["load_in_4bit"] and config["bnb_4bit_use_double_quant"]
    report = json.loads((out / "export_report.json").read_text())
    assert report["format"] == "nf4" and report["merged_from_adapter"] is True
    assert report["run_dir"] == str(run_dir) and report["source"] == str(run_dir)
    assert report["calibration"] is None
    assert report["weights_bytes"] == (out / "model.safetensors").stat().st_size
    assert report["files"] == sorted(FILES)
    assert report["versions"]["bitsandbytes"] and report["versions"]["transformers"]
    assert report["top1_agreement"] >= 0.8
    assert report["serving"]["tier"] == "8gb" and report["serving"]["fits"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert 151645 in generation["eos_token_id"]
    exported = _check_loads_and_answers(out, merged_fp32)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in exported.modules()) == 2 * 7
    assert (
        f"vllm serve {out} --served-model-name finetuned --quantization bitsandbytes "
        f"--max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.87" in result.output
    )
    assert "KV cache per token: 2 (K and V) x 2 layers x 2 KV heads x 32 head dim" in result.output
    stages = stage_lines(result.output)
    assert [line.split(":")[0] for line in stages] == ["export 1/2", "export 2/2"]
    assert stages[0].endswith(" to nf4 (bitsandbytes) and saving it")


def stage_lines(output: str) -> list[str]:
    """The export's stage lines, in order. The runner's output interleaves standard error (the
    libraries' tqdm frames, flushed later) with standard output, so lines are found by pattern."""
    return re.findall(r"(?:export \d/\d: |  GPTQ: )[^\r\n]*", output)


def test_export_of_a_merged_folder_and_overwrite_rules(trained, merged_fp32):
    run_dir, _ = trained
    result = invoke("export", merged_fp32, "--quantize", "nf4", "--no-check")
    assert result.exit_code == 0, result.output
    out = run_dir / "merged-nf4"  # beside the merged folder
    report = json.loads((out / "export_report.json").read_text())
    assert report["merged_from_adapter"] is False and report["source"] == str(merged_fp32)
    assert report["run_dir"] == str(run_dir) and report["serving"] is None
    assert "--gpu 8gb" in result.output and "--gpu 24gb" in result.output  # one line per tier
    again = CliRunner().invoke(main, ["export", str(merged_fp32), "--quantize", "nf4"])
    assert again.exit_code == 2 and "already exists. Pass --force" in again.output
    forced = invoke("export", merged_fp32, "--quantize", "nf4", "--force", "--no-check")
    assert forced.exit_code == 0 and {p.name for p in out.iterdir()} == FILES


@pytest.mark.parametrize("fmt,method", [("w4a16", "GPTQ"), ("awq", "AWQ")])
def test_calibrated_export_on_the_run_data(trained, merged_fp32, fmt, method):
    """w4a16 (GPTQ) and awq (AWQ scaling, then int4): one compressed-tensors scheme, symmetric
    int4 in groups of 128, that vLLM's rules take and transformers reads back."""
    pytest.importorskip("llmcompressor", reason=f"{fmt} needs lora-lab[export] (llm-compressor)")
    from lora_lab.use.vllm_rules import vllm_wna16_problems

    run_dir, data = trained
    result = invoke("export", run_dir, "--quantize", fmt, "--calib-samples", 4, "--gpu", "24gb", "--no-check")
    assert result.exit_code == 0, result.output
    out = run_dir / f"export-{fmt}"
    assert {p.name for p in out.iterdir()} == FILES | {"recipe.yaml"}
    recipe = (out / "recipe.yaml").read_text()
    assert (f"{method}Modifier" in recipe) and ("AWQModifier" in recipe) == (fmt == "awq")
    full_config = json.loads((out / "config.json").read_text())
    config = full_config["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 128, True)
    assert (weights["type"], weights["strategy"]) == ("int", "group")
    assert config["ignore"] == ["lm_head"]
    assert vllm_wna16_problems(full_config) == []  # vLLM's compressed-tensors loader rules
    report = json.loads((out / "export_report.json").read_text())
    assert report["format"] == fmt and method in report["format_description"]
    calibration = report["calibration"]
    assert calibration["samples"] == 4 and calibration["data"] == [f"{data}#8"]
    assert calibration["from"] == "run config.yaml" and calibration["tokens"] > 4 * 10
    assert report["versions"]["llmcompressor"] and report["versions"]["compressed-tensors"]
    _check_loads_and_answers(out, merged_fp32)
    assert f"vllm serve {out} --served-model-name finetuned --max-model-len" in result.output
    assert "--quantization" not in result.output.split("vllm serve")[1].split("\n")[0]
    stages = stage_lines(result.output)
    assert (
        stages[0].startswith("export 1/3: quantizing ")
        and (
            f"to {fmt} ({method}, llm-compressor), calibrating on 4 samples "
            f"({calibration['tokens']} tokens) of {data}#8, one decoder layer at a time"
        )
        in stages[0]
    )
    layers = (
        ["  GPTQ: quantizing decoder layer 1/2", "  GPTQ: quantizing decoder layer 2/2"] if fmt == "w4a16" else []
    )  # GPTQ's per-layer log; AWQ has none
    assert stages[1:-2] == layers
    assert stages[-2].startswith("export 2/3: saving the compressed (pack-quantized) weights")
    assert stages[-1] == (
        "export 3/3: checking: the written folder loaded back, its logits on "
        "3 check prompts against the 16-bit model's"
    )


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="minutes of CPU; LORA_LAB_SLOW=1 runs it")
def test_export_bench_runs_on_cpu(trained, tmp_path):
    """bench/export_bench.py --sizes tiny: every step of the GPU benchmark, on CPU (make
    test-slow: the exports it times are tested above)."""
    import importlib.util

    run_dir, _ = trained
    formats = "nf4,w4a16" if importlib.util.find_spec("llmcompressor") else "nf4"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "export_bench.py"),
            "--sizes",
            "tiny",
            "--formats",
            formats,
            "--out",
            str(tmp_path / "results"),
            "--work",
            str(tmp_path / "work"),
            "--real-run",
            str(run_dir),
            "--max-prompts",
            "4",
            "--parallel",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [
        json.loads(line)
        for path in (tmp_path / "results").glob("*-export.jsonl")
        for line in path.read_text().splitlines()
    ]
    header, rows = lines[0], lines[1:]
    assert header["header"] and "python bench/export_bench.py --sizes tiny" in header["command"]
    assert header["versions"]["torch"] and "date" in header
    assert not [r for r in rows if r["error"]], rows
    fmts = formats.split(",")
    assert sorted((r["kind"], r["model"], r["format"]) for r in rows) == sorted(
        [("export", "qwen2.5-tiny (random)", f) for f in fmts]
        + [("load", "qwen2.5-tiny (random)", f) for f in ["bf16", *fmts]]
        + [("export", "real", f) for f in fmts]
        + [("quality", "real", f) for f in ["bf16", *fmts]]
    )
    quality = {r["format"]: r for r in rows if r["kind"] == "quality"}
    assert quality["bf16"]["answers_identical_to_bf16"] == 1.0
    assert quality["bf16"]["prompts"] == 4 and quality["nf4"]["heldout_samples"] == 22
    shutil.rmtree(tmp_path / "work")
