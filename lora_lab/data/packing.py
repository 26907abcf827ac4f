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
from dataclasses import dataclass, field

from ..errors import DataError
from .encode import IGNORE_INDEX


@dataclass
class PackedRow:
    input_ids: list
    labels: list
    lengths: list = field(default_factory=list)
    """Token count of each sample in the row, in order."""


@dataclass
class PackedData:
    rows: list
    rows_per_step: int
    samples_per_step: int

    @property
    def longest_row(self) -> int:
        return max(len(row.input_ids) for row in self.rows)

    def summary(self) -> str:
        tokens = sum(len(row.input_ids) for row in self.rows)
        return (f"packing: {self.samples_per_step} samples per optimizer step in "
                f"{self.rows_per_step} row(s); {len(self.rows)} rows, longest {self.longest_row} "
                f"tokens, {tokens / len(self.rows):.0f} on average, no padding")


def pack_samples(samples: list, samples_per_step: int, pack_length: int,
                 seed: int) -> PackedData:
    """Shuffle (seeded), cut into steps of `samples_per_step` samples and split every step into
    the same number of rows (the Trainer's gradient accumulation is fixed), balanced by tokens."""
    longest = max(len(s.input_ids) for s in samples)
    if longest > pack_length:
        raise DataError(f"data.pack_length {pack_length} is shorter than the longest sample "
                        f"({longest} tokens): set --set data.pack_length={longest} or more, or "
                        f"a smaller --max-length.")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    steps = [[samples[i] for i in order[start:start + samples_per_step]]
             for start in range(0, len(order), samples_per_step)]
    rows_per_step = max(math.ceil(sum(len(s.input_ids) for s in step) / pack_length)
                        for step in steps)
    while True:
        split = [_balance(step, rows_per_step) for step in steps]
        if all(sum(len(s.input_ids) for s in row) <= pack_length
               for rows in split for row in rows):
            break
        rows_per_step += 1
    rows = [_concatenate(row) for rows in split for row in rows]
    return PackedData(rows=rows, rows_per_step=rows_per_step,
                      samples_per_step=samples_per_step)


def _balance(step: list, count: int) -> list:
    """Longest first, each sample into the row with the fewest tokens so far."""
    rows = [[] for _ in range(count)]
    sizes = [0] * count
    for sample in sorted(step, key=lambda s: -len(s.input_ids)):
        target = sizes.index(min(sizes))
        rows[target].append(sample)
        sizes[target] += len(sample.input_ids)
    return rows


def _concatenate(samples: list) -> PackedRow:
    row = PackedRow(input_ids=[], labels=[])
    for sample in samples:
        row.input_ids += sample.input_ids
        # The first token of a sample is never a target: no loss crosses a sample boundary.
        row.labels += [IGNORE_INDEX] + list(sample.labels[1:])
        row.lengths.append(len(sample.input_ids))
    return row
