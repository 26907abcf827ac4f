"""lora-lab's vLLM rules against what vLLM itself said about lora-lab's folders
(bench/vllm_check.py, run with vLLM installed; stored in bench/results/vllm/)."""

import json
from pathlib import Path

from lora_lab.planning.serving import VLLM_MAX_LORA_RANKS, VLLM_UNSERVED_ADAPTERS

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "vllm" / "2026-12-01-vllm-cpu-checks.jsonl"
ROWS = [json.loads(line) for line in RESULTS.read_text().splitlines()]


def test_the_rank_ladder_is_vllms():
    ranks = ROWS[0]["max_lora_ranks"]
    assert ROWS[0]["vllm"] == "0.33.0"
    assert ranks["vllm.config.lora.MaxLoRARanks"] == list(VLLM_MAX_LORA_RANKS)


def test_the_dora_warning_quotes_vllms_refusal():
    refusals = [
        row["error"]
        for row in ROWS[1:]
        if "/dora/" in row["folder"] and row["check"].startswith("vllm.lora.peft_helper")
    ]
    assert refusals == ["ValueError: vLLM does not yet support DoRA."]
    assert "vLLM does not yet support DoRA" in VLLM_UNSERVED_ADAPTERS["dora"]


def test_lora_lab_and_vllm_agree_on_every_folder():
    for row in ROWS[1:]:
        ours = row["lora_lab"]
        if row["kind"] == "adapter":
            vllm_serves = row["verdict"] == "ok"
            assert ours["serves_adapter"] is vllm_serves, row
        elif row["kind"] == "w4a16":
            assert row["verdict"] == "ok" and ours["vllm_wna16_problems"] == [], row
        else:
            assert row["verdict"] == "ok" and ours["serves_merged"], row
    checked = {(row["kind"], row["verdict"]) for row in ROWS[1:]}
    assert checked == {("adapter", "ok"), ("adapter", "refused"), ("merged", "ok"), ("w4a16", "ok")}
