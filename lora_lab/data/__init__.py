"""Data stage: read datasets (formats), encode them with the chat template (encode), stats."""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass, field
from typing import Any

from ..config import DataArgs
from ..errors import DataError
from ..paths import identity_datasets
from .encode import IGNORE_INDEX, EncodedSample, EncodeReport, encode_samples
from .formats import Problem, Sample
from .reading import LoadedData, load_dataset_spec

__all__ = [
    "IGNORE_INDEX",
    "EncodedSample",
    "EncodeReport",
    "PreparedData",
    "Problem",
    "Sample",
    "ValidationReport",
    "load_samples",
    "prepare_data",
    "validate_data",
    "with_identity_stand_ins",
]

# `data validate`, `stats` and `preview` only count, check or show rows, and the bundled identity
# set is looked at before a name is chosen (LLaMA-Factory ships identity.json with {{name}} /
# {{author}} to read and fill): there a missing value reads as a visible stand-in, said in one
# line. A run and `data encode` (its ids are what a run trains on) need the real values, as
# ms-swift requires model_name / model_author for its self-cognition set.
IDENTITY_STAND_INS = {"model_name": "<NAME>", "model_author": "<AUTHOR>"}


def with_identity_stand_ins(args: DataArgs) -> tuple[DataArgs, str | None]:
    """`args` with IDENTITY_STAND_INS for a missing --model-name / --model-author, and the line
    that says so; unchanged (and None) unless every dataset is a bundled identity set, so that
    the placeholders of a user's own file keep their warning."""
    specs = args.datasets + args.val_data
    missing: dict[str, Any] = {key: value for key, value in IDENTITY_STAND_INS.items() if not getattr(args, key)}
    if not missing or not specs or identity_datasets(specs) != specs:
        return args, None
    placeholders = " and ".join(f"{{{{{k.removeprefix('model_').upper()}}}}}" for k in missing)
    flags = " and ".join("--" + key.replace("_", "-") for key in missing)
    return dataclasses.replace(args, **missing), (
        f"note: --data {' '.join(specs)}: {placeholders} shown as "
        f"{' and '.join(missing.values())} ({flags} not given; a run needs --model-name and "
        f"--model-author)"
    )


@dataclass
class PreparedData:
    train: EncodeReport
    val: EncodeReport | None
    read_problems: list = field(default_factory=list)
    """Rows that could not be read or normalised (file:line and reason)."""
    read_warnings: list = field(default_factory=list)
    """Remarks on rows and files that were read correctly (BOM, CRLF, unused fields)."""
    formats: list = field(default_factory=list)
    """(--data entry, detected row format) for every dataset read."""
    cache: str = "not cached"
    """How the encoded samples were got: reused, encoded (and stored) or not cached."""

    def all_problems(self) -> list:
        val = self.val.problems if self.val else []
        return self.read_problems + self.train.problems + val

    def all_warnings(self) -> list:
        return list(self.read_warnings)

    def summary(self, max_length: int) -> str:
        lines = [f"format: {spec}: {fmt}" for spec, fmt in self.formats]
        lines.append(f"train: {self.train.summary(max_length)}")
        if self.val:
            lines.append(f"val:   {self.val.summary(max_length)}")
        if self.read_problems:
            lines.append(f"{len(self.read_problems)} rows could not be read")
        if self.read_warnings:
            lines.append(f"{len(self.read_warnings)} warnings (rows read correctly)")
        return "\n".join(lines)


def load_samples(specs: list, args: DataArgs, seed: int, task: str = "sft") -> LoadedData:
    """Read and mix several --data entries (preference rows for a preference --task, prompts for
    grpo)."""
    from .pairs import load_preference_spec
    from .prompts import load_prompt_spec

    merged = LoadedData()
    fill = {"model_name": args.model_name, "model_author": args.model_author}
    for spec in specs:
        if task == "sft":
            loaded = load_dataset_spec(spec, args.format, seed, fill)
        elif task == "grpo":
            loaded = load_prompt_spec(spec, seed)
        else:
            loaded = load_preference_spec(spec, task, seed)
        merged.samples += loaded.samples
        merged.problems += loaded.problems
        merged.warnings += loaded.warnings
        merged.formats += loaded.formats
    return merged


def encode_as_training(tokenizer, samples: list, args: DataArgs, task: str = "sft") -> EncodeReport:
    """Encode samples exactly as a run with these data settings encodes its training data."""
    if task == "grpo":
        from .prompts import encode_prompts

        return encode_prompts(tokenizer, samples, args.max_length, args.system, args.enable_thinking)
    if task != "sft":
        from .pairs import encode_preferences

        return encode_preferences(tokenizer, samples, args.max_length, args.truncation, args.system)
    return encode_samples(tokenizer, samples, args.max_length, args.truncation, args.system, args.enable_thinking)


