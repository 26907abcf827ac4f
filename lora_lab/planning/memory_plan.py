"""The memory plan of a run (planning.memory.plan_memory makes it): GPU parts, CPU parts, the
verdict against the card and against the machine's RAM, and its report.

Host RAM of a one-GPU run: the CPU parts (offloaded layer checkpoints in pinned memory, exactly
their bytes: models/host_memory.py; the input embedding table) and the process itself (Python,
torch and the CUDA libraries: a fitted constant). A run may plan on HOST_SHARE of the machine's
RAM; the rest is the system's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .engines import CHECKED_ON_GPUS, GAPS_ON_GPUS

if TYPE_CHECKING:
    from .traffic import TrafficPlan

CONTEXT_GIB = 0.5
FIT_PROCESS_HOST_GIB = 1.8
"""A training process's own resident memory beside its counted CPU parts: peak RSS less the
counted parts of the stored long-context cells (docs/memory-planner.md)."""
HOST_SHARE = 0.85
"""The share of the machine's RAM a run may plan to use."""


def usable_host_gib(cpu_memory_gib: float | None) -> float | None:
    return None if cpu_memory_gib is None else cpu_memory_gib * HOST_SHARE


@dataclass
class MemoryPlan:
    model: str
    quantization: str
    tokens_per_micro_batch: int
    parts_gib: dict = field(default_factory=dict)
    gpus: int = 1
    """Processes of the whole run (--gpus x --nodes): the engines shard over all of them."""
    nodes: int = 1
    engine: str = "ddp"
    tuner: str = "lora"
    cpu_parts_gib: dict = field(default_factory=dict)
    """CPU memory for offloaded state, for all processes of one machine together."""
    packed: bool = False
    means: str = "none"
    """The long-sequence means (models/memory_means.py) the run will use."""
    counted: bool = False
    """True when the plan rests on counted, not measured, terms (several GPUs, engines, full)."""
    budget_gib: float | None = None
    cpu_budget_gib: float | None = None
    """The machine's RAM a one-GPU run may plan to use (usable_host_gib), when known."""
    loading_host_gib: float = 0.0
    """What passes through CPU memory while the model loads, before training holds its host
    parts: QLoRA of a mixture of experts (its 16-bit experts) or of an MXFP4 checkpoint (the
    whole model de-quantized); 0 where the weights load onto the GPU."""
    longest_max_length: int | None = None
    """The longest max_length (micro-batch 1) that fits the budget with these settings."""
    fixes: list = field(default_factory=list)
    """The knobs that would make it fit, as flags."""
    room_for_layers: int = 0
    """How many more decoder layers could skip their recomputation (train.uncheckpointed_layers)
    within planning.memory.ROOM_SHARE of the budget."""
    traffic: TrafficPlan | None = None
    """Several nodes: what the engine sends per step (planning.traffic.TrafficPlan)."""

    kept: int = 0
    """train.uncheckpointed_layers as planned."""

    @property
    def checked(self) -> bool:
        """A two-GPU run has checked plans of this engine and tuner (CHECKED_ON_GPUS)."""
        return self.gpus > 1 and (self.engine, self.tuner) in CHECKED_ON_GPUS

    @property
    def total_gib(self) -> float:
        return sum(self.parts_gib.values())

    @property
    def fits(self) -> bool | None:
        return None if self.budget_gib is None else self.total_gib <= self.budget_gib

    @property
    def cpu_total_gib(self) -> float:
        return sum(self.cpu_parts_gib.values())

    @property
    def host_gib(self) -> float:
        """The host RAM of a one-GPU run: its CPU parts and the process itself."""
        return self.cpu_total_gib + FIT_PROCESS_HOST_GIB

    @property
    def host_peak_gib(self) -> float:
        """The host RAM of a one-GPU run at its highest: loading or training, with the process."""
        return max(self.cpu_total_gib, self.loading_host_gib) + FIT_PROCESS_HOST_GIB

    @property
    def cpu_fits(self) -> bool | None:
        return None if self.cpu_budget_gib is None else self.host_peak_gib <= self.cpu_budget_gib

    def room_hint(self) -> str:
        """The train.uncheckpointed_layers that room_for_layers allows, or "" for no room."""
        if not self.room_for_layers:
            return ""
        return (
            f"room for {self.room_for_layers} more layers not recomputed (faster): --set "
            f"train.uncheckpointed_layers={self.room_for_layers + self.kept}"
        )

    def report(self) -> str:
        lines = [f"{self.model}, {self.quantization}, {self.tokens_per_micro_batch} tokens per micro-batch"]
        if self.gpus > 1 or self.engine != "ddp":
            lines[0] += (
                f"; per GPU of {self.gpus}"
                + (f" ({self.nodes} nodes x {self.gpus // self.nodes})" if self.nodes > 1 else "")
                + f", engine {self.engine}"
            )
        if self.counted:
            ratio, why = GAPS_ON_GPUS.get((self.engine, self.tuner), (None, ""))
            verdict = ("TOO LOW" if ratio < 1 else "too high") if ratio else ""
            lines[0] += (
                " (state terms counted, checked on two GPUs)"
                if self.checked
                else f" (state terms counted; {verdict}: {why})"
                if ratio
                else " (state terms counted, not checked on GPUs)"
            )
        if self.means != "none":
            lines.append(f"  memory means: {self.means}")
        lines += [f"  {name:<44} {gib:6.2f} GiB" for name, gib in self.parts_gib.items()]
        peak = "predicted peak (torch max_memory_reserved)"
        lines.append(f"  {peak:<44} {self.total_gib:6.2f} GiB")
        if self.cpu_parts_gib:
            lines.append("  CPU memory for offload" + (" (a machine's processes together):" if self.gpus > 1 else ":"))
            lines += [f"    {name:<42} {gib:6.2f} GiB" for name, gib in self.cpu_parts_gib.items()]
            lines.append(f"    {'total':<42} {self.cpu_total_gib:6.2f} GiB")
        if self.loading_host_gib:
            lines.append(
                f"  CPU memory while loading (weights before the GPU holds them in 4 bits): {self.loading_host_gib:.2f} GiB"
            )
        if self.cpu_budget_gib is not None:
            verdict = "fits" if self.cpu_fits else "does NOT fit"
            lines.append(
                f"  host RAM with the process (about {FIT_PROCESS_HOST_GIB} GiB): {self.host_peak_gib:.2f} GiB, {verdict} "
                f"in {self.cpu_budget_gib:.1f} GiB ({HOST_SHARE:.0%} of the machine's RAM)"
            )
        if self.budget_gib is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"  {verdict} in {self.budget_gib:.1f} GiB (GPU memory - {CONTEXT_GIB} GiB for the CUDA context)"
            )
        if self.longest_max_length:
            knob = "data.pack_length" if self.packed else "--max-length"
            lines.append(f"  longest {knob} that fits: {self.longest_max_length}")
        if self.fits is False or self.cpu_fits is False:
            lines.append(f"  to fit: {' or '.join(self.fixes) or 'a smaller model'}")
        if self.room_for_layers:
            lines.append(f"  {self.room_hint()}")
        if self.traffic is not None:
            lines.append(self.traffic.report())
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: whether the run fits the GPU (and the host RAM, where planned against it)
        and what to change where it does not."""
        peak = f"predicted peak {self.total_gib:.2f} GiB"
        if self.fits is None:
            return f"{peak} (give the GPU memory for a verdict)"
        usable = f"{peak} of {self.budget_gib:.1f} GiB usable"
        if self.fits and self.cpu_fits is not False:
            return f"fits: {usable}"
        short = usable if not self.fits else f"host RAM {self.host_gib:.2f} GiB of {self.cpu_budget_gib:.1f} GiB"
        return f"does NOT fit: {short}; to fit: {' or '.join(self.fixes) or 'a smaller model'}"
