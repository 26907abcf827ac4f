"""The `lora-lab` command: click commands only, each a thin layer over the Python API."""
from __future__ import annotations

import json
import logging
import sys

import click

from .config import FLAGS, field_help, list_presets, resolve_config
from .errors import LoraLabError


class _Group(click.Group):
    """Turns LoraLabError into one clean message and exit status 2 (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LoraLabError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="lora-lab")
def main():
    """LoRA fine-tuning of Qwen2.5 on one consumer GPU (or a CPU, for small runs)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def run_options(func):
    """One option per entry of config.FLAGS; values stay text and are checked by the config."""
    for flag, key in reversed(FLAGS.items()):
        help_text = f"{field_help(key)} [{key}]"
        if "/" in flag:
            func = click.option(flag, key.replace(".", "__"), default=None, help=help_text)(func)
        elif key == "model.trust_remote_code":
            func = click.option(flag, key.replace(".", "__"), is_flag=True, default=None,
                                help=help_text)(func)
        elif key in ("data.datasets", "data.val_data"):
            func = click.option(flag, key.replace(".", "__"), multiple=True,
                                help=help_text + " Repeat to mix datasets.")(func)
        else:
            func = click.option(flag, key.replace(".", "__"), help=help_text)(func)
    return func


@main.command()
@click.option("--preset", default="cpu", show_default=True, help="Hardware tier (lora-lab presets).")
@click.option("--config", "config_file", type=click.Path(), help="YAML file with model:, lora:, "
              "data:, train: sections; applied after the preset.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Any config key, e.g. --set train.weight_decay=0.01. Applied last.")
@run_options
def run(preset, config_file, sets, **flag_values):
    """Fine-tune a model with LoRA and write a run folder."""
    from .train import train

    flags = {k.replace("__", "."): (list(v) if isinstance(v, tuple) else v)
             for k, v in flag_values.items() if v not in (None, ())}
    config = resolve_config(preset, config_file, flags, sets)
    click.echo(f"resolved config (preset {preset}):\n{config.describe()}")
    result = train(config, echo=click.echo)
    click.echo(f"\ndone: {result.global_step} steps, train loss {result.train_loss:.4f}"
               + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
               + f"\nadapter: {result.adapter_dir}\nrun folder: {result.run_dir}")


@main.command()
def presets():
    """List the presets with a one-line summary."""
    for preset in list_presets():
        click.echo(f"{preset['name']:<8} {preset['description']}")


@main.command()
@click.option("--output-dir", default="output", show_default=True)
@click.option("--name", default="Aurora", show_default=True, help="The new identity's name.")
@click.option("--author", default="Lora Lab", show_default=True)
@click.option("--max-steps", default=30, show_default=True, type=int)
@click.option("--fetch-only", is_flag=True, help="Only download and convert the demo model.")
def demo(output_dir, name, author, max_steps, fetch_only):
    """Teach the real Qwen2.5-Coder-0.5B-Instruct a new identity on CPU, before/after."""
    from .demo import fetch_demo_model, run_demo

    if fetch_only:
        click.echo(fetch_demo_model(echo=click.echo))
        return
    run_demo(output_dir, name, author, max_steps, echo=click.echo)


@main.group()
def data():
    """Inspect datasets: encode, preview."""


def data_options(func):
    func = click.option("--model", "model", default="qwen2.5-0.5b", show_default=True,
                        help="Model whose tokenizer and chat template encode the data.")(func)
    func = click.option("--max-length", default="2048", show_default=True)(func)
    func = click.option("--format", "row_format", default="auto", show_default=True)(func)
    func = click.option("--model-name", default=None)(func)
    func = click.option("--model-author", default=None)(func)
    return click.argument("datasets", nargs=-1, required=True)(func)


def _encode(datasets, model, max_length, row_format, model_name, model_author):
    from .data import prepare_data
    from .model import load_tokenizer

    config = resolve_config("cpu", flags={
        "data.datasets": list(datasets), "model.name": model, "data.max_length": max_length,
        "data.format": row_format, "data.model_name": model_name,
        "data.model_author": model_author})
    tokenizer = load_tokenizer(config.model.name)
    return tokenizer, prepare_data(config.data, tokenizer)


@data.command("encode")
@data_options
@click.option("--output", required=True, type=click.Path(), help="JSONL file to write.")
def data_encode(datasets, model, max_length, row_format, model_name, model_author, output):
    """Write every encoded sample (input_ids, labels) as JSONL."""
    _, prepared = _encode(datasets, model, max_length, row_format, model_name, model_author)
    with open(output, "w") as handle:
        for sample in prepared.train.samples:
            handle.write(json.dumps({"origin": sample.origin, "input_ids": sample.input_ids,
                                     "labels": sample.labels}) + "\n")
    click.echo(prepared.summary(int(max_length)))
    for problem in prepared.all_problems():
        click.echo(f"  not used: {problem}")
    click.echo(f"wrote {output}")


@data.command("preview")
@data_options
@click.option("--index", default=0, show_default=True, type=int, help="Which sample to show.")
def data_preview(datasets, model, max_length, row_format, model_name, model_author, index):
    """Print one encoded sample with the trained spans marked [[like this]]."""
    from .data.encode import show_trained_spans

    tokenizer, prepared = _encode(datasets, model, max_length, row_format, model_name,
                                  model_author)
    samples = prepared.train.samples
    if not 0 <= index < len(samples):
        raise LoraLabError(f"--index {index}: the data has {len(samples)} usable samples.")
    sample = samples[index]
    click.echo(f"{sample.origin}: {len(sample.input_ids)} tokens, {sample.trained_tokens} "
               f"trained (inside [[ ]])\n")
    click.echo(show_trained_spans(tokenizer, sample))


if __name__ == "__main__":
    main()
