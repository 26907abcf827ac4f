"""The interconnect planner: bytes each process sends per optimizer step, per engine. Imports no
torch.

The engines communicate with ring collectives (NCCL), over all --gpus x --nodes processes (N):

    all-reduce of S bytes       each process sends 2 x (N-1)/N x S
    reduce-scatter of S bytes   each process sends (N-1)/N x S
    all-gather of S bytes       each process sends (N-1)/N x S

A ring that spans several nodes crosses each node's network once per direction, so what one
process sends is also about what each node's network link carries per step (spread over its NICs
when NCCL runs several rings).

What each engine moves, per micro-batch or per optimizer step (counted from the DeepSpeed ZeRO
paper and the engines' documented behaviour, not measured here):

    ddp                    all-reduce of the trained parameters' gradients (fp32 under lora-lab's
                           DDP: LoRA weights and full fine-tuning's master weights), once per step
                           or after every micro-batch (train.sync_each_micro_batch)
    deepspeed-zero2(-offload)  reduce-scatter of the 16-bit gradients after every micro-batch, and
                           an all-gather of the updated 16-bit trained parameters after the step
    deepspeed-zero3(-offload)  per micro-batch: the whole model's 16-bit parameters all-gathered
                           twice (forward, backward; the frozen base of LoRA too, as it is sharded
                           with the rest) and a reduce-scatter of the 16-bit gradients
    fsdp                   as ZeRO-3 (gathers in bf16, reshard after forward), the gradients
                           reduce-scattered in the trained weights' dtype, after every micro-batch
                           or once per step (train.sync_each_micro_batch)

The offload engines send what their GPU-only twins send: the offload traffic is PCIe, not network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RunConfig, engine_of, world_size_of
from .engines import FSDP_FULL_STATE_BYTES, TRAINED_STATE_BYTES
from .policies import syncs_each_micro_batch

DDP_GRAD_BYTES = 4
"""lora-lab's DDP trains fp32 parameters (LoRA weights; full fine-tuning's master weights)."""
DEEPSPEED_BYTES = 2
"""DeepSpeed communicates in the model's 16-bit dtype (communication_data_type unset)."""
GATHER_BYTES = 2
"""ZeRO-3 and FSDP gather the parameters in 16 bits for compute."""


@dataclass
class Transfer:
    what: str
    collective: str  # all-reduce, reduce-scatter, all-gather
    payload_bytes: float  # the tensor size the collective moves
    times: int  # per optimizer step

    def sent_bytes(self, processes: int) -> float:
        share = (processes - 1) / processes
        return (2 if self.collective == "all-reduce" else 1) * share * self.payload_bytes * self.times


@dataclass
class TrafficPlan:
    engine: str
    nodes: int
    gpus_per_node: int
    transfers: list = field(default_factory=list)

    @property
    def processes(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sent_bytes_per_step(self) -> float:
        return sum(t.sent_bytes(self.processes) for t in self.transfers)

    def report(self) -> str:
        n = self.processes
        lines = [
            f"  interconnect per optimizer step, engine {self.engine}, {self.nodes} nodes x "
            f"{self.gpus_per_node} GPUs = {n} processes",
            "  (ring collectives: each process sends this, and each node's network link carries about as much):",
        ]
        for t in self.transfers:
            factor = "2 x " if t.collective == "all-reduce" else ""
            times = f" x {t.times}" if t.times > 1 else ""
            lines.append(f"    {t.collective} of {t.what}:")
            lines.append(f"      {factor}({n}-1)/{n} x {_size(t.payload_bytes)}{times} = {_size(t.sent_bytes(n))}")
        total = self.sent_bytes_per_step
        lines.append(
            f"    total {_size(total)} per step; at 25 GB/s per node (200 Gb/s "
            f"InfiniBand) about {total / 25e9:.2f} s of transfer per step"
        )
        return "\n".join(lines)


def _size(count_bytes: float) -> str:
    return f"{count_bytes / 1e9:.2f} GB" if count_bytes >= 1e8 else f"{count_bytes / 1e6:.1f} MB"


def plan_traffic(config: RunConfig, params: int, trained_params: int) -> TrafficPlan:
    """What `config`'s engine sends per optimizer step for a model of `params` parameters of
    which `trained_params` train (memory.ModelShape counts both)."""
    t, engine = config.train, engine_of(config.train)
    plan = TrafficPlan(engine=engine, nodes=t.nodes, gpus_per_node=t.gpus)
    if world_size_of(t) == 1:
        return plan
    each_micro_batch = syncs_each_micro_batch(t)
    kind = "LoRA" if t.tuner != "full" else "all"
    trained = f"{trained_params:,} trained parameters"
    grads = f"the {kind} gradients ({trained}"
    if engine == "ddp":
        plan.transfers.append(
            Transfer(
                f"{grads} x {DDP_GRAD_BYTES} B)",
                "all-reduce",
                trained_params * DDP_GRAD_BYTES,
                t.grad_accum if each_micro_batch else 1,
            )
        )
    elif engine.startswith("deepspeed-zero2"):
        plan.transfers.append(
            Transfer(
                f"{grads} x {DEEPSPEED_BYTES} B), every micro-batch",
                "reduce-scatter",
                trained_params * DEEPSPEED_BYTES,
                t.grad_accum,
            )
        )
        plan.transfers.append(
            Transfer(
                f"the updated {kind} weights ({trained} x {DEEPSPEED_BYTES} B), after the step",
                "all-gather",
                trained_params * DEEPSPEED_BYTES,
                1,
            )
        )
    else:  # deepspeed-zero3(-offload), fsdp: every parameter is sharded
        passes = "forward and backward, every micro-batch"
        plan.transfers.append(
            Transfer(
                f"every parameter ({params:,} x {GATHER_BYTES} B), {passes}",
                "all-gather",
                params * GATHER_BYTES,
                2 * t.grad_accum,
            )
        )
        grad_bytes = (
            DEEPSPEED_BYTES
            if engine.startswith("deepspeed")
            else (
                FSDP_FULL_STATE_BYTES
                if t.tuner == "full"
                else TRAINED_STATE_BYTES.get(t.tuner, TRAINED_STATE_BYTES["lora"])
            )[1]
        )
        times = t.grad_accum if engine.startswith("deepspeed") or each_micro_batch else 1
        plan.transfers.append(
            Transfer(
                f"{grads} x {grad_bytes} B)" + (", every micro-batch" if times > 1 else ""),
                "reduce-scatter",
                trained_params * grad_bytes,
                times,
            )
        )
    return plan
