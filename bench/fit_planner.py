"""Refit the planner's empirical terms (lora_lab/planning/memory.py FIT_*) to the stored
measurements.

  python bench/fit_planner.py      prints the coefficients and each cell's prediction error
Weighted least squares on relative error, over every successful lora-lab cell in bench/results
on peft's path; then the fast LoRA path's three terms (FAST_TERMS) over its cells.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lora_lab.config import resolve_config
from lora_lab.planning import memory
from lora_lab.planning.policies import resolve_fast_lora
from lora_lab.registry import QWEN25_SIZES, model_config_of


def measured_cells(fast_lora: bool = False) -> list:
    """(RunConfig, measured peak GiB, label) of every successful lora-lab cell run under a
    tier's cap, every row full (the presets and long-sequence plans; the speed plan's uncapped
    cells are left out), each planned with the MLP recompute chunks its run chose (cell_sets).
    fast_lora: the cells that ran models/fast_lora/ (no adapter dropout) instead, which fit
    its terms (fit_fast_scales) after the terms are fitted on peft's cells. Qwen2.5 cells
    only: the other families' (family_cells) check the fitted planner, they do not fit it.
    A cell measured again on the same path (the same label in a newer file) counts only in its
    newest run: the code it ran has changed since the older one."""
    cells = {}
    for path in sorted((ROOT / "bench" / "results").glob("*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            row = json.loads(line)
            if (
                row.get("kind") != "lora-lab"
                or row.get("error")
                or not row.get("cap_gib")
                or not row.get("peak_reserved_gib")
                or row["size"] not in QWEN25_SIZES
                or is_tuner_cell(row)
            ):
                continue
            flags = {
                "model.name": f"qwen2.5-{row['size']}",
                "data.datasets": ["x"],
                "data.max_length": row["max_length"],
            }
            if row.get("resolved", {}).get("grad_accum"):  # packed cells: one full row a step
                flags["train.grad_accum"] = row["resolved"]["grad_accum"]
            config = resolve_config(row["preset"], flags=flags, sets=cell_sets(row))
            if resolve_fast_lora(config) == fast_lora:
                cells.pop(row["label"], None)  # insertion order: oldest first, newest last
                cells[row["label"]] = (config, row["peak_reserved_gib"], row["label"])
    return list(cells.values())


def is_tuner_cell(row: dict) -> bool:
    """A cell of bench/run.py tuners (another tuner or a preference task): they check the
    fitted planner, they do not fit it."""
    return row.get("task", "sft") != "sft" or any(
        s.startswith("train.tuner=") and s != "train.tuner=lora" for s in row.get("sets", [])
    )


EARLIER_PRESET_DROPOUT = "lora.dropout=0.05"  # the GPU presets' dropout before they took 0
EARLIER_LIGER_EXPERTS = "model.liger_experts=true"  # lora.experts' default before auto (bench/run.py moe says)


def cell_sets(row: dict) -> list:
    """The --set list a stored cell ran with: rows that do not record their LoRA dropout ran
    the presets when these still had the earlier dropout, and lora.experts rows that do not set
    model.liger_experts ran liger's fused MoE, its default then."""
    sets = list(row.get("sets", []))
    resolved = row.get("resolved", {})
    if "lora_dropout" not in resolved and not any(s.startswith("lora.dropout=") for s in sets):
        sets.insert(0, EARLIER_PRESET_DROPOUT)
    if "lora.experts=true" in sets and not any(s.startswith("model.liger_experts=") for s in sets):
        sets.append(EARLIER_LIGER_EXPERTS)
    if resolved.get("packed_attention") and not any(
        s.startswith("data.packed_attention=") for s in sets
    ):  # auto, as the GPU ran it
        sets.append(f"data.packed_attention={resolved['packed_attention']}")
    means = resolved.get("memory_means")
    if means and not any(s.startswith("train.mlp_chunk_tokens=") for s in sets):
        # MLP chunks as the run chose them (from its budget); a plan without one assumes them
        chunk = re.search(r"MLP in chunks of (\d+) tokens", means)
        sets.append(f"train.mlp_chunk_tokens={chunk[1] if chunk else 0}")
    return sets


def stored_cells(pattern: str):
    """The cell rows that completed, of bench/results files matching `pattern`."""
    for path in sorted((ROOT / "bench" / "results").glob(pattern)):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if not (row.get("header") or row.get("error")):
                yield row


def tuner_cells() -> list:
    """(RunConfig, measured peak GiB, label, cap GiB) of bench/run.py tuners' cells (DoRA, DPO,
    ORPO on 7B under the tiers' caps), configured as bench/cell.py ran them."""
    cells = []
    for row in stored_cells("*-tuners*.jsonl"):
        flags = {
            "model.name": f"qwen2.5-{row['size']}",
            "data.datasets": ["x"],
            "data.max_length": row["max_length"],
            "train.task": row.get("task", "sft"),
            "train.grad_accum": row["resolved"]["grad_accum"],
        }
        config = resolve_config(row["preset"], flags=flags, sets=cell_sets(row))
        cells.append((config, row["peak_reserved_gib"], row["label"], row["cap_gib"]))
    return cells


