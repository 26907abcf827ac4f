"""The `lora-lab` command: click commands only, each a thin layer over the Python API.

Commands are grouped by stage: training (run, plan, presets, demo), data (data validate, stats,
encode, preview), serving (merge, export, chat, infer, eval, report, ui). Nothing here imports
torch at import time, so `lora-lab plan` stays instant.
"""

from __future__ import annotations

import logging
import sys
import warnings

import click

from ..errors import LoraLabError, RunStopped


class _Group(click.Group):
    """Turns LoraLabError into one clean message and exit status 2 (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RunStopped as exc:
            click.secho(str(exc), fg="yellow", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:  # before training started (in training: RunStopped)
            click.secho("interrupted", fg="yellow", err=True)
            sys.exit(130)
        except LoraLabError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="lora-lab")
def main():
    """LoRA fine-tuning of Qwen2.5 on one consumer GPU (or a CPU, for small runs)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # bitsandbytes logs a warning about an optional CPU kernel package at import; not actionable.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # httpx (httpx2 under huggingface_hub 2) logs every request to the hub at INFO; the hub's
    # own progress bars say enough.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # peft asks transformers' deprecated is_gradient_checkpointing on every model it wraps; the
    # FutureWarning is addressed to peft, not to whoever runs lora-lab.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


from . import data, serving, training  # noqa: E402  (the commands, registered below)
from .options import run_config  # noqa: E402

for command in (
    training.run,
    training.plan,
    training.presets,
    training.demo,
    data.data,
    serving.merge,
    serving.export,
    serving.chat,
    serving.infer,
    serving.evaluate,
    serving.check,
    serving.report,
    serving.ui,
    serving.serve,
):
    main.add_command(command)

__all__ = ["main", "run_config"]
