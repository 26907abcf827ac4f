"""Options shared by several commands, and how a result's lines are printed."""

from __future__ import annotations

import click

from ..config import FLAGS, field_help, resolve_config


def run_options(func):
    """One option per entry of config.FLAGS; values stay text and are checked by the config."""
    for flag, key in reversed(FLAGS.items()):
        help_text = f"{field_help(key)} [{key}]"
        if "/" in flag:
            func = click.option(flag, key.replace(".", "__"), default=None, help=help_text)(func)
        elif key in ("model.trust_remote_code", "train.allow_config_change"):
            func = click.option(flag, key.replace(".", "__"), is_flag=True, default=None, help=help_text)(func)
        elif key in ("data.datasets", "data.val_data", "grpo.rewards"):
            more = " Repeat to mix datasets." if key.startswith("data.") else ""
            func = click.option(flag, key.replace(".", "__"), multiple=True, help=help_text + more)(func)
        else:
            func = click.option(flag, key.replace(".", "__"), help=help_text)(func)
    return func


def given_flags(flag_values) -> dict:
    """The run_options a user gave, as config keys (`--data a --data b` -> a list)."""
    return {
        k.replace("__", "."): (list(v) if isinstance(v, tuple) else v)
        for k, v in flag_values.items()
        if v not in (None, ())
    }


def run_config(preset, config_file, sets, flag_values):
    """The RunConfig `lora-lab run` trains with, from its parsed options (nothing loaded)."""
    from .. import choose_preset

    return resolve_config(choose_preset(preset), config_file, given_flags(flag_values), sets)


def data_options(func):
    func = click.option(
        "--model",
        "model",
        default="qwen2.5-0.5b",
        show_default=True,
        help="Model whose tokenizer and chat template encode the data.",
    )(func)
    func = click.option("--max-length", default="2048", show_default=True)(func)
    func = click.option("--format", "row_format", default="auto", show_default=True)(func)
    func = click.option("--model-name", default=None)(func)
    func = click.option("--model-author", default=None)(func)
    return click.argument("datasets", nargs=-1, required=True)(func)


def source_options(func):
    func = click.option(
        "--run", "run_dir", type=click.Path(exists=True), help="Run folder (its adapter on its base model)."
    )(func)
    func = click.option("--adapter", type=click.Path(exists=True), help="Adapter folder.")(func)
    func = click.option("--model", help="Base or merged model (folder, hub id, alias).")(func)
    func = click.option("--dtype", default="auto", show_default=True)(func)
    func = click.option("--max-new-tokens", default=512, show_default=True, type=int)(func)
    func = click.option("--temperature", type=float, help="Default: the model's own.")(func)
    func = click.option("--top-p", type=float)(func)
    func = click.option("--top-k", type=int)(func)
    func = click.option("--repetition-penalty", type=float)(func)
    return click.option("--greedy", is_flag=True, help="Greedy decoding (no sampling).")(func)


def echo_lines(lines) -> None:
    """A result's lines, a `warning:` line in yellow."""
    for line in lines:
        if line.startswith("warning: "):
            click.secho(line, fg="yellow")
        else:
            click.echo(line)
