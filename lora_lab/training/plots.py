"""PNG plots of a run's step log (logs/train_log.jsonl) in RUN/plots/: written at the end of every
run, and by `lora-lab report RUN` (report_run) at any time, a run still training included.

Each plot is one figure against the optimizer step, titled with the run's name. A series with no
data in the log (no validation data, no GPU) gets no plot, and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, LoraLabError
from ..log import get_logger
from ..run_folder import RunFolder, read_step_log
from ..run_folder.names import CONFIG_FILE, PLOTS_FOLDER, STEP_LOG

log = get_logger()


@dataclass(frozen=True)
class Plot:
    """One PNG: its file name, title, y axis and the step-log keys it draws (one line each)."""

    file: str
    title: str
    y_label: str
    lines: tuple  # (step-log key, legend label)
    missing: str = ""
    """Why there is no data, when the log holds none of the keys."""
    names_lines: bool = False
    """The title names the lines drawn before it ("train and eval loss", "train loss")."""

    def title_for(self, series: dict) -> str:
        """The title of the figure drawn from `series`: it names only the curves it holds."""
        if not self.names_lines:
            return self.title
        drawn = [label for key, label in self.lines if series.get(key, ([], []))[0]]
        return f"{' and '.join(drawn)} {self.title}"


PLOTS = (
    Plot(
        "loss.png",
        "loss",
        "loss (cross-entropy, nats per token)",
        (("loss", "train"), ("eval_loss", "eval")),
        names_lines=True,
    ),
    Plot("learning_rate.png", "learning rate", "learning rate", (("learning_rate", "lr"),)),
    Plot("grad_norm.png", "gradient norm", "gradient L2 norm (before clipping)", (("grad_norm", "grad norm"),)),
    Plot("tokens_per_second.png", "throughput", "tokens per second", (("tokens_per_second", "tokens/s"),)),
    Plot(
        "gpu_memory.png",
        "GPU memory",
        "GiB (torch.cuda reserved)",
        (("gpu_peak_memory_gib", "peak reserved"), ("gpu_memory_gib", "reserved")),
        missing="no GPU memory in the log (the run trained on the CPU)",
    ),
)


@dataclass
class PlotReport:
    """What report_run drew: the files written, the series each holds (key -> (steps, values),
    exactly as read from the step log) and a note for every plot left out."""

    run_dir: Path
    files: list = field(default_factory=list)
    series: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    titles: dict = field(default_factory=dict)
    """file name -> the title drawn on it (after the run's name)."""

    def summary(self) -> str:
        lines = [f"plots of {self.run_dir.name}: {len(self.files)} in {self.run_dir / PLOTS_FOLDER}"]
        lines += [f"  {path.name}" for path in self.files]
        lines += [f"  left out: {note}" for note in self.notes]
        return "\n".join(lines)


def step_series(events: list, key: str) -> tuple[list, list]:
    """(steps, values) of one key over the step log; the last event of a step wins (a resumed
    run logs the steps after its checkpoint again)."""
    by_step = {}
    for event in events:
        value = event.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "step" in event:
            by_step[event["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def draw(plot: Plot, series: dict, run_name: str, path: Path) -> str:
    """One PNG, drawn on matplotlib's Agg canvas (no display, no global backend change); returns
    its title."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise LoraLabError(
            "matplotlib is not installed (lora-lab draws its plots with it). Run: pip install matplotlib"
        ) from None

    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for key, label in plot.lines:
        steps, values = series.get(key, ([], []))
        if steps:
            axes.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
    axes.set_title(f"{run_name}: {plot.title_for(series)}")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(plot.y_label)
    axes.grid(True, alpha=0.3)
    if sum(1 for key, _ in plot.lines if series.get(key, ([], []))[0]) > 1:
        axes.legend()
    figure.savefig(path, format="png")
    return plot.title_for(series)


def report_run(run_dir: str | Path) -> PlotReport:
    """Draw RUN/plots/*.png from the run's step log; returns what was drawn and left out."""
    run_dir = Path(run_dir)
    if not RunFolder(run_dir).is_run:
        raise CheckpointError(
            f"{run_dir}: not a run folder (no {CONFIG_FILE}). Pass the folder `lora-lab run` wrote, e.g. output/NAME."
        )
    events = read_step_log(run_dir)
    if not any("loss" in event for event in events):
        raise CheckpointError(
            f"{run_dir / STEP_LOG}: no training step logged yet, nothing to "
            f"plot. Run it again once the first step is logged."
        )
    report = PlotReport(run_dir)
    folder = run_dir / PLOTS_FOLDER
    folder.mkdir(exist_ok=True)
    for plot in PLOTS:
        series = {key: step_series(events, key) for key, _ in plot.lines}
        series = {key: s for key, s in series.items() if s[0]}
        target = folder / plot.file
        if not series:
            target.unlink(missing_ok=True)  # an earlier report's plot of data now gone
            report.notes.append(f"{plot.file}: {plot.missing or 'no ' + plot.title + ' in the log'}")
            continue
        report.titles[plot.file] = draw(plot, series, run_dir.name, target)
        report.files.append(target)
        report.series.update(series)
    if "eval_loss" not in report.series:
        report.notes.append(
            "the eval curve of loss.png: no eval loss in the log (no validation data: --val-ratio or --val-data)"
        )
    return report
