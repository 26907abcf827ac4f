"""Watching a tiny run through the real Trainer: the progress lines, lora-lab's figures in the step
log and in every --report-to backend (offline: files in the run folder, nothing sent), the plots
and `lora-lab report`."""

import importlib.util
import json
import re
import struct

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.run_folder import read_step_log
from lora_lab.training.plots import report_run, step_series
from tests.support.tiny import write_jsonl

BACKENDS = [name for name in ("wandb", "mlflow", "swanlab") if importlib.util.find_spec(name)]
ESCAPES = re.compile(r"\x1b\[|\r")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LINE = re.compile(
    r"^step (\d+)/4 · loss (\d+\.\d{3}) · lr \d\.\de-\d+ · grad norm [\d.]+ · "
    r"[\d,]+ tok/s · ETA \d+s$"
)


@pytest.fixture(scope="module")
def watched(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("watch")
    rows = [{"query": f"Question {i}?", "response": f"Answer number {i}."} for i in range(16)]
    data = write_jsonl(out / "qa.jsonl", rows)
    with pytest.MonkeyPatch.context() as patch:
        for key in (
            "WANDB_DIR",
            "WANDB_PROJECT",
            "MLFLOW_TRACKING_URI",
            "MLFLOW_EXPERIMENT_NAME",
            "SWANLAB_LOG_DIR",
            "SWANLAB_PROJECT",
            "MLFLOW_RUN_ID",
        ):
            patch.delenv(key, raising=False)
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("SWANLAB_MODE", "offline")
        result = CliRunner().invoke(
            main,
            [
                str(a)
                for a in (
                    "run",
                    "--model",
                    tiny_model_dir,
                    "--data",
                    data,
                    "--val-ratio",
                    "0.25",
                    "--max-steps",
                    4,
                    "--micro-batch-size",
                    2,
                    "--grad-accum",
                    1,
                    "--logging-steps",
                    2,
                    "--eval-steps",
                    2,
                    "--save-steps",
                    4,
                    "--lora-rank",
                    4,
                    "--output-dir",
                    out,
                    "--run-name",
                    "w",
                    "--report-to",
                    ",".join(["tensorboard", *BACKENDS]),
                )
            ],
            catch_exceptions=False,
        )
    assert result.exit_code == 0, result.output[-3000:]
    run_dir = out / "w"
    return run_dir, result.output, [e for e in read_step_log(run_dir) if "loss" in e]


def test_progress_lines_are_readable_and_plain_without_a_terminal(watched):
    _, output, steps = watched
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    progress = [LINE.match(line) for line in lines if " loss " in line and "eval" not in line]
    assert all(progress), lines
    # one line per log event (logging_steps 2, and the first step), the loss as logged
    assert [(int(m[1]), m[2]) for m in progress] == [(e["step"], f"{e['loss']:.3f}") for e in steps]
    assert [m[1] for m in progress] == ["1", "2", "4"]
    assert "step 2/4 · eval loss " in output and "step 4/4 · final eval loss " in output
    assert "GPU" not in "".join(lines)  # CPU run: no GPU memory field
    assert "{'loss'" not in output and "'grad_norm':" not in output  # no printed dicts
    escape = ESCAPES.search(output)
    assert escape is None, repr(output[escape.start() - 300 : escape.end() + 100])


def test_step_log_events_carry_tokens_per_second_and_skipped_steps(watched):
    _, _, steps = watched
    assert [e["step"] for e in steps] == [1, 2, 4]
    assert all(e["tokens_per_second"] > 0 and e["skipped_steps"] == 0 for e in steps)
    assert not any("gpu_memory_gib" in e for e in steps)  # no CUDA here


def test_tensorboard_gets_lora_labs_figures(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, steps = watched
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    scalars = events.Scalars("train/tokens_per_second")
    assert [s.step for s in scalars] == [e["step"] for e in steps]
    assert [s.value for s in scalars] == pytest.approx([e["tokens_per_second"] for e in steps])


def wandb_records(run_file):
    """The records of a .wandb file: a LevelDB-style log (a 7-byte header, then 32 KiB blocks of
    chunks: crc32, length, type 1 full / 2 first / 3 middle / 4 last), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data, offset, pending = run_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while offset + 7 <= len(data):
        room = 32768 - offset % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file) -> list[dict]:
    """The history rows of an offline wandb run file."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in wandb_records(run_file)
        if record.WhichOneof("record_type") == "history"
    ]


@pytest.mark.skipif("wandb" not in BACKENDS, reason="pip install wandb")
def test_wandb_offline_run_is_in_the_run_folder_with_lora_labs_figures(watched):
    run_dir, _, steps = watched
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    rows = [r for r in wandb_history(next(offline[0].glob("run-*.wandb"))) if "train/tokens_per_second" in r]
    assert [r["train/global_step"] for r in rows] == [e["step"] for e in steps]
    assert [r["train/tokens_per_second"] for r in rows] == [e["tokens_per_second"] for e in steps]
    assert [r["train/loss"] for r in rows] == pytest.approx([e["loss"] for e in steps])


@pytest.mark.skipif("mlflow" not in BACKENDS, reason="pip install mlflow")
def test_mlflow_run_is_in_the_run_folder_with_the_final_eval(watched):
    from mlflow import MlflowClient

    run_dir, _, steps = watched
    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lora-lab")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == ["w"]  # one run, the final evaluation included
    history = client.get_metric_history(runs[0].info.run_id, "tokens_per_second")
    assert [(m.step, m.value) for m in history] == [(e["step"], e["tokens_per_second"]) for e in steps]
    evals = [e for e in read_step_log(run_dir) if "eval_loss" in e]
    logged = client.get_metric_history(runs[0].info.run_id, "eval_loss")
    assert [m.value for m in logged] == pytest.approx([e["eval_loss"] for e in evals])
    assert len(logged) == 3  # steps 2 and 4, and the final evaluation


@pytest.mark.skipif("swanlab" not in BACKENDS, reason="pip install swanlab")
def test_swanlab_offline_run_is_in_the_run_folder(watched):
    run_dir, _, _ = watched
    runs = list((run_dir / "swanlog").glob("run-*"))
    assert len(runs) == 1
    record = next(runs[0].glob("run-*.swanlab")).read_bytes()
    assert b"tokens_per_second" in record and b"train/loss" in record


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_pngs_of_the_run_log(watched):
    run_dir, output, steps = watched
    files = {p.name for p in (run_dir / "plots").iterdir()}
    assert files == {"loss.png", "learning_rate.png", "grad_norm.png", "tokens_per_second.png"}
    assert all(png_size(run_dir / "plots" / name) == (800, 450) for name in files)
    assert "left out: gpu_memory.png: no GPU memory in the log" in output


def test_report_redraws_the_plots_from_the_log(watched):
    run_dir, _, steps = watched
    for png in (run_dir / "plots").iterdir():
        png.unlink()
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "loss.png" in result.output and "left out: gpu_memory.png" in result.output
    assert png_size(run_dir / "plots" / "loss.png") == (800, 450)
    drawn = report_run(run_dir).series
    events = read_step_log(run_dir)
    assert drawn["loss"] == ([e["step"] for e in steps], [e["loss"] for e in steps])
    assert drawn["tokens_per_second"] == step_series(events, "tokens_per_second")
    assert drawn["eval_loss"][0] == [2, 4]  # the final evaluation logs step 4 again: last wins


def test_report_of_a_folder_that_is_no_run(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a run folder (no config.yaml)" in result.output
    assert "Traceback" not in result.output


def test_on_a_terminal_the_progress_line_is_rewritten_in_place(tiny_model_dir, tmp_path):
    """The real Trainer in a process whose standard error is a terminal (a pseudo-terminal)."""
    import os
    import sys
    from pathlib import Path

    from tests.support.terminal import on_a_terminal

    data = write_jsonl(tmp_path / "qa.jsonl", [{"query": f"Q{i}?", "response": f"A{i}."} for i in range(6)])
    status, stdout, screen = on_a_terminal(
        [
            sys.executable,
            "-m",
            "lora_lab",
            "run",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--max-steps",
            "3",
            "--grad-accum",
            "1",
            "--logging-steps",
            "1",
            "--lora-rank",
            "4",
            "--report-to",
            "none",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "tty",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=Path(__file__).resolve().parents[2],
        columns=None,
    )
    assert status == 0, stdout[-2000:]
    screen = screen.replace("\r\n", "\n")  # the terminal's newline
    frames = [f for f in screen.split("\r") if f.startswith("step ")]
    assert [f.split(" · ")[0] for f in frames] == [
        "step 1/3",
        "step 1/3",
        "step 2/3",
        "step 2/3",
        "step 3/3",
        "step 3/3",
    ]  # end, then log
    assert all(f.endswith("\x1b[K") for f in frames[:-1]) and frames[-1].endswith("\x1b[K\n")
    assert " tok/s · ETA " in frames[-1] and "GPU" not in frames[-1]
    assert "step " not in stdout and "done: 3 steps" in stdout
    assert "Warning" not in screen  # no library deprecation notices on the user's terminal
