"""Watching a run: lora-lab's own figures in every step-log event, the progress line, and the
--report-to backends (transformers' own callbacks), writing inside the run folder.

Every training log event (the Trainer's loss, grad_norm, learning_rate, epoch) gains
  tokens_per_second      tokens of the batches (padding left out) over the wall time since the
                         first micro-batch after the previous event, over every process
  gpu_memory_gib         torch.cuda's reserved memory now, and gpu_peak_memory_gib its peak so
                         far (GiB; a CUDA run only)
  skipped_steps          updates skipped so far for a NaN or inf (--on-nonfinite skip)
before the Trainer hands it to logs/train_log.jsonl, TensorBoard and the --report-to backends.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from ..log import get_logger
from ..run_folder import tracker_locations
from .callbacks import cuda_memory_gib

log = get_logger()

TIMING_KEYS = ("tokens_per_second", "gpu_memory_gib", "gpu_peak_memory_gib")
"""Step-log keys that measure this machine, not the training (they differ between two runs of
the same steps)."""
PROJECT = "lora-lab"
"""The wandb / mlflow / swanlab project (experiment) runs go to unless the environment names one."""


class StepMetrics:
    """Counts the tokens of every micro-batch (LoraLabTrainer.training_step) and gives the
    figures added to each training log event."""

    def __init__(self, guard):
        self.guard = guard
        self._tokens = 0  # a tensor on the batch's device once counting starts (no host sync)
        self._since: float | None = None
        self._aux: list = []  # a mixture of experts' load-balancing losses (tensors, no host sync)

    def note_aux_loss(self, value) -> None:
        self._aux.append(value.detach())

    def note_batch(self, inputs) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        if mask is not None and mask.dim() == 2:
            self._tokens = self._tokens + mask.sum()
        elif hasattr(inputs, "get") and inputs.get("input_ids") is not None:
            self._tokens = self._tokens + inputs["input_ids"].numel()  # packed rows: no padding
        elif hasattr(inputs, "get") and inputs.get("completion_mask") is not None:  # grpo: prompt + completion
            self._tokens = self._tokens + inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()

    def take(self, reduce_sum=None) -> dict:
        """The figures since the previous call; reduce_sum adds a count over every process."""
        import torch

        figures = {}
        if self._since is not None:
            tokens = torch.as_tensor(self._tokens)
            total = float(reduce_sum(tokens) if reduce_sum else tokens)
            seconds = time.perf_counter() - self._since
            if seconds > 0:
                figures["tokens_per_second"] = round(total / seconds, 1)
        self._tokens, self._since = 0, None
        for key, name in (("gpu_memory_gib", "memory_reserved"), ("gpu_peak_memory_gib", "max_memory_reserved")):
            gib = cuda_memory_gib(name)
            if gib is not None:
                figures[key] = round(gib, 3)
        if self._aux:
            figures["aux_loss"] = round(float(torch.stack(self._aux).float().mean()), 6)
            self._aux = []
        figures["skipped_steps"] = len(self.guard.skipped_steps)
        return figures


# ----------------------------------------------------------------------------- the progress line


def format_lr(lr: float) -> str:
    """2.0e-4 (two significant digits, no padded exponent)."""
    if lr == 0:
        return "0"
    exponent = math.floor(math.log10(abs(lr)))
    mantissa = lr / 10**exponent
    if round(mantissa, 1) >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.1f}e{exponent}"


def format_duration(seconds: float) -> str:
    """45s, 3m 10s, 2h 05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def progress_fields(step: int, total: int, figures: dict, eta_seconds: float | None) -> list[str]:
    """The progress line's parts: step / total, loss, lr, grad norm, tok/s, ETA, GPU, skips."""
    parts = [f"step {step}/{total}"]
    if figures.get("loss") is not None:
        parts.append(f"loss {figures['loss']:.3f}")
    if figures.get("reward") is not None:  # grpo: the mean weighted reward of the step's completions
        parts.append(f"reward {figures['reward']:.3f}")
    if figures.get("learning_rate") is not None:
        parts.append(f"lr {format_lr(figures['learning_rate'])}")
    if figures.get("grad_norm") is not None:
        parts.append(f"grad norm {figures['grad_norm']:.3g}")
    if figures.get("tokens_per_second") is not None:
        parts.append(f"{figures['tokens_per_second']:,.0f} tok/s")
    if eta_seconds is not None:
        parts.append(f"ETA {format_duration(eta_seconds)}")
    if figures.get("gpu_peak_memory_gib") is not None:
        parts.append(f"GPU {figures['gpu_peak_memory_gib']:.1f} GiB")
    if figures.get("skipped_steps"):
        parts.append(f"{figures['skipped_steps']} skipped")
    return parts


