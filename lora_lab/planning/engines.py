"""What each distributed engine does with the training state: the tables the memory planner
(memory.py) and the interconnect planner (traffic.py) both count from, the engines' own GPU
buffers, and where each part of a plan lands on N GPUs (engine_parts).

Several GPUs (train.gpus > 1) and the distributed engines (train.engine) are planned per GPU:
weights, gradients and optimizer state are divided by N where the engine shards them, and moved
to CPU memory where it offloads them, plus DeepSpeed's own buffers (deepspeed_buffers, counted
from presets/engines/*.json). Those terms are COUNTED from the engines' behaviour;
tests/unit/test_memory.py holds them within 15% of the stored two-GPU runs (CHECKED_ON_GPUS). The
offload engines miss by more (GAPS_ON_GPUS, and the plan report says so), and their CPU plan is
low (CPU_PLAN_MARGIN). The activation terms are the single-GPU ones (each GPU runs its own
micro-batch)."""

from __future__ import annotations

import json

from ..config import RunConfig, engine_of, engine_template, world_size_of
from .policies import syncs_each_micro_batch
from .shape import ModelShape
from .tuners import adapter_state_part

GIB = 2**30

# What each engine does with the training state, per GPU: shards (divides by the number of GPUs)
# or offloads to CPU memory. Counted from the DeepSpeed ZeRO paper and docs and PyTorch FSDP's.
ENGINE_SHARDING = {
    #                          parameters      gradients   optimizer state
    "ddp": ("replica", "replica", "replica"),
    "deepspeed-zero2": ("replica", "shard", "shard"),
    "deepspeed-zero2-offload": ("replica", "shard", "cpu"),
    "deepspeed-zero3": ("shard", "shard", "shard"),
    "deepspeed-zero3-offload": ("cpu", "shard", "cpu"),
    "fsdp": ("shard", "shard", "shard"),
}
TRAINED_STATE_BYTES = {
    # per trained parameter: weights, gradients, optimizer state
    "lora": (4, 4, 8),  # fp32 LoRA weights and gradients; AdamW's two fp32 moments
    "full": (2, 2, 12),  # bf16 weights and gradients; fp32 master copy + two fp32 moments = 16
}
FSDP_FULL_STATE_BYTES = (4, 4, 8)
"""Full fine-tuning under FSDP: accelerate upcasts the sharded weights to fp32, the gradients
follow them, and there is no separate master copy."""


CHECKED_ON_GPUS = {
    ("ddp", "lora"),
    ("deepspeed-zero2", "lora"),
    ("deepspeed-zero3", "full"),
    ("fsdp", "full"),
    ("fsdp", "lora"),
}
"""(engine, tuner) whose plan a stored two-GPU run matched within 15%
(tests/unit/test_memory.py)."""
GAPS_ON_GPUS = {
    ("deepspeed-zero2-offload", "full"): (
        0.82,
        "DeepSpeed's caching allocator reserves more than the counted parts allocate (docs/multi-gpu.md has the run)",
    ),
    ("deepspeed-zero3-offload", "full"): (
        1.17,
        "on the safe side: DeepSpeed moves the gradient partitions to CPU memory, where "
        "the plan keeps them on the GPU (docs/multi-gpu.md has the run)",
    ),
}
"""(engine, tuner) whose plan a two-GPU run missed by more than 15%: plan / measured, and why."""
OFFLOAD_FP32_GRAD_BYTES = 4
"""DeepSpeed's CPU optimizer steps on an fp32 copy of the gradients kept in CPU memory."""
PROCESS_CPU_GIB = 4.3
"""Resident CPU memory of a training process besides its model state (imports, CUDA context,
buffers): the two-GPU runs' resident peaks less their counted state (docs/memory-planner.md)."""
CPU_PLAN_MARGIN = 1.45
"""The CPU plan of the offload engines is low (the final save and the optimizer's own copies
come on top): --engine auto asks the machine for this many times it, above the largest ratio of
a stored run's resident peak to its plan (docs/memory-planner.md)."""
UNSHARDED_GRAD_BYTES = 2
"""FSDP2 under no_sync accumulates each parameter's whole gradient in its compute dtype (bf16)."""


def gathered_bytes(shape: ModelShape) -> float:
    """Sharded parameters are all-gathered for the layer that computes and the one prefetched,
    or for the embedding / output head, whichever is larger (16-bit). Counted, not measured."""
    per_layer = shape.linear_params / shape.layers * 2
    embedding = shape.vocab * shape.hidden * 2
    return max(2 * per_layer, embedding)


