"""--report-to checks, the progress line on a terminal and off it, and the plots of a step log."""

import io
import json
import sys

import pytest
import yaml
from click.testing import CliRunner
from transformers import TrainerControl, TrainerState, TrainingArguments

from lora_lab.cli import main
from lora_lab.config import resolve_config
from lora_lab.errors import ConfigError
from lora_lab.training.plots import PLOTS, report_run
from lora_lab.training.watch import ProgressLine, format_duration, format_lr


def resolve(report_to):
    return resolve_config("cpu", flags={"data.datasets": ["d.jsonl"], "train.report_to": report_to})


def test_report_to_takes_comma_separated_names_and_defaults_to_tensorboard():
    assert resolve_config("cpu", flags={"data.datasets": ["d.jsonl"]}).train.report_to == ["tensorboard"]
    assert resolve("tensorboard, wandb").train.report_to == ["tensorboard", "wandb"]
    assert resolve_config(
        "cpu", flags={"data.datasets": ["d.jsonl"]}, sets=["train.report_to=none"]
    ).train.report_to == ["none"]


def test_an_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        resolve("tensorboard,wandbb")
    assert str(error.value).splitlines()[1] == (
        "  - --report-to tensorboard,wandbb: unknown backend 'wandbb'; the valid ones are "
        "tensorboard, wandb, mlflow, swanlab, none."
    )


def test_none_goes_alone():
    with pytest.raises(ConfigError, match="none turns every backend off"):
        resolve("none,tensorboard")


