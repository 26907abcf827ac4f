"""The `auto` settings that follow from the asked config alone (no machine, no data): whether the
fast LoRA path runs, whether gradients are reduced after every micro-batch. The run plan
(training/plan.py) records what they give; the planner counts with the same rules."""

from __future__ import annotations

from ..config.fields import REFERENCE_TASKS, RunConfig, TrainArgs
from ..config.rules import engine_of


def resolve_liger_experts(config: RunConfig) -> bool:
    """model.liger_experts -> whether a family's experts run through liger's fused MoE where the
    liger kernels apply: auto is off with lora.experts, whose LoRA then runs in low rank on
    transformers' grouped products (models/moe.py) with no delta and no weight gradient of the
    frozen experts, and on without it."""
    setting = config.model.liger_experts
    return setting if isinstance(setting, bool) else not config.lora.experts


def resolve_fast_lora(config: RunConfig) -> bool:
    """model.fast_lora -> whether this run routes its LoRA layers through the fast path: auto is
    on for LoRA without adapter dropout (with dropout every layer would fall back to peft) under
    DDP or one process. Not under the sharding engines by default: the fast path reads each
    frozen weight itself, without calling the base layer, whose hooks gather ZeRO-3 shards.
    Never for --tuner dora or ia3 (their layers compute other than W x + s B A x; true is
    refused for them by the config's validation). lora.init pissa and olora keep the fast path:
    after the decomposition the base holds the residual and each layer is plain LoRA again;
    rsLoRA only changes the layer's scaling, which the fast path reads."""
    setting = config.model.fast_lora
    if config.train.tuner != "lora" or setting is False:
        return False
    if config.train.task in REFERENCE_TASKS:  # the reference is a second adapter (peft's layers)
        return False
    return setting is True or (config.lora.dropout == 0 and engine_of(config.train) == "ddp")


def syncs_each_micro_batch(train: TrainArgs) -> bool:
    """train.sync_each_micro_batch resolved: auto is on for FSDP (see its help)."""
    if train.sync_each_micro_batch == "auto":
        return train.engine == "fsdp"
    return bool(train.sync_each_micro_batch)
