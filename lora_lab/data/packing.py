"""Padding-free packing: the samples of one optimizer step share as few rows as the GPU allows.

Without packing, a step of micro_batch_size x grad_accum samples runs grad_accum forward/backward
passes, each padded to its longest sample; with short chat samples most of that time is the
fixed cost of a pass. Packing keeps the step's samples (the same samples per optimizer step, so
the same effective batch) but concatenates them into `rows_per_step` rows of at most
`pack_length` tokens. Each sample keeps its own position ids (0, 1, ...) and attends only to
itself (a block-diagonal causal mask, lora_lab.train.PackedCollator), so the loss and gradients
equal those of the samples run one by one (tests/unit/test_packing.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import DataError
from .arrow import sample_lengths
from .encode import IGNORE_INDEX


@dataclass
class PackedRow:
    input_ids: list
    labels: list
    lengths: list = field(default_factory=list)
    """Token count of each sample in the row, in order."""


class PackedRows(Sequence):
    """The packed rows, each built from its samples only when it is read: the plan holds the
    sample indices of every row, so packing a mapped dataset reads no token ids up front."""

    def __init__(self, samples, plan: list):
        self.samples, self.plan = samples, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _concatenate([self.samples[i] for i in self.plan[index]])


@dataclass
class PackedData:
    rows: Sequence
    rows_per_step: int
    samples_per_step: int
    row_tokens: list = field(default_factory=list)
    """Tokens in each row, in order."""

    @property
    def longest_row(self) -> int:
        return max(self.row_tokens)

    def summary(self) -> str:
        return (
            f"packing: {self.samples_per_step} samples per optimizer step in "
            f"{self.rows_per_step} row(s); {len(self.rows)} rows, longest {self.longest_row} "
            f"tokens, {sum(self.row_tokens) / len(self.rows):.0f} on average, no padding"
        )


def pack_samples(samples, samples_per_step: int, pack_length: int, seed: int) -> PackedData:
    """Shuffle (seeded), cut into steps of `samples_per_step` samples and split every step into
    the same number of rows (the Trainer's gradient accumulation is fixed), balanced by tokens.
    Only the samples' lengths are read here (arrow.sample_lengths)."""
    lengths = sample_lengths(samples)
    longest = max(lengths)
    if longest > pack_length:
        raise DataError(
            f"data.pack_length {pack_length} is shorter than the longest sample "
            f"({longest} tokens): set --set data.pack_length={longest} or more, or "
            f"a smaller --max-length."
        )
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    steps = [order[start : start + samples_per_step] for start in range(0, len(order), samples_per_step)]
    step_tokens = [sum(map(lengths.__getitem__, step)) for step in steps]
    rows_per_step = max(math.ceil(tokens / pack_length) for tokens in step_tokens)
    if rows_per_step == 1:  # every step one row: _balance's order, without its bookkeeping
        plan = [sorted(step, key=lengths.__getitem__, reverse=True) for step in steps]
        return PackedData(
            rows=PackedRows(samples, plan), rows_per_step=1, samples_per_step=samples_per_step, row_tokens=step_tokens
        )
    while True:
        split = [_balance(step, rows_per_step, lengths) for step in steps]
        if all(sum(lengths[i] for i in row) <= pack_length for rows in split for row in rows):
            break
        rows_per_step += 1
    plan = [row for rows in split for row in rows]
    return PackedData(
        rows=PackedRows(samples, plan),
        rows_per_step=rows_per_step,
        samples_per_step=samples_per_step,
        row_tokens=[sum(lengths[i] for i in row) for row in plan],
    )


def _balance(step: list, count: int, lengths: list) -> list:
    """Longest first, each sample into the row with the fewest tokens so far."""
    rows: list[list] = [[] for _ in range(count)]
    sizes = [0] * count
    for index in sorted(step, key=lambda i: -lengths[i]):
        target = sizes.index(min(sizes))
        rows[target].append(index)
        sizes[target] += lengths[index]
    return rows


def _concatenate(samples: list) -> PackedRow:
    row = PackedRow(input_ids=[], labels=[])
    for sample in samples:
        row.input_ids += sample.input_ids
        # The first token of a sample is never a target: no loss crosses a sample boundary.
        row.labels += [IGNORE_INDEX] + list(sample.labels[1:])
        row.lengths.append(len(sample.input_ids))
    return row
