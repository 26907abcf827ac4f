"""Data stage: read datasets (formats), encode them with the chat template (encode), stats."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..config import DataArgs
from ..errors import DataError
from .encode import IGNORE_INDEX, EncodedSample, EncodeReport, encode_samples
from .formats import LoadedData, Problem, Sample, load_dataset_spec

__all__ = ["IGNORE_INDEX", "EncodedSample", "EncodeReport", "PreparedData", "Problem", "Sample",
           "load_samples", "prepare_data"]


@dataclass
class PreparedData:
    train: EncodeReport
    val: EncodeReport | None
    read_problems: list = field(default_factory=list)
    """Rows that could not be read or normalised (file:line and reason)."""

    def all_problems(self) -> list:
        val = self.val.problems if self.val else []
        return self.read_problems + self.train.problems + val

    def summary(self, max_length: int) -> str:
        lines = [f"train: {self.train.summary(max_length)}"]
        if self.val:
            lines.append(f"val:   {self.val.summary(max_length)}")
        if self.read_problems:
            lines.append(f"{len(self.read_problems)} rows could not be read")
        return "\n".join(lines)


def load_samples(specs: list, args: DataArgs, seed: int) -> LoadedData:
    """Read and mix several --data entries."""
    merged = LoadedData()
    fill = {"model_name": args.model_name, "model_author": args.model_author}
    for spec in specs:
        loaded = load_dataset_spec(spec, args.format, seed, fill)
        merged.samples += loaded.samples
        merged.problems += loaded.problems
    return merged


def prepare_data(args: DataArgs, tokenizer, seed: int = 42) -> PreparedData:
    """Training and validation sets, encoded; every row not used is listed with its reason."""
    train = load_samples(args.datasets, args, seed)
    read_problems = list(train.problems)
    val_samples = None
    if args.val_data:
        val = load_samples(args.val_data, args, seed)
        read_problems += val.problems
        val_samples = val.samples
    elif args.val_ratio:
        shuffled = list(train.samples)
        random.Random(seed).shuffle(shuffled)
        count = max(1, round(len(shuffled) * args.val_ratio))
        if count >= len(shuffled):
            raise DataError(f"--val-ratio {args.val_ratio} leaves no training rows out of "
                            f"{len(shuffled)}.")
        val_samples, train.samples = shuffled[:count], shuffled[count:]
    encode = lambda samples: encode_samples(tokenizer, samples, args.max_length,  # noqa: E731
                                            args.truncation, args.system)
    prepared = PreparedData(train=encode(train.samples),
                            val=encode(val_samples) if val_samples is not None else None,
                            read_problems=read_problems)
    if not prepared.train.samples:
        first = "; ".join(str(p) for p in prepared.all_problems()[:3])
        raise DataError(f"--data {' '.join(args.datasets)}: no usable training sample "
                        f"({len(prepared.all_problems())} problems, first: {first}).")
    return prepared
