"""Token length statistics of a dataset, measured with the real chat template."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import DataError
from .encode import encode_samples

CANDIDATE_LENGTHS = (512, 1024, 2048, 4096)
RECOMMENDABLE = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class LengthStats:
    count: int
    mean: float
    p50: int
    p90: int
    p99: int
    max: int
    over: dict = field(default_factory=dict)
    """Candidate max_length -> samples longer than it (cut with truncate, lost with drop)."""
    recommended_max_length: int = 0
    lengths: list = field(default_factory=list, repr=False)
    """Every sample's length, shortest first (for a histogram)."""

    def table(self) -> str:
        lines = [
            f"samples {self.count}  mean {self.mean:.0f}  p50 {self.p50}  p90 {self.p90}  "
            f"p99 {self.p99}  max {self.max}  (tokens, with the chat template)",
            "",
            "max_length   samples over it (cut with --truncation truncate, dropped with drop)",
        ]
        for length, over in self.over.items():
            lines.append(f"{length:>10}   {over:>6} ({over / self.count:.1%})")
        lines.append(
            f"\nrecommended --max-length {self.recommended_max_length} "
            f"(the smallest that keeps at least 99% of samples whole)"
        )
        return "\n".join(lines)


def percentile(sorted_values: list, fraction: float) -> int:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


UNCUT = 10**9
"""max_length the statistics encode with: every sample whole."""


def length_stats(tokenizer, samples: list, system: str | None = None, enable_thinking="auto") -> LengthStats:
    report = encode_samples(tokenizer, samples, max_length=UNCUT, system=system, enable_thinking=enable_thinking)
    return stats_of_lengths([len(s.input_ids) for s in report.samples])


def dataset_length_stats(specs: list, args, tokenizer, seed: int) -> tuple[LengthStats, dict]:
    """length_stats of --data entries read as a run reads them, through the data cache; and
    {"problems": rows that could not be used, "formats": (entry, format) pairs}."""
    from .arrow import sample_lengths
    from .cache import cached_encoding

    def build(stream):
        read = stream.read_specs(specs, args, seed)
        if not read.numbers:
            raise DataError(f"--data {' '.join(specs)}: no usable sample.")
        return {"all": stream.report(read.numbers, "all")}, {"problems": len(read.problems), "formats": read.formats}

    reports, extra, _ = cached_encoding(
        "stats", specs, args, tokenizer, seed, "sft", (UNCUT, "truncate", args.system, args.enable_thinking), build
    )
    return stats_of_lengths(sample_lengths(reports["all"].samples)), extra


def stats_of_lengths(lengths: list) -> LengthStats:
    lengths = sorted(lengths)
    p99 = percentile(lengths, 0.99)
    return LengthStats(
        count=len(lengths),
        mean=sum(lengths) / len(lengths),
        p50=percentile(lengths, 0.5),
        p90=percentile(lengths, 0.9),
        p99=p99,
        max=lengths[-1],
        over={n: sum(1 for length in lengths if length > n) for n in CANDIDATE_LENGTHS},
        recommended_max_length=next((n for n in RECOMMENDABLE if n >= p99), RECOMMENDABLE[-1]),
        lengths=lengths,
    )
