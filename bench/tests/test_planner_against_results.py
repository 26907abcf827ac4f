"""The planner predicts every stored peak (bench/results) within 10%, and refuses what ran out of
memory."""

import json
from pathlib import Path

import pytest
from fit_planner import cell_sets, family_cells, measured_cells, tuner_cells
from report import load, plan_of, planned_gib

from lora_lab.config import resolve_config
from lora_lab.planning.engines import CHECKED_ON_GPUS, CPU_PLAN_MARGIN, GAPS_ON_GPUS
from lora_lab.planning.memory import plan_memory
from lora_lab.registry import QWEN25_SIZES

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_prediction_within_10_percent_of_every_measured_cell():
    cells = measured_cells()
    assert len(cells) >= 20
    for config, peak, label in cells:
        predicted = plan_memory(config).total_gib
        assert abs(predicted - peak) / peak < 0.10, (label, peak, predicted)


def test_fast_lora_cells_are_planned_within_10_percent():
    """Cells on models/fast_lora/ (no adapter dropout, the GPU presets' setting), planned with
    the fast path's own fitted scales (FIT_FAST_*)."""
    cells = measured_cells(fast_lora=True)
    assert len(cells) >= 6
    for config, peak, label in cells:
        predicted = plan_memory(config).total_gib
        assert abs(predicted - peak) / peak < 0.10, (label, peak, predicted)


def test_other_families_are_planned_within_10_percent_of_their_gpu_runs():
    """Qwen3-8B, Llama-3.1-8B, Gemma-3-4B and Phi-4-mini shapes under the tiers' caps
    (bench/results/*-families.jsonl): the planner, fitted on Qwen2.5, within 10% above and 16%
    below each peak. They ran on 2026-12-01/02, before later cuts to the fast path's memory that
    today's fit follows (Qwen2.5-7B's own preset cells fell 4-5% from 2026-12-03 to 2026-12-05:
    nf4 6.19 to 5.90 GiB, bf16 15.41 to 14.86), and one setting measured twice differs by up
    to 10% (Gemma-3-4B bf16 at 2048 tokens: 10.14 GiB under 16gb, then 9.16 under 12gb and
    24gb; Mistral-7B nf4: 6.42 under 16gb, 6.12 under 12gb)."""
    cells = family_cells()
    assert {label.split("-", 1)[1].rsplit("-", 1)[0] for _, _, label in cells} >= {
        "qwen3-8b",
        "llama-3.1-8b",
        "gemma-3-4b",
        "phi-4-mini",
    }
    for config, peak, label in cells:
        predicted = plan_memory(config).total_gib
        assert 0.84 * peak <= predicted <= 1.1 * peak, (label, peak, predicted)


def test_dora_and_the_preference_tasks_are_planned_within_10_percent_of_their_gpu_runs():
    """7B with DoRA (16-bit and 4-bit base) and DPO under the 24gb and 16gb caps
    (bench/results/*-tuners*.jsonl)."""
    cells = tuner_cells()
    assert {label.split("-")[2] for _, _, label, _ in cells} >= {"dora", "dpo"}
    for config, peak, label, cap in cells:
        predicted = plan_memory(config, gpu_memory_gib=cap).total_gib  # the run's own plan
        assert 0.9 * peak <= predicted <= 1.1 * peak, (label, peak, predicted)


def test_the_verdict_matches_every_capped_cell():
    """A cell that completed under its cap is planned to fit that card; one that ran out of
    memory is planned not to. (With the memory means every stored cell completed; the ones
    that ran out of memory before them are in bench/results/superseded/.)"""
    rows = [json.loads(line) for path in RESULTS.glob("*.jsonl") for line in path.read_text().splitlines()[1:]]
    capped = [
        r for r in rows if r.get("kind") == "lora-lab" and r.get("cap_gib") and r.get("error") in (None, "OOM")
    ]  # other errors say nothing of memory
    assert len(capped) >= 25
    for row in capped:
        name = row["size"] if row["size"] not in QWEN25_SIZES else f"qwen2.5-{row['size']}"
        flags = {
            "model.name": name,
            "data.datasets": ["x"],
            "data.max_length": row["max_length"],
            "train.task": row.get("task", "sft"),
        }
        config = resolve_config(row["preset"], flags=flags, sets=cell_sets(row))
        plan = plan_memory(config, gpu_memory_gib=row["cap_gib"] + 0.5)
        assert plan.fits is (not row.get("error")), (row["label"], plan.total_gib)


