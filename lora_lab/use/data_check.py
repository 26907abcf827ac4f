"""The data check that `lora-lab data validate` and the web page run: datasets read the way a
run reads them, every problem a `file:line: severity: reason` line, and (for the page) the
token-length statistics of `lora-lab data stats`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import RunConfig, resolve_config
from ..data import ValidationReport, validate_data, with_identity_stand_ins


def data_config(
    datasets: list,
    *,
    model: str | None = None,
    max_length: str | int = "2048",
    row_format: str = "auto",
    model_name: str | None = None,
    model_author: str | None = None,
    training: bool = False,
) -> tuple[RunConfig, str | None]:
    """The config the data commands read datasets with, and a note to print (or None). Not
    `training` (validate, stats, preview): a bundled identity set's missing --model-name /
    --model-author read as stand-ins, said in the note (data.with_identity_stand_ins)."""
    config = resolve_config(
        None,
        flags={
            "data.datasets": list(datasets),
            "model.name": model,
            "data.max_length": max_length,
            "data.format": row_format,
            "data.model_name": model_name,
            "data.model_author": model_author,
        },
        training=training,
    )
    if training:
        return config, None
    data, note = with_identity_stand_ins(config.data)
    return dataclasses.replace(config, data=data), note  # a resolved config is frozen


def counting_tokenizer(spec: str) -> tuple[object, str]:
    """The tokenizer the data commands count with (models.load.locate_tokenizer), and the line
    that says which it is."""
    from ..models.load import load_tokenizer, locate_tokenizer

    path, source = locate_tokenizer(spec)
    return load_tokenizer(spec, path=path), source


@dataclass
class DataCheckResult:
    report: ValidationReport
    notes: list = field(default_factory=list)
    """Lines said before the problems: stand-ins used, the tokenizer counted with."""
    stats: object | None = None
    """data.stats.LengthStats of the usable rows, when asked for and there are any."""

    def problem_lines(self) -> list[str]:
        """Every error, then every warning: `file:line: severity: reason`."""
        return [
            f"{p.origin}: {severity}: {p.reason}"
            for severity, problems in (("error", self.report.errors), ("warning", self.report.warnings))
            for p in problems
        ]

    def summary_lines(self) -> list[str]:
        return [*self.notes, self.report.summary()]

    def lines(self) -> list[str]:
        """What `lora-lab data validate` prints: the notes, the problems, the summary."""
        return [*self.notes, *self.problem_lines(), self.report.summary()]


def check_data(
    datasets: list,
    *,
    model: str | None = None,
    max_length: str | int = "2048",
    row_format: str = "auto",
    model_name: str | None = None,
    model_author: str | None = None,
    task: str = "sft",
    stats: bool = False,
) -> DataCheckResult:
    """Check datasets row by row as a run of `task` reads them (data.validate_data); with a
    model, also encoded with its chat template (lengths, trained tokens). stats: the token-length
    statistics of the usable rows too (needs a model)."""
    config, note = data_config(
        datasets,
        model=model,
        max_length=max_length,
        row_format=row_format,
        model_name=model_name,
        model_author=model_author,
    )
    notes = [note] if note else []
    tokenizer = None
    if model:
        tokenizer, source = counting_tokenizer(config.model.name)
        notes.append(source)
    report = validate_data(list(datasets), config.data, tokenizer, config.train.seed, task)
    result = DataCheckResult(report, notes)
    if stats and tokenizer is not None and report.kept:
        from ..data.stats import dataset_length_stats

        result.stats, _ = dataset_length_stats(list(datasets), config.data, tokenizer, config.train.seed)
    return result
