"""Choices made from the memory plan: the preset for a GPU, the engine for several GPUs, and the
check that stops a run which will not fit."""

from __future__ import annotations

from dataclasses import replace

from ..config import RunConfig, engine_of, world_size_of
from ..errors import LoraLabError
from ..registry import model_config_of
from .engines import CPU_PLAN_MARGIN
from .memory import TIERS_GIB, MemoryPlan, completion_tokens, plan_memory, row_length

ENGINE_PREFERENCE = ("ddp", "deepspeed-zero2", "deepspeed-zero2-offload", "deepspeed-zero3", "deepspeed-zero3-offload")
"""Fastest first (docs/benchmarks-history.md, several GPUs): ZeRO-2 with its optimizer state in CPU
memory comes before ZeRO-3."""


def pick_engine(
    config: RunConfig, gpu_memory_gib: float | None, cpu_memory_gib: float | None = None, deepspeed: bool = True
) -> tuple[str, str]:
    """--engine auto with --gpus N: the first engine of ENGINE_PREFERENCE whose per-GPU plan
    fits the GPU (and whose offloaded state fits CPU memory); without DeepSpeed, fsdp stands in
    for the sharded ones. Returns (engine, why)."""
    if world_size_of(config.train) == 1:
        return engine_of(config.train), "one GPU"
    if config.model.quantization == "nf4":
        return "ddp", "QLoRA's 4-bit weights are not sharded by the engines: a replica per GPU"
    if gpu_memory_gib is None or model_config_of(config.model.name) is None:
        return "ddp", (
            "no GPU memory to plan against"
            if gpu_memory_gib is None
            else f"the planner does not know {config.model.name}"
        ) + ": ddp by default"
    candidates = ENGINE_PREFERENCE if deepspeed else ("ddp", "fsdp")
    tried: list[str] = []
    for engine in candidates:
        trial = replace(config, train=replace(config.train, engine=engine))
        plan = plan_memory(trial, gpu_memory_gib)
        cpu_ok = cpu_memory_gib is None or plan.cpu_total_gib * CPU_PLAN_MARGIN <= 0.9 * cpu_memory_gib
        if plan.fits and cpu_ok:
            return engine, (
                f"about {plan.total_gib:.1f} GiB per GPU of {plan.budget_gib:.1f} "
                f"usable"
                + (f", {plan.cpu_total_gib:.0f} GiB of CPU memory" if plan.cpu_total_gib else "")
                + (f"; does not fit: {', '.join(tried)}" if tried else "")
            )
        tried.append(
            f"{engine} {plan.total_gib:.1f} GiB" + ("" if cpu_ok else f" (+{plan.cpu_total_gib:.0f} GiB CPU)")
        )
    return candidates[-1], (
        f"nothing fits {gpu_memory_gib:.1f} GiB per GPU ({', '.join(tried)}); {candidates[-1]} needs the least"
    )


def pick_preset(gpu_memory_gib: float) -> tuple[str, str]:
    """The largest tier that fits a GPU of this size, and why."""
    for name, tier_gib in sorted(TIERS_GIB.items(), key=lambda kv: -kv[1]):
        if gpu_memory_gib >= tier_gib - 0.6:
            return name, (f"the GPU has {gpu_memory_gib:.1f} GiB; {name} is the largest tier that fits it")
    return "8gb", (
        f"the GPU has {gpu_memory_gib:.1f} GiB, less than the smallest tier (8 GB): "
        f"8gb with a short --max-length is the best chance"
    )


def check_fits(
    config: RunConfig,
    gpu_memory_gib: float,
    longest_sample_tokens: int | None = None,
    cpu_memory_gib: float | None = None,
) -> MemoryPlan | None:
    """Refuse, before loading anything, a run the planner says will not fit the GPU (or, given
    cpu_memory_gib, the machine's RAM); None if unknown."""
    if model_config_of(config.model.name) is None:
        return None
    plan = plan_memory(config, gpu_memory_gib, longest_sample_tokens, cpu_memory_gib)
    if plan.fits and plan.cpu_fits is not False:
        return plan
    if plan.fits:
        raise LoraLabError(
            f"--preset {config.preset}: {plan.model} at --max-length {config.data.max_length} needs about "
            f"{plan.host_peak_gib:.1f} GiB of host RAM ({_host_need(plan)}); this "
            f"machine has {cpu_memory_gib:.1f} GiB, of which a run plans on {plan.cpu_budget_gib:.1f}. Try "
            f"{' or '.join(plan.fixes)}; `lora-lab plan` shows the breakdown. --no-memory-check runs it anyway."
        )
    fixes, budget = plan.fixes, plan.budget_gib
    assert budget is not None, "planned against gpu_memory_gib"
    # two decimals where one would show the need equal to what is usable
    digits = 1 if round(plan.total_gib, 1) > round(budget, 1) else 2
    raise LoraLabError(
        f"--preset {config.preset} needs about {plan.total_gib:.{digits}f} GiB for {plan.model} "
        f"({plan.quantization}) at --max-length {config.data.max_length}"
        f"{f' + --max-completion-length {completion_tokens(config)}' if completion_tokens(config) else ''}"
        f"{f' in packed rows of {row_length(config)} tokens' if config.data.packing else ''}; "
        f"this GPU has "
        f"{gpu_memory_gib:.1f} GiB ({budget:.1f} usable). Try "
        f"{' or '.join(fixes) or 'a smaller model'}; `lora-lab plan` shows the breakdown. "
        f"--no-memory-check runs it anyway."
    )


def _host_need(plan: MemoryPlan) -> str:
    """What the host RAM of a plan is for, at its peak."""
    if plan.loading_host_gib > plan.cpu_total_gib:
        return f"{plan.loading_host_gib:.1f} GiB of 16-bit weights pass through it while the model loads"
    return f"{plan.cpu_total_gib:.1f} GiB of it for {plan.means}"