def deepspeed_buffers(shape: ModelShape, config: RunConfig, trained: int, cpu_optimizer: bool) -> dict:
    """DeepSpeed's own GPU buffers, counted from the engine's JSON in presets/engines/:
    ZeRO-3 keeps up to stage3_max_live_parameters gathered and stage3_prefetch_bucket_size more
    in flight (16-bit); ZeRO-2 reduces and gathers in buckets (double-buffered with
    overlap_comm); with the optimizer on the GPU the step turns this GPU's gradient partition
    into fp32 (sub_group_size, 1e9 by default, is larger than the partitions here).
    Counted from the config: the caching allocator holds more than this (the two-GPU runs
    against their plans: docs/benchmarks-history.md, several GPUs)."""
    zero = json.loads(engine_template(engine_of(config.train)).read_text())["zero_optimization"]
    n, total = world_size_of(config.train), shape.params
    parts = {}
    if not cpu_optimizer:
        parts["fp32 gradient partition at the optimizer step"] = trained * 4 / n / GIB
    if zero["stage"] == 3:
        in_flight = zero["stage3_max_live_parameters"] + zero["stage3_prefetch_bucket_size"]
        parts["gathered parameters (live + prefetch, 16-bit)"] = (
            max(min(in_flight, total) * 2, gathered_bytes(shape)) / GIB
        )
    else:
        copies = 2 if zero.get("overlap_comm") else 1
        parts["reduce and all-gather buckets"] = (
            min(zero["reduce_bucket_size"], trained) * 2 * copies + min(zero["allgather_bucket_size"], trained) * 2
        ) / GIB
    return parts


def engine_parts(shape: ModelShape, config: RunConfig, single: dict) -> tuple[dict, dict]:
    """Per-GPU parts and CPU (offload) parts for N GPUs and an engine, from `single`, the
    single-GPU plan's parts (counted; memory.py's docstring says what the GPU runs checked).

    Parameters, gradients and optimizer state are each kept whole on every GPU (replica),
    divided by N (shard) or moved to CPU memory (cpu) as ENGINE_SHARDING says. The activation
    terms are the fitted single-GPU ones."""
    n, engine, tuner = world_size_of(config.train), engine_of(config.train), config.train.tuner
    per_machine = config.train.gpus  # CPU memory is a machine's: its --gpus processes
    params_where, grads_where, optim_where = ENGINE_SHARDING[engine]
    single = dict(single)
    base_bytes = single.pop("weights") * GIB
    single.pop(adapter_state_part(tuner))
    weight_b, grad_b, optim_b = TRAINED_STATE_BYTES[tuner]
    if (engine, tuner) == ("fsdp", "full"):
        # accelerate upcasts the weights FSDP shards to fp32 (bf16 only while gathered), the
        # gradients follow them: the same 16 bytes a parameter, with no separate master copy
        weight_b, grad_b, optim_b = FSDP_FULL_STATE_BYTES
    trained = shape.trained_params(tuner, config.lora.rank)
    # full fine-tuning trains the base weights themselves: they are the trained weights
    params_bytes = trained * weight_b if tuner == "full" else base_bytes + trained * weight_b
    grads_bytes, optim_bytes = trained * grad_b, trained * optim_b
    gpu, cpu = {}, {}

    def place(name: str, total_bytes: float, where: str):
        if where == "cpu":  # every process's partition, the machine's share of them
            cpu[name] = total_bytes / config.train.nodes / GIB
        else:
            gpu[f"{name} ({'1/' + str(n) if where == 'shard' and n > 1 else 'whole'})"] = (
                total_bytes / (n if where == "shard" else 1) / GIB
            )

    place("weights" if tuner == "full" else "weights (16-bit base, fp32 LoRA)", params_bytes, params_where)
    place("gradients", grads_bytes, grads_where)
    master = tuner == "full" and optim_b > 8
    place("optimizer state" + (" (fp32 master + Adam)" if master else " (Adam)"), optim_bytes, optim_where)
    if optim_where == "cpu":
        cpu["fp32 gradient copy for the CPU optimizer"] = trained * OFFLOAD_FP32_GRAD_BYTES / config.train.nodes / GIB
        if engine == "deepspeed-zero2-offload":
            # stage_1_and_2.py: a pinned 16-bit copy of each process's partition, and with
            # gradient accumulation a pinned 16-bit buffer of every parameter's whole gradient
            # in every process (buffer_to_accumulate_to_in_cpu)
            cpu["16-bit partition buffers"] = trained * 2 / config.train.nodes / GIB
            if config.train.grad_accum > 1:
                cpu["whole 16-bit gradients, in every process"] = trained * 2 * per_machine / GIB
        cpu["the processes' own memory (measured)"] = PROCESS_CPU_GIB * per_machine
    if engine == "ddp" and n > 1:
        gpu["DDP buckets (a copy of the gradients)"] = grads_bytes / GIB
    held = config.train.grad_accum > 1 and not syncs_each_micro_batch(config.train)
    if engine == "fsdp" and held:
        gpu["whole gradients between micro-batches"] = trained * UNSHARDED_GRAD_BYTES / GIB
    if engine.startswith("deepspeed"):
        gpu.update(deepspeed_buffers(shape, config, trained, optim_where == "cpu"))
    elif params_where != "replica":
        gpu["gathered parameters in flight"] = gathered_bytes(shape) / GIB
    return {**gpu, **single}, cpu
