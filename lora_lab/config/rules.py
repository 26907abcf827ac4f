"""Facts that follow from a config's own values: whether it trains an adapter, how many processes
it runs, where its nodes meet, which engine file it launches with."""

from __future__ import annotations

from pathlib import Path

from ..paths import presets_dir
from .fields import ADAPTER_TUNERS, DEEPSPEED_ENGINES, LoraArgs, TrainArgs


def trains_adapter(train: TrainArgs) -> bool:
    """The run trains an adapter (adapter/), not every weight (model/)."""
    return train.tuner in ADAPTER_TUNERS


def converts_initial_adapter(lora: LoraArgs) -> bool:
    """lora.init pissa / pissa_niter_N / olora change the base weights: the final adapter is
    saved converted against the initial one (peft path_initial_model_for_weight_conversion)."""
    return lora.init.startswith("pissa") or lora.init == "olora"


GROUPED_PRODUCT_ROW_BYTES = 16
"""torch's grouped matrix product takes matrices whose rows fill whole 16-byte steps."""


def expert_lora_rank_grouped(rank: int, element_bytes: int = 2) -> bool:
    """lora.experts at this rank can run in low rank on the experts' grouped products
    (models/moe.py): the factors' rows of `rank` values (bf16: 2 bytes each) fill whole
    GROUPED_PRODUCT_ROW_BYTES steps (rank 8, 16, 32... in bf16); other ranks add their delta to
    the experts' tensors."""
    return rank * element_bytes % GROUPED_PRODUCT_ROW_BYTES == 0


DEFAULT_MAIN_PORT = 29500
"""torchrun's and accelerate's port when --main-address names none."""


def world_size_of(train: TrainArgs) -> int:
    """Processes in the whole run: --gpus on each of --nodes machines."""
    return train.gpus * train.nodes


def engine_of(train: TrainArgs) -> str:
    """The engine a run uses: train.engine, where auto with one process is ddp (the one rule for
    it). With several processes auto stays auto until the run plan picks the engine
    (training/plan.py settle_engine, planning.choice.pick_engine)."""
    if train.engine == "auto" and world_size_of(train) == 1:
        return "ddp"
    return train.engine


def main_host_port(train: TrainArgs) -> tuple[str, int]:
    """--main-address HOST[:PORT] as (host, port); the port defaults to DEFAULT_MAIN_PORT."""
    address = train.main_address or "127.0.0.1"
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    return host.strip("[]"), int(port) if port else DEFAULT_MAIN_PORT


def engine_template(engine: str) -> Path:
    """presets/engines/<engine>.json (DeepSpeed) or .yaml (accelerate: ddp, fsdp)."""
    suffix = ".json" if engine in DEEPSPEED_ENGINES else ".yaml"
    return presets_dir() / "engines" / f"{engine}{suffix}"
