"""Runs started from the page and runs found in output folders: the process of `lora-lab run`,
and what its own files say (logs/train_log.jsonl, logs/console.log, run_summary.json)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LoraLabError
from ..run_folder import list_checkpoints, read_step_log
from ..run_folder.names import CONFIG_FILE, CONSOLE_LOG, STEP_LOG, STOP_FILE, SUMMARY_FILE
from ..training.lock import running_pid

PROGRESS = re.compile(r"step (\d+)/(\d+)(?:.*?ETA ((?:\d+[hms] ?)+))?")
"""The run's progress line (training/watch.py progress_fields): step, total and ETA."""
CONSOLE_TAIL_CHARS = 12_000


@dataclass
class LiveFigures:
    """The newest figures of a run, for the page's status line."""

    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    learning_rate: float | None = None
    tokens_per_second: float | None = None
    gpu_memory_gib: float | None = None
    eta: str | None = None
    losses: list = field(default_factory=list)
    """(step, value, series) rows: series "train loss" or "eval loss"."""

    def line(self) -> str:
        parts = [f"step {self.step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for label, value, text in (
            ("loss", self.loss, "{:.4f}"),
            ("eval loss", self.eval_loss, "{:.4f}"),
            ("lr", self.learning_rate, "{:.3g}"),
            ("tok/s", self.tokens_per_second, "{:,.0f}"),
            ("GPU GiB", self.gpu_memory_gib, "{:.2f}"),
            ("ETA", self.eta, "{}"),
        ):
            if value is not None:
                parts.append(f"{label} {text.format(value)}")
        return " · ".join(parts)


def live_figures(events: list, console: str = "") -> LiveFigures:
    """The figures of a run from its step-log events (read_step_log), with the total steps and
    the ETA of the newest progress line it printed."""
    figures = LiveFigures()
    for event in events:
        step = event.get("step", 0)
        if "loss" in event:
            figures.step, figures.loss = step, event["loss"]
            figures.losses.append((step, event["loss"], "train loss"))
            figures.learning_rate = event.get("learning_rate", figures.learning_rate)
            figures.tokens_per_second = event.get("tokens_per_second", figures.tokens_per_second)
            figures.gpu_memory_gib = event.get("gpu_peak_memory_gib", figures.gpu_memory_gib)
        if "eval_loss" in event:
            figures.eval_loss = event["eval_loss"]
            figures.losses.append((step, event["eval_loss"], "eval loss"))
        if "train_runtime" in event:  # the Trainer's closing event
            figures.step = max(figures.step, step)
    matches = list(PROGRESS.finditer(console))
    if matches:
        last = matches[-1]
        figures.total_steps = int(last.group(2))
        figures.eta = last.group(3).strip() if last.group(3) else None
        figures.step = max(figures.step, int(last.group(1)))
    return figures


def own_file(run_dir: Path, relative: str) -> Path | None:
    """RUN/relative, if it is a plain file of the run folder: no symbolic link on the way
    (a link planted in a run folder must not show a file from elsewhere on the page)."""
    path = Path(run_dir) / relative
    parts = [Path(run_dir).joinpath(*Path(relative).parts[: i + 1]) for i in range(len(Path(relative).parts))]
    if Path(run_dir).is_symlink() or any(p.is_symlink() for p in parts) or not path.is_file():
        return None
    return path


def read_step_log_here(run_dir: Path) -> list:
    """The run's step-log events (run_folder.read_step_log), unless the log is a link."""
    return read_step_log(run_dir) if own_file(run_dir, STEP_LOG) else []


def read_console(run_dir: Path, chars: int = CONSOLE_TAIL_CHARS) -> str:
    """The end of what a run started from the page printed."""
    path = own_file(run_dir, CONSOLE_LOG)
    if path is None:
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - chars))
        return handle.read().decode("utf-8", "replace")


def run_state(run_dir: Path, process: subprocess.Popen | None = None) -> str:
    """running, finished, stopped (a checkpoint to resume from), failed or incomplete."""
    run_dir = Path(run_dir)
    if process is not None and process.poll() is None or running_pid(run_dir) is not None:
        return "running"
    if (run_dir / SUMMARY_FILE).is_file():
        return "finished"
    if (run_dir / STOP_FILE).is_file():
        return "stopped"
    if process is not None and process.returncode:
        return f"failed (exit status {process.returncode})"
    return "incomplete" if list_checkpoints(run_dir) else "not started"


def find_runs(folders: list) -> list[Path]:
    """Run folders (with their config.yaml) directly under each folder, newest first."""
    found = [
        p
        for folder in folders
        if Path(folder).is_dir()
        for p in Path(folder).iterdir()
        if not p.is_symlink() and own_file(p, CONFIG_FILE)
    ]
    return sorted(found, key=lambda p: (p / CONFIG_FILE).stat().st_mtime, reverse=True)


def stop_run(run_dir: Path) -> None:
    """SIGTERM to the process of this host that is writing the run (its lock's holder), for a
    run this page did not start: only if that process is a `lora-lab run` of this user (a lock
    file naming another process is not obeyed)."""
    pid = running_pid(run_dir)
    if pid is None:
        raise LoraLabError(f"{Path(run_dir).name}: no run of this machine is writing into it.")
    if not is_lora_lab_run(pid):
        raise LoraLabError(
            f"{Path(run_dir).name}: its lock names process {pid}, which is not a `lora-lab run` of this user; "
            f"nothing was signalled."
        )
    os.kill(pid, signal.SIGTERM)


def is_lora_lab_run(pid: int) -> bool:
    """Process pid belongs to this user and its command line is `lora-lab run` (or
    `python -m lora_lab run`), read from /proc."""
    proc = Path("/proc") / str(pid)
    try:
        if proc.stat().st_uid != os.getuid():
            return False
        argv = [a.decode("utf-8", "replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return False
    for i, arg in enumerate(argv[:-1]):
        if (arg == "lora_lab" and i and argv[i - 1] == "-m" or Path(arg).name == "lora-lab") and argv[i + 1] == "run":
            return True
    return False


def can_resume(run_dir: Path) -> bool:
    return not (Path(run_dir) / SUMMARY_FILE).is_file() and bool(list_checkpoints(run_dir))


class RunProcess:
    """One `lora-lab run` started by the page: its own process group, its output in
    RUN/logs/console.log."""

    def __init__(self, argv: list, run_dir: Path):
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise TypeError("a run is started from an argument list of strings, never a shell string")
        self.argv, self.run_dir = argv, Path(run_dir)
        (self.run_dir / CONSOLE_LOG).parent.mkdir(parents=True, exist_ok=True)
        console = open(self.run_dir / CONSOLE_LOG, "ab")
        console.write(("$ " + " ".join(argv) + "\n").encode())
        console.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            argv, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        console.close()  # the child holds its own copy

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM: the run finishes the optimizer step under way, saves a checkpoint and exits
        (training/callbacks.py, StopOnSignal)."""
        if not self.running:
            raise LoraLabError(f"{self.run_dir.name} is not running.")
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)
