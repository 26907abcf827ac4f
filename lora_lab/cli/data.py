"""Data commands: `lora-lab data validate`, `stats`, `encode`, `preview`."""

from __future__ import annotations

import json

import click

from ..errors import DataError, LoraLabError
from .options import data_options, echo_lines


@click.group()
def data():
    """Inspect datasets: validate, stats, encode, preview."""


def _data_config(datasets, model, max_length, row_format, model_name, model_author, training=False):
    """The config the `data` commands read datasets with (use.data_check.data_config), its
    note said."""
    from ..use.data_check import data_config

    config, note = data_config(
        datasets,
        model=model,
        max_length=max_length,
        row_format=row_format,
        model_name=model_name,
        model_author=model_author,
        training=training,
    )
    if note:
        click.echo(note)
    return config


def _counting_tokenizer(spec: str):
    """The tokenizer the data commands count with, saying which."""
    from ..use.data_check import counting_tokenizer

    tokenizer, source = counting_tokenizer(spec)
    click.echo(source)
    return tokenizer


def _encode(datasets, model, max_length, row_format, model_name, model_author, training):
    from ..data import prepare_data

    config = _data_config(datasets, model, max_length, row_format, model_name, model_author, training)
    tokenizer = _counting_tokenizer(config.model.name)
    return tokenizer, prepare_data(config.data, tokenizer)


@data.command("stats")
@data_options
def data_stats(datasets, model, max_length, row_format, model_name, model_author):
    """Token length distribution with the real chat template, and a max_length to use."""
    from ..data.stats import dataset_length_stats

    config = _data_config(datasets, model, max_length, row_format, model_name, model_author)
    stats, read = dataset_length_stats(
        config.data.datasets, config.data, _counting_tokenizer(config.model.name), config.train.seed
    )
    click.echo("\n".join(f"format: {spec}: {fmt}" for spec, fmt in read["formats"]))
    click.echo(stats.table())
    if read["problems"]:
        click.echo(f"({read['problems']} rows not usable; `lora-lab data validate` lists them)")


@data.command("encode")
@data_options
@click.option("--output", required=True, type=click.Path(), help="JSONL file to write.")
def data_encode(datasets, model, max_length, row_format, model_name, model_author, output):
    """Write every encoded sample (input_ids, labels) as JSONL."""
    _, prepared = _encode(
        datasets, model, max_length, row_format, model_name, model_author, training=True
    )  # the ids written are what a run trains on
    with open(output, "w") as handle:
        for sample in prepared.train.samples:
            handle.write(
                json.dumps({"origin": sample.origin, "input_ids": sample.input_ids, "labels": sample.labels}) + "\n"
            )
    click.echo(prepared.summary(int(max_length)))
    for problem in prepared.all_problems():
        click.echo(f"  not used: {problem}")
    click.echo(f"wrote {output}")


@data.command("preview")
@data_options
@click.option("--index", default=0, show_default=True, type=int, help="Which sample to show.")
def data_preview(datasets, model, max_length, row_format, model_name, model_author, index):
    """Print one encoded sample with the trained spans marked [[like this]]."""
    from ..data.encode import show_trained_spans

    tokenizer, prepared = _encode(datasets, model, max_length, row_format, model_name, model_author, training=False)
    samples = prepared.train.samples
    if not 0 <= index < len(samples):
        raise LoraLabError(f"--index {index}: the data has {len(samples)} usable samples.")
    sample = samples[index]
    click.echo("\n".join(f"format: {spec}: {fmt}" for spec, fmt in prepared.formats))
    click.echo(f"{sample.origin}: {len(sample.input_ids)} tokens, {sample.trained_tokens} trained (inside [[ ]])\n")
    click.echo(show_trained_spans(tokenizer, sample))


@data.command("validate")
@click.argument("datasets", nargs=-1, required=True)
@click.option(
    "--model",
    default=None,
    help="Also encode with this model's chat template, checking lengths and trained tokens (default: structure only).",
)
@click.option("--max-length", default="2048", show_default=True)
@click.option("--format", "row_format", default="auto", show_default=True)
@click.option("--model-name", default=None)
@click.option("--model-author", default=None)
@click.option(
    "--strict/--no-strict",
    default=True,
    show_default=True,
    help="Exit with status 2 if any row has an error (a run would skip it).",
)
@click.option(
    "--task",
    type=click.Choice(["sft", "dpo", "orpo", "simpo", "kto"]),
    default="sft",
    show_default=True,
    help="Check the rows as this --task of `lora-lab run` reads them.",
)
def data_validate(datasets, model, max_length, row_format, model_name, model_author, strict, task):
    """Check datasets row by row; every problem as file:line and reason."""
    from ..use.data_check import check_data

    result = check_data(
        list(datasets),
        model=model,
        max_length=max_length,
        row_format=row_format,
        model_name=model_name,
        model_author=model_author,
        task=task,
    )
    echo_lines(result.lines())
    if result.report.errors and strict:
        raise DataError(
            f"{len(result.report.errors)} error(s) listed above; a run would skip those "
            f"rows. Fix them, or pass --no-strict to only report."
        )