def test_multi_gpu_plans_within_15_percent_of_the_two_gpu_runs():
    """The latest successful run of every multi-GPU cell in bench/results (per-GPU
    peak up to the end of training where recorded) against the planner, configured as
    bench/cell.py runs it; the engines that miss by more say by how much (GAPS_ON_GPUS)."""
    _, rows = load("multi-gpu")
    cells = [r for r in rows if not r.get("error")]
    assert {r["engine"] for r in cells} >= {
        "ddp",
        "deepspeed-zero2",
        "deepspeed-zero3",
        "fsdp",
        "deepspeed-zero2-offload",
        "deepspeed-zero3-offload",
    }
    for row in cells:
        measured = row.get("peak_reserved_gib_training") or row["peak_reserved_gib"]
        ratio = planned_gib(row) / measured
        if (row["engine"], row["tuner"]) in GAPS_ON_GPUS:  # a known, reported gap
            assert ratio == pytest.approx(GAPS_ON_GPUS[row["engine"], row["tuner"]][0], abs=0.01), row["label"]
            assert abs(ratio - 1) >= 0.15, row["label"]
        else:
            assert (row["engine"], row["tuner"]) in CHECKED_ON_GPUS, row["label"]
            assert abs(ratio - 1) < 0.15, (row["label"], measured)


def test_the_cpu_plan_of_the_offload_runs_with_its_margin():
    """The offload runs' CPU resident peaks (added up over the processes) are above the
    counted CPU plan, by at most CPU_PLAN_MARGIN, which --engine auto applies."""
    _, rows = load("multi-gpu")
    offload = [r for r in rows if "offload" in r["engine"] and r.get("cpu_peak_rss_gib_per_gpu")]
    assert len(offload) == 2
    ratios = [sum(r["cpu_peak_rss_gib_per_gpu"]) / plan_of(r).cpu_total_gib for r in offload]
    assert all(1 < ratio <= CPU_PLAN_MARGIN for ratio in ratios), ratios
    assert max(ratios) > CPU_PLAN_MARGIN - 0.05  # the margin is the measured one


def _stored_long_cells() -> list:
    """Successful lora-lab cells of 32,768 tokens or more with layer checkpoints in CPU memory
    and their peak RSS."""
    rows = [
        json.loads(line)
        for path in sorted(RESULTS.glob("*.jsonl"))
        for line in path.read_text().splitlines()[1:]
        if '"cpu_peak_rss_gib"' in line or '"peak_rss_gib"' in line
    ]
    return [
        r
        for r in rows
        if r.get("kind") == "lora-lab"
        and not r.get("error")
        and r.get("max_length", 0) >= 32768
        and "layer checkpoints in CPU memory" in r["resolved"]["memory_means"]
        and not r.get("memory_history")  # the allocator's recorded history lives in host memory too
    ]


def _host_ram_checked(slab: bool) -> list:
    """The stored long cells whose host plan (planning/memory_plan.py: the offloaded checkpoints,
    the embedding table and FIT_PROCESS_HOST_GIB) is within 5% of their peak RSS; those that ran
    with the exact slab (models/host_memory.py: they record planned_host_gib) when `slab`, else
    those that ran before it, whose checkpoints torch's pinned allocator held in blocks rounded up
    to a power of two (planned so here)."""
    from lora_lab.planning.memory_plan import FIT_PROCESS_HOST_GIB
    from lora_lab.planning.shape import ModelShape
    from lora_lab.registry import model_config_of

    checked = []
    for row in _stored_long_cells():
        if ("planned_host_gib" in row) != slab:
            continue
        measured = row.get("cpu_peak_rss_gib") or row["peak_rss_gib"]
        name = row["size"] if row["size"] not in QWEN25_SIZES else f"qwen2.5-{row['size']}"
        shape = ModelShape.from_config(model_config_of(name))
        if slab:
            planned = row["planned_host_gib"]
        else:
            block = 2 ** (row["max_length"] * shape.hidden * 2 - 1).bit_length() / 2**30
            embedding = (
                shape.vocab * shape.hidden * 2 / 2**30 if "input embedding" in row["resolved"]["memory_means"] else 0
            )
            planned = shape.layers * block + embedding + FIT_PROCESS_HOST_GIB
        if planned < shape.params * 2 / 2**30 + FIT_PROCESS_HOST_GIB:
            continue  # reading the 16-bit checkpoint (file pages) set its peak, before training
        assert abs(planned - measured) / measured < 0.05, (row["label"], planned, measured)
        checked.append(row["label"])
    return checked


def test_host_ram_of_the_long_cells_is_planned_within_5_percent():
    assert len(_host_ram_checked(slab=False)) >= 2