def test_a_backend_not_installed_fails_at_config_time_with_the_pip_command(monkeypatch):
    for name in ("wandb", "swanlab"):
        monkeypatch.setitem(sys.modules, name, None)  # what an absent package looks like
    with pytest.raises(ConfigError) as error:
        resolve("wandb,swanlab")
    assert "wandb and swanlab are not installed. Run: pip install wandb swanlab" in str(error.value)
    result = CliRunner().invoke(main, ["run", "--data", "d.jsonl", "--report-to", "wandb"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--report-to wandb: wandb is not installed. Run: pip install wandb" in result.output


def test_numbers_read_at_a_glance():
    assert [format_lr(x) for x in (2e-4, 1e-2, 9.96e-5, 0.0)] == ["2.0e-4", "1.0e-2", "1.0e-4", "0"]
    assert [format_duration(s) for s in (7, 190, 7500)] == ["7s", "3m 10s", "2h 05m"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def drive(stream, steps=3):
    """The Trainer's callback order for `steps` steps, a log event at each, one evaluation."""
    line = ProgressLine(stream)
    args, control = TrainingArguments(output_dir="unused", report_to="none"), TrainerControl()
    state = TrainerState(max_steps=steps)
    line.on_train_begin(args, state, control)
    for step in range(1, steps + 1):
        state.global_step = step
        line.on_step_end(args, state, control)
        line.on_log(
            args,
            state,
            control,
            logs={
                "loss": 2.0 / step,
                "learning_rate": 2e-4,
                "grad_norm": 0.5,
                "tokens_per_second": 1234.0,
                "gpu_peak_memory_gib": 5.12,
                "skipped_steps": 0,
            },
        )
    line.on_log(args, state, control, logs={"eval_loss": 1.5})
    line.on_train_end(args, state, control)
    line.on_log(args, state, control, logs={"eval_loss": 1.25})  # run.py's final evaluation
    return stream.getvalue()


def test_on_a_terminal_one_line_is_rewritten_in_place(capsys):
    text = drive(Terminal())
    frames = text.split("\r")
    assert frames[0] == "" and len(frames) == 7  # drawn at each step's end and its log event
    assert frames[1] == "step 1/3 · ETA 0s\x1b[K"  # the step's log event comes after its end
    assert frames[2].startswith("step 1/3 · loss 2.000 · ") and frames[2].endswith("\x1b[K")
    assert frames[6] == (
        "step 3/3 · loss 0.667 · lr 2.0e-4 · grad norm 0.5 · 1,234 tok/s · ETA 0s · GPU 5.1 GiB\x1b[K\n"
    )  # kept, ended before the eval line
    assert capsys.readouterr().out == ("step 3/3 · eval loss 1.500\nstep 3/3 · final eval loss 1.250\n")


def test_without_a_terminal_each_log_event_is_a_plain_line(capsys):
    assert drive(io.StringIO()) == ""  # nothing drawn on the stream
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("step 1/3 · loss 2.000 · lr 2.0e-4 · grad norm 0.5 · 1,234 tok/s · ETA 0s · GPU 5.1 GiB")
    assert lines[1:] == [
        "step 2/3 · loss 1.000 · lr 2.0e-4 · grad norm 0.5 · 1,234 tok/s · ETA 0s · GPU 5.1 GiB",
        "step 3/3 · loss 0.667 · lr 2.0e-4 · grad norm 0.5 · 1,234 tok/s · ETA 0s · GPU 5.1 GiB",
        "step 3/3 · eval loss 1.500",
        "step 3/3 · final eval loss 1.250",
    ]


def write_run(folder, events):
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": {}}))
    (folder / "logs").mkdir()
    (folder / "logs" / "train_log.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events) + '{"step": 9, "lo'
    )  # cut short: a kill


def test_plots_draw_the_log_and_leave_out_series_without_data(tmp_path):
    events = [
        {
            "step": s,
            "loss": 3.0 - s / 10,
            "learning_rate": 1e-4,
            "grad_norm": 1.0 + s,
            "tokens_per_second": 100.0 * s,
            "gpu_memory_gib": 4.0,
            "gpu_peak_memory_gib": 4.5,
        }
        for s in (1, 2, 3)
    ]
    write_run(tmp_path / "gpu-run", events)
    report = report_run(tmp_path / "gpu-run")
    assert [p.name for p in report.files] == [p.file for p in PLOTS]
    assert report.series["gpu_peak_memory_gib"] == ([1, 2, 3], [4.5, 4.5, 4.5])
    assert report.series["tokens_per_second"] == ([1, 2, 3], [100.0, 200.0, 300.0])
    assert report.notes == [
        "the eval curve of loss.png: no eval loss in the log (no validation data: --val-ratio or --val-data)"
    ]
    assert report.titles["loss.png"] == "train loss"  # a title names only the curves drawn
    assert report.titles["gpu_memory.png"] == "GPU memory"


def test_the_loss_plot_names_the_eval_curve_when_it_draws_one(tmp_path):
    events = [{"step": s, "loss": 3.0 - s / 10} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 2.9}]
    write_run(tmp_path / "run", events)
    assert report_run(tmp_path / "run").titles["loss.png"] == "train and eval loss"


def test_a_run_without_a_logged_step_says_so(tmp_path):
    write_run(tmp_path / "new", [])
    with pytest.raises(Exception, match="no training step logged yet"):
        report_run(tmp_path / "new")


def test_report_to_none_leaves_only_the_step_log(tmp_path):
    from transformers.integrations import TensorBoardCallback

    from lora_lab.training.callbacks import JsonlLog, run_callbacks
    from lora_lab.training.watch import trainer_report_to

    assert trainer_report_to(["none"]) == [] and trainer_report_to(["tensorboard", "wandb", "mlflow"]) == [
        "wandb",
        "mlflow",
    ]
    kinds = lambda names: [type(c) for c in run_callbacks(tmp_path, names)]  # noqa: E731
    assert TensorBoardCallback not in kinds(["none"]) and JsonlLog in kinds(["none"])
    assert kinds(["tensorboard"])[0] is TensorBoardCallback


def test_tokens_per_second_counts_the_tokens_of_the_batches_without_padding():
    import time

    import torch

    from lora_lab.training.watch import StepMetrics

    class Guard:
        skipped_steps = [3]

    metrics = StepMetrics(Guard())
    started = time.perf_counter()
    metrics.note_batch(
        {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    )
    time.sleep(0.2)
    figures = metrics.take()
    elapsed = time.perf_counter() - started
    # (figures are rounded to 0.1 tokens/s)
    assert 7 / elapsed - 0.05 <= figures["tokens_per_second"] <= 7 / 0.2  # with padding: > 40
    assert figures["skipped_steps"] == 1 and "gpu_memory_gib" not in figures  # no CUDA here
    assert "tokens_per_second" not in metrics.take()  # no batch since: no figure
    started = time.perf_counter()
    metrics.note_batch({"input_ids": torch.ones(1, 10, dtype=torch.long)})  # a packed row
    time.sleep(0.2)
    packed = metrics.take()["tokens_per_second"]
    assert 10 / (time.perf_counter() - started) - 0.05 <= packed <= 10 / 0.2 + 0.05