def read_and_encode(
    specs: list, args: DataArgs, tokenizer, seed: int, task: str = "sft"
) -> tuple[LoadedData, EncodeReport]:
    """Datasets read and encoded with a run's data settings (held-out eval, calibration)."""
    loaded = load_samples(specs, args, seed, task)
    return loaded, encode_as_training(tokenizer, loaded.samples, args, task)


def encode_settings(args: DataArgs) -> tuple:
    """(max_length, truncation, system, enable_thinking): what encode_samples takes."""
    return args.max_length, args.truncation, args.system, args.enable_thinking


def prepare_data(args: DataArgs, tokenizer, seed: int = 42, task: str = "sft") -> PreparedData:
    """Training and validation sets, encoded; every row not used is listed with its reason.
    A preference task reads and encodes preference rows (pairs.py). SFT data is encoded in
    data.num_proc processes and kept in the data cache (cache.py) unless data.cache is false:
    a second call with the same files and settings maps the stored samples and reports the
    same problems and warnings."""
    if task != "sft":
        return build_prepared(
            args,
            seed,
            lambda specs: load_samples(specs, args, seed, task),
            lambda samples, name: encode_as_training(tokenizer, samples, args, task),
        )
    from .cache import cached_encoding, problems_from_json, problems_json

    def build(stream):
        prepared = build_prepared(args, seed, lambda specs: stream.read_specs(specs, args, seed), stream.report)
        return {"train": prepared.train, "val": prepared.val}, {
            "read_problems": problems_json(prepared.read_problems),
            "read_warnings": problems_json(prepared.read_warnings),
            "formats": prepared.formats,
        }

    reports, extra, how = cached_encoding(
        "prepare", args.datasets + args.val_data, args, tokenizer, seed, task, encode_settings(args), build
    )
    return PreparedData(
        train=reports["train"],
        val=reports["val"],
        read_problems=problems_from_json(extra["read_problems"]),
        read_warnings=problems_from_json(extra["read_warnings"]),
        formats=[tuple(f) for f in extra["formats"]],
        cache=how,
    )


def split_off(items, val_ratio: float, seed: int) -> tuple:
    """(validation, training) items: the first round(len * val_ratio) (at least one) of the
    items shuffled with `seed`, and the rest."""
    shuffled = items[:]
    random.Random(seed).shuffle(shuffled)
    count = max(1, round(len(shuffled) * val_ratio))
    if count >= len(shuffled):
        raise DataError(f"--val-ratio {val_ratio} leaves no training rows out of {len(shuffled)}.")
    return shuffled[:count], shuffled[count:]


def check_prepared(args: DataArgs, prepared: PreparedData) -> PreparedData:
    if not len(prepared.train.samples):
        first = "; ".join(str(p) for p in prepared.all_problems()[:3])
        raise DataError(
            f"--data {' '.join(args.datasets)}: no usable training sample "
            f"({len(prepared.all_problems())} problems, first: {first})."
        )
    return prepared


def build_prepared(args: DataArgs, seed: int, read, report) -> PreparedData:
    """prepare_data's reading, mixing and split, whatever holds the samples: read(specs) reads
    --data entries (LoadedData: samples in memory, or stream.SpecsRead: sample numbers, as
    `items`); report(items, "train" / "val") encodes a choice of them."""
    train = read(args.datasets)
    read_problems, read_warnings = list(train.problems), list(train.warnings)
    formats = list(train.formats)
    train_items, val_items = train.items, None
    if args.val_data:
        val = read(args.val_data)
        read_problems += val.problems
        read_warnings += val.warnings
        formats += [(f"{spec} (validation)", fmt) for spec, fmt in val.formats]
        val_items = val.items
    elif args.val_ratio:
        val_items, train_items = split_off(train_items, args.val_ratio, seed)
    prepared = PreparedData(
        train=report(train_items, "train"),
        val=None if val_items is None else report(val_items, "val"),
        read_problems=read_problems,
        read_warnings=read_warnings,
        formats=formats,
    )
    return check_prepared(args, prepared)


