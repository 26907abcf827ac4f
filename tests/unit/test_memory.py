"""The planner predicts every stored peak within 10%, and refuses what ran out of memory."""
import json
import sys
from pathlib import Path

import pytest

from lora_lab.config import resolve_config
from lora_lab.memory import plan_memory, pick_preset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from fit_planner import measured_cells  # noqa: E402


def test_prediction_within_10_percent_of_every_measured_cell():
    cells = measured_cells()
    assert len(cells) >= 20
    for config, peak, label in cells:
        predicted = plan_memory(config).total_gib
        assert abs(predicted - peak) / peak < 0.10, (label, peak, predicted)


def test_cells_that_ran_out_of_memory_are_predicted_not_to_fit():
    rows = [json.loads(line) for path in (ROOT / "bench" / "results").glob("*.jsonl")
            for line in path.read_text().splitlines()[1:]]
    failed = [r for r in rows if r["kind"] == "lora-lab" and r.get("error")]
    assert len(failed) >= 5
    for row in failed:
        config = resolve_config(row["preset"], flags={
            "model.name": f"qwen2.5-{row['size']}", "data.datasets": ["x"],
            "data.max_length": row["max_length"]}, sets=row.get("sets", []))
        plan = plan_memory(config, gpu_memory_gib=row["cap_gib"] + 0.5)
        assert plan.fits is False, (row["label"], plan.total_gib)


def test_report_breakdown_and_longest_length():
    config = resolve_config("16gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"]})
    plan = plan_memory(config, gpu_memory_gib=16)
    assert plan.quantization == "QLoRA nf4" and plan.fits
    text = plan.report()
    for part in ("weights", "LoRA weights + gradients + Adam state", "activation checkpoints",
                 "fits in 15.5 GiB", "longest --max-length that fits"):
        assert part in text
    assert 16384 <= plan.longest_max_length < 32768  # measured: 16384 fits, 32768 does not


def test_short_data_is_planned_at_its_real_length():
    config = resolve_config("24gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"],
                                           "data.max_length": 8192})
    full = plan_memory(config)
    short = plan_memory(config, longest_sample_tokens=300)
    assert short.tokens_per_micro_batch == 300 and short.total_gib < full.total_gib - 2


@pytest.mark.parametrize("gib,preset", [(24, "24gb"), (23.6, "24gb"), (16, "16gb"),
                                        (12, "12gb"), (11.6, "12gb"), (8, "8gb"), (6, "8gb")])
def test_auto_preset_picks_the_largest_tier_that_fits(gib, preset):
    assert pick_preset(gib)[0] == preset


def test_check_fits_refuses_with_the_knobs_to_turn():
    from lora_lab.errors import LoraLabError
    from lora_lab.memory import check_fits

    flags = {"model.name": "qwen2.5-7b", "data.datasets": ["x"]}
    assert check_fits(resolve_config("16gb", flags=flags), 16).fits
    sixteen_bit = resolve_config("16gb", flags={**flags, "model.quantization": "none"})
    with pytest.raises(LoraLabError, match=r"--preset 16gb needs about 15.9 GiB for Qwen2.5-7B "
                                           r"\(16-bit LoRA\) at --max-length 2048.*Try "
                                           r"--max-length \d+ or --quantization nf4"):
        check_fits(sixteen_bit, 16)
