"""Training commands: run, plan, presets, demo."""

from __future__ import annotations

import sys

import click

from ..config import PLANNED_MODEL, list_presets, resolve_config
from ..errors import LoraLabError
from ..log import get_logger
from .options import given_flags, run_config, run_options

log = get_logger()


@click.command()
@click.option(
    "--preset",
    default="cpu",
    show_default=True,
    help="Hardware tier (lora-lab presets), or auto to pick it from this GPU.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(),
    help="YAML file with model:, lora:, "
    "data:, train: sections (or a run's saved config.yaml); applied after the preset.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any config key, e.g. --set train.weight_decay=0.01. Applied last.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="With --gpus/--engine: write the launch files "
    "(accelerate + DeepSpeed/FSDP configs) and print the command and per-GPU memory "
    "plan, without training or checking this machine's GPUs.",
)
@click.option(
    "--show-config",
    "-v",
    is_flag=True,
    help="Print every resolved setting, defaults included (the run folder's config.yaml holds them all).",
)
@run_options
def run(preset, config_file, sets, dry_run, show_config, **flag_values):
    """Fine-tune a model with LoRA and write a run folder (--gpus N: N processes)."""
    from .. import train
    from ..run_folder.names import CONFIG_FILE
    from ..training.launch import dry_run_launch, needs_launch

    config = run_config(preset, config_file, sets, flag_values)
    if show_config:
        log.info(f"resolved config (preset {config.preset}):\n{config.describe()}")
    else:
        log.info(
            f"settings that differ from the defaults (preset {config.preset}; every setting: --show-config, "
            f"and {CONFIG_FILE} in the run folder):\n{config.describe(changed_only=True)}"
        )
    if dry_run:
        if not needs_launch(config):
            raise click.UsageError(
                "--dry-run shows a multi-process launch: add --gpus N (and "
                "--engine); for one GPU, `lora-lab plan` shows the memory."
            )
        dry_run_launch(config)
        return
    result = train(config)
    log.info(
        f"\ndone: {result.global_step} steps, train loss {result.train_loss:.4f}"
        + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
        + (
            f"\nadapter: {result.adapter_dir}"
            if result.adapter_dir
            else f"\nmodel (from_pretrained): {result.model_dir}"
        )
        + f"\nrun folder: {result.run_dir}"
    )
    if result.benchmark:  # --eval-tasks
        from ..use.benchmarks import report_lines

        click.echo("\n".join(report_lines(result.benchmark)))


@click.command()
@click.option(
    "--preset",
    default="auto",
    show_default=True,
    help="Hardware tier, or auto to pick it from --gpu-memory (or this GPU).",
)
@click.option(
    "--gpu-memory",
    type=float,
    help="GPU memory in GiB (default: this machine's GPU, else the preset's card: 16 for 16gb).",
)
@click.option(
    "--cpu-memory",
    type=float,
    help="The machine's RAM in GiB, which a one-GPU run's host memory is planned against (default: this machine's).",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@run_options
def plan(preset, gpu_memory, cpu_memory, sets, **flag_values):
    """Predict the peak GPU memory and host RAM of a run, broken down, and whether they fit. No
    GPU needed. Takes the flags of `lora-lab run`; --data plans with the data's real longest
    sample."""
    from .. import choose_preset
    from .. import plan as plan_run
    from ..device import gpu_memory_gib, host_memory_gib
    from ..planning.memory import row_length

    gpu_memory = gpu_memory or gpu_memory_gib()
    if preset == "auto" and gpu_memory is None:
        raise LoraLabError("--preset auto needs a GPU to look at, or --gpu-memory GIB.")
    flags = {"model.name": PLANNED_MODEL, **given_flags(flag_values)}
    config = resolve_config(choose_preset(preset, gpu_memory), flags=flags, sets=sets, need_data=False)
    if config.data.packing:
        why = (
            f"data.pack_length {config.data.pack_length}"
            if config.data.pack_length
            else f"--max-length {config.data.max_length} x --micro-batch-size {config.train.micro_batch_size}"
        )
        log.info(
            f"packing ({config.sources.get('data.packing', 'default')}): the samples of a "
            f"step share rows of {row_length(config)} tokens ({why}); the plan is for such "
            f"a row. --set data.packing=false plans one sample of --max-length a row."
        )
    if cpu_memory is not None and cpu_memory <= 0:
        raise click.BadParameter(f"{cpu_memory}: give the machine's RAM in GiB, e.g. 64.", param_hint="--cpu-memory")
    ram = cpu_memory or host_memory_gib()
    result = plan_run(config, gpu_memory, _longest_sample(config) if config.data.datasets else None, ram)
    click.echo(result.report())
    if result.fits is False or result.cpu_fits is False:
        sys.exit(1)


def _longest_sample(config) -> int:
    from ..data import prepare_data
    from ..data.arrow import sample_lengths
    from ..use.data_check import counting_tokenizer

    tokenizer, source = counting_tokenizer(config.model.name)
    click.echo(source)
    prepared = prepare_data(config.data, tokenizer, config.train.seed, config.train.task)  # as the run reads it
    longest = max(sample_lengths(prepared.train.samples))
    what = "prompt" if config.train.task == "grpo" else "sample"
    click.echo(f"longest encoded {what} in the data: {longest} tokens")
    return longest


@click.command()
def presets():
    """List the presets with a one-line summary."""
    for preset in list_presets():  # cpu, then the cards by size
        click.echo(f"{preset['name']:<8} {preset['description']}")


@click.command()
@click.option("--output-dir", default="output", show_default=True)
@click.option("--name", default="Aurora", show_default=True, help="The new identity's name.")
@click.option("--author", default="Lora Lab", show_default=True)
@click.option("--max-steps", default=30, show_default=True, type=int)
@click.option("--fetch-only", is_flag=True, help="Only download and convert the demo model.")
def demo(output_dir, name, author, max_steps, fetch_only):
    """Teach the real Qwen2.5-Coder-0.5B-Instruct a new identity on CPU, before/after."""
    from ..demo import fetch_demo_model, run_demo

    if fetch_only:
        click.echo(fetch_demo_model())
        return
    run_demo(output_dir, name, author, max_steps)