@dataclass
class ValidationReport:
    """What `lora-lab data validate` found: the rows a run would keep, errors and warnings."""

    kept: list = field(default_factory=list)
    """Origins (file:line) of the rows a run would train on."""
    errors: list = field(default_factory=list)
    """Rows a run would skip, and datasets it could not read at all."""
    warnings: list = field(default_factory=list)
    """Rows read correctly or cut to --max-length, with what to look at."""
    tokens_checked: bool = False
    formats: list = field(default_factory=list)
    """(--data entry, detected row format) for every dataset read."""

    def summary(self) -> str:
        tokens = "" if self.tokens_checked else " (lengths not checked: pass --model)"
        lines = [f"format: {spec}: {fmt}" for spec, fmt in self.formats]
        return "\n".join(
            lines + [f"{len(self.kept)} rows usable, {len(self.errors)} errors, {len(self.warnings)} warnings{tokens}"]
        )


def validate_data(specs: list, args: DataArgs, tokenizer=None, seed: int = 42, task: str = "sft") -> ValidationReport:
    """Check datasets the way a run reads them, listing every problem instead of stopping.

    With a tokenizer the rows are also encoded (SFT rows through the data cache, as a run
    encodes them): a row with no assistant token left after cutting to args.max_length is an
    error, a row that is cut is a warning.
    """
    if tokenizer is None or task != "sft":
        report, samples = read_for_validation(specs, args, seed, task)
        report.tokens_checked = tokenizer is not None
        report.kept = [s.origin for s in samples]
        encoded = encode_as_training(tokenizer, samples, args, task) if tokenizer else None
        return finish_validation(report, encoded, args.max_length)
    from .cache import cached_encoding, problems_from_json, problems_json

    def build(stream):
        read, fills = (ValidationReport(), {"model_name": args.model_name, "model_author": args.model_author})
        numbers = [
            number
            for loaded in _read_each(specs, read, lambda spec: stream.read_spec(spec, args.format, seed, fills))
            for number in loaded.numbers
        ]
        return {"all": stream.report(numbers, "all")}, {
            "errors": problems_json(read.errors),
            "warnings": problems_json(read.warnings),
            "formats": read.formats,
        }

    reports, extra, _ = cached_encoding("validate", specs, args, tokenizer, seed, task, encode_settings(args), build)
    report = ValidationReport(
        errors=problems_from_json(extra["errors"]),
        warnings=problems_from_json(extra["warnings"]),
        tokens_checked=True,
        formats=[tuple(f) for f in extra["formats"]],
    )
    return finish_validation(report, reports["all"], args.max_length)


def read_for_validation(specs: list, args: DataArgs, seed: int, task: str) -> tuple[ValidationReport, list]:
    """Every spec read on its own: a dataset that cannot be read is one error, not a stop."""
    report = ValidationReport()
    samples = [
        sample
        for loaded in _read_each(specs, report, lambda spec: load_samples([spec], args, seed, task))
        for sample in loaded.samples
    ]
    return report, samples


def _read_each(specs: list, report: ValidationReport, read):
    """read(spec) for each spec, its problems, warnings and formats added to `report`; a spec
    that cannot be read is one error in `report`, not a stop (it yields nothing)."""
    for spec in specs:
        try:
            loaded = read(spec)
        except DataError as exc:
            report.errors.append(Problem(spec, str(exc)))
            report.formats.append((spec, "not read (error above)"))
            continue
        report.errors += loaded.problems
        report.warnings += loaded.warnings
        report.formats += loaded.formats
        yield loaded


def finish_validation(report: ValidationReport, encoded: EncodeReport | None, max_length: int) -> ValidationReport:
    """The kept rows, encode problems and cut rows of `encoded` added; everything sorted."""
    if encoded is not None:
        from .arrow import ArrowSamples

        if isinstance(encoded.samples, ArrowSamples):
            origin, origins = encoded.samples.origins()
        else:
            origin = [s.origin for s in encoded.samples]
            origins = [s.origins for s in encoded.samples]
        chats = [o for o, many in zip(origin, origins) if many is None]
        documents = [o for many in origins if many is not None for o in many]
        report.kept = chats + list(dict.fromkeys(documents))  # a document may span two rows
        report.errors += encoded.problems
        report.warnings += [
            Problem(o, f"cut to --max-length {max_length}; the end of the conversation is not trained on")
            for o in encoded.truncated
        ]
    report.errors.sort(key=lambda p: origin_sort_key(p.origin))
    report.warnings.sort(key=lambda p: origin_sort_key(p.origin))
    return report


def origin_sort_key(origin: str) -> tuple:
    """ "a.jsonl:10" after "a.jsonl:9"; dataset-level problems (no line) first."""
    match = re.fullmatch(r"(.*?)(?::(\d+)|\[(?:row )?(\d+)\])", origin)
    if not match:
        return origin, -1
    return match.group(1), int(match.group(2) or match.group(3))