def family_cells() -> list:
    """(RunConfig, measured peak GiB, label) of the other families' cells (bench/run.py
    families: --model is the shipped config's name)."""
    cells = []
    for row in stored_cells("*-families*.jsonl"):
        config = resolve_config(
            row["preset"],
            flags={"model.name": row["size"], "data.datasets": ["x"], "data.max_length": row["max_length"]},
            sets=cell_sets(row),
        )
        cells.append((config, row["peak_reserved_gib"], row["label"]))
    return cells


def _working_terms(config) -> tuple[float, float, float, float]:
    """(the plan without its fast-path fitted terms, then those terms before their factors: the
    per-hidden and per-intermediate working terms as peft's path counts them, and one layer's
    MLP weights dequantized from 4 bits), in GiB."""
    shape = memory.ModelShape.from_config(model_config_of(config.model.name))
    tokens = memory.row_length(config) * memory.micro_batch_rows(config)
    hidden, intermediate = (
        b / memory.GIB for b in memory.working_terms(shape, config, tokens, memory._means(shape, config, tokens))
    )
    dequantized = memory.dequantized_mlp_bytes(shape, config) / memory.GIB
    hidden_scale, intermediate_scale = memory.fast_lora_scales(config)
    rest = (
        memory.plan_memory(config).total_gib
        - hidden * hidden_scale
        - intermediate * intermediate_scale
        - dequantized * memory.FIT_FAST_NF4_MLP_COPIES
    )
    return rest, hidden, intermediate, dequantized


FAST_TERMS = ("FIT_FAST_HIDDEN_SCALE", "FIT_FAST_INTERMEDIATE_SCALE", "FIT_FAST_NF4_MLP_COPIES")


def fit_fast_scales() -> None:
    """FAST_TERMS: least squares on relative error over the fast-path cells, with the
    peft-fitted terms held; a factor the fit takes below 0 is 0 and the others are refitted
    (no term gives memory back)."""
    cells = measured_cells(fast_lora=True)
    terms = [_working_terms(config) for config, _, _ in cells]
    x = np.array([[h / peak, i / peak, q / peak] for (_, h, i, q), (_, peak, _) in zip(terms, cells)])
    y = np.array([(peak - rest) / peak for (rest, *_), (_, peak, _) in zip(terms, cells)])
    free = [True] * x.shape[1]
    while True:
        coef = np.zeros(x.shape[1])
        coef[free], *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (coef >= 0).all():
            break
        free = [f and c >= 0 for f, c in zip(free, coef)]
    for name, value in zip(FAST_TERMS, coef):
        print(f"{name} = {value:.4f}")
    for (rest, *parts), (_, peak, label) in zip(terms, cells):
        predicted = rest + float(np.dot(coef, parts))
        print(f"{label:<28} measured {peak:6.2f}  predicted {predicted:6.2f}  {(predicted - peak) / peak:+.1%}")


def main() -> None:
    cells = measured_cells()
    rows, targets, weights = [], [], []
    for config, peak, _ in cells:
        shape = memory.ModelShape.from_config(model_config_of(config.model.name))
        tokens = memory.row_length(config) * memory.micro_batch_rows(config)
        parts = memory._parts(shape, config, tokens)
        counted = sum(v for k, v in parts.items() if "fitted" not in k) * memory.GIB
        sixteen_bit = config.model.quantization == "none"
        chunk = memory._means(shape, config, tokens).mlp_chunk_tokens
        mlp_tokens = chunk * memory.micro_batch_rows(config) if chunk else tokens
        rows.append([1, tokens * shape.hidden, mlp_tokens * shape.intermediate, tokens * shape.hidden * sixteen_bit])
        targets.append(peak * memory.GIB - counted)
        weights.append(1 / peak)
    x, y, w = np.array(rows, float), np.array(targets), np.array(weights)
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    print(
        f"FIT_CONSTANT_GIB = {coef[0] / memory.GIB:.4f}\n"
        f"FIT_BYTES_PER_TOKEN_PER_HIDDEN = {coef[1]:.2f}\n"
        f"FIT_BYTES_PER_TOKEN_PER_INTERMEDIATE = {coef[2]:.3f}\n"
        f"FIT_16BIT_BYTES_PER_TOKEN_PER_HIDDEN = {coef[3]:.2f}"
    )
    for (_config, peak, label), xr, yr in zip(cells, x, y):
        predicted = (peak * memory.GIB - yr + xr @ coef) / memory.GIB
        print(f"{label:<28} measured {peak:6.2f}  predicted {predicted:6.2f}  {(predicted - peak) / peak:+.1%}")
    fit_fast_scales()


if __name__ == "__main__":
    main()