@pytest.mark.xfail(
    strict=True,
    reason="Llama-3.1-8B QLoRA, one 65,536-token sample (calls 58 and 60): 35.5 GiB peak RSS against "
    "18.8 planned. The slab was sized by model.dtype, fp32 there (peft's LoRA weights are the first "
    "floating-point parameters), so it pinned 32 GiB for 16 GiB of bf16 checkpoints; sized by the "
    "embedding's dtype since (tests/unit/test_memory_means.py). Passes once the cells are run again.",
)
def test_host_ram_of_the_long_cells_with_the_slab_is_planned_within_5_percent():
    assert len(_host_ram_checked(slab=True)) >= 2


def test_the_context_table_cells_are_planned_within_10_percent_out_of_sample():
    """Llama-3.1-8B QLoRA, rank 32, one long sample (bench/run.py context-table): a family and
    lengths the fitted terms never saw (fit_planner.measured_cells fits Qwen2.5 cells only). A
    cell that ran out of memory is planned not to fit its cap."""
    rows = [
        json.loads(line)
        for path in sorted(RESULTS.glob("*-context-table.jsonl"))
        for line in path.read_text().splitlines()[1:]
    ]
    rows = [r for r in rows if r.get("kind") == "lora-lab" and r.get("error") in (None, "OOM")]
    assert {r["error"] for r in rows} == {None, "OOM"}
    for row in rows:
        flags = {"model.name": row["size"], "data.datasets": ["x"], "data.max_length": row["max_length"]}
        config = resolve_config(row["preset"], flags=flags, sets=cell_sets(row))
        if row["error"] is None:
            planned = plan_memory(config).total_gib
            assert abs(planned - row["peak_reserved_gib"]) / row["peak_reserved_gib"] < 0.10, (row["label"], planned)
        else:
            assert plan_memory(config, gpu_memory_gib=row["cap_gib"] + 0.5).fits is False, row["label"]


def test_the_moe_cells_are_planned_within_10_percent(tmp_path):
    """Every stored lora-lab MoE cell (bench/run.py moe: Qwen3-30B-A3B's first 16 layers and
    gpt-oss-20b's first 8, QLoRA, one 2048-token sample; attention only and with lora.experts,
    through liger's fused MoE and in low rank): the plan of the truncated config.json, with the
    settings the cell ran."""
    from workloads import config_body

    rows = completed_lora_lab_rows("moe")
    assert {r["label"] for r in rows} >= {"ll-moe-qwen3-30b-a3b-16L", "ll-moe-qwen3-30b-a3b-16L-experts"}
    for row in rows:
        folder = tmp_path / row["label"]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config_body(row["size"])))
        flags = {
            "model.name": str(folder),
            "data.datasets": ["x"],
            "data.max_length": row["max_length"],
            "train.grad_accum": row["grad_accum"],
        }
        planned = plan_memory(resolve_config(row["preset"], flags=flags, sets=cell_sets(row))).total_gib
        assert abs(planned - row["peak_reserved_gib"]) / row["peak_reserved_gib"] < 0.10, (row["label"], planned)


def test_the_grpo_cells_are_planned_within_10_percent_with_their_longest_prompt(tmp_path):
    """Every stored lora-lab GRPO cell (bench/run.py grpo: Qwen2.5-7B QLoRA under 16gb, 1.5B under
    8gb, prompts of 64 words), planned as the run chose its memory means: with the longest
    prompt of its data (data.max_length only bounds the prompts), the completions beyond it."""
    from cell import longest_prompt_tokens
    from workloads import write_prompt_rows

    tokenizer = Path(__file__).resolve().parents[2] / "lora_lab" / "qwen25_tokenizer"
    rows = completed_lora_lab_rows("grpo")
    assert {r["size"] for r in rows} >= {"7b", "1.5b"}
    for row in rows:
        data = write_prompt_rows(
            tmp_path / f"{row['label']}.jsonl", row["steps"] * row["grad_accum"], row["prompt_words"]
        )
        longest = longest_prompt_tokens(tokenizer, data)
        assert row.get("longest_prompt_tokens", longest) == longest
        flags = {"model.name": f"qwen2.5-{row['size']}", "data.datasets": ["x"], "train.task": "grpo"}
        flags |= {"data.max_length": row["max_length"], "train.grad_accum": row["grad_accum"]}
        config = resolve_config(row["preset"], flags=flags, sets=row["sets"])
        planned = plan_memory(config, row["cap_gib"], longest).total_gib
        assert abs(planned - row["peak_reserved_gib"]) / row["peak_reserved_gib"] < 0.10, (row["label"], planned)


def completed_lora_lab_rows(plan: str) -> list:
    """Every stored lora-lab row of `plan` that completed."""
    rows = [
        json.loads(line)
        for path in sorted(RESULTS.glob(f"*-{plan}.jsonl"))
        for line in path.read_text().splitlines()
        if '"kind": "lora-lab"' in line
    ]
    return [r for r in rows if not r.get("error")]