class ProgressLine(TrainerCallback):
    """What a run says while it trains, in place of the Trainer's tqdm bar and printed dicts.

    On a terminal (stderr is a tty) one line, rewritten after every optimizer step. Otherwise (CI,
    nohup, a pipe) a plain line at every log event (train.logging_steps), without escape codes.
    Evaluations get a line of their own either way. Only the main process speaks."""

    SEPARATOR = " · "

    def __init__(self, stream=None):
        self._stream = stream
        self.latest: dict = {}
        self._started, self._first_step, self._drawn, self._ended = None, 0, False, False

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    def interactive(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, state) -> str:
        eta = None
        done = state.global_step - self._first_step
        if self._started is not None and done > 0 and state.max_steps:
            per_step = (time.monotonic() - self._started) / done
            eta = per_step * max(state.max_steps - state.global_step, 0)
        parts = progress_fields(state.global_step, state.max_steps, self.latest, eta)
        return self.SEPARATOR.join(parts)

    def _say(self, text: str) -> None:
        """A line of its own, under the in-place line (which stays as it was, and is drawn
        afresh below at the next step)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        log.info(text)

    def on_train_begin(self, args, state, control, **kwargs):
        self._started, self._first_step = time.monotonic(), state.global_step
        self._ended = False

    def _draw(self, state) -> None:
        self.stream.write("\r" + self.line(state) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.interactive():
            self._draw(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        if "loss" in logs:
            self.latest.update(logs)
            if self.interactive():
                self._draw(state)  # the step's own figures (the log follows its step's end)
            else:
                self._say(self.line(state))
        elif "eval_loss" in logs:
            final = "final " if self._ended else ""  # run.py evaluates once more at the end
            self._say(
                f"step {state.global_step}/{state.max_steps}{self.SEPARATOR}{final}eval loss {logs['eval_loss']:.3f}"
            )

    def on_train_end(self, args, state, control, **kwargs):
        self._ended = True
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# ----------------------------------------------------------------------------- --report-to


def trainer_report_to(names: list) -> list[str]:
    """TrainingArguments.report_to: the backends the Trainer adds callbacks for. TensorBoard is
    lora-lab's own TensorBoardCallback (callbacks.run_callbacks), pointed at RUN/logs."""
    return [n for n in names if n not in ("tensorboard", "none")]


def tracker_defaults(run_dir: Path, names: list) -> dict[str, str]:
    """The environment the chosen backends read, where the user has not set it: each writes in
    the run folder, into the lora-lab project."""
    locations = tracker_locations(run_dir)
    wanted = {
        "wandb": {"WANDB_DIR": locations["WANDB_DIR"], "WANDB_PROJECT": PROJECT},
        "mlflow": {"MLFLOW_TRACKING_URI": locations["MLFLOW_TRACKING_URI"], "MLFLOW_EXPERIMENT_NAME": PROJECT},
        "swanlab": {"SWANLAB_LOG_DIR": locations["SWANLAB_LOG_DIR"]},
    }
    return {key: value for name in names for key, value in wanted.get(name, {}).items() if key not in os.environ}


@contextlib.contextmanager
def tracker_runs(run_dir: Path, names: list, is_main_process: bool = True):
    """The --report-to backends' environment while the run trains and is evaluated, and one
    tracker run per lora-lab run, named after the run folder: mlflow's and swanlab's runs are
    opened here, the Trainer's callbacks log into them (MLflowCallback would end its own run at
    the end of training, before the final evaluation; SwanLabCallback's test for an open run
    raises with swanlab >= 0.10), and every backend's run is closed when the run is done."""
    defaults = tracker_defaults(run_dir, names)
    os.environ.update(defaults)
    try:
        if "mlflow" in names and is_main_process:
            import mlflow

            mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
            mlflow.start_run(run_name=Path(run_dir).name)
        if "swanlab" in names and is_main_process:
            import swanlab

            # the project as an argument: swanlab >= 0.10 reads SWANLAB_PROJECT as JSON
            swanlab.init(project=PROJECT, experiment_name=Path(run_dir).name, logdir=os.environ["SWANLAB_LOG_DIR"])
        yield
    finally:
        if is_main_process:
            finish_trackers(names)
        for key in defaults:
            os.environ.pop(key, None)


def finish_trackers(names: list) -> None:
    """Close the backends' runs, so that their files are complete when train() returns."""
    if "wandb" in names and "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish()
    if "swanlab" in names and "swanlab" in sys.modules:
        with contextlib.suppress(RuntimeError):  # swanlab >= 0.10: no open run raises
            if sys.modules["swanlab"].get_run() is not None:
                sys.modules["swanlab"].finish()
    if "mlflow" in names and "mlflow" in sys.modules and sys.modules["mlflow"].active_run():
        sys.modules["mlflow"].end_run()
