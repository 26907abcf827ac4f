"""`lora-lab eval RUN --tasks NAMES`: benchmark scores of the base model and of the fine-tune,
side by side, through lm-evaluation-harness (the forgetting report). The base is the run's
adapter switched off (one model in memory); both sides see the same tasks, limit, few-shot and
chat template. Task names are lm-eval's (their data comes from the hub), or tasks of your own
from YAML files in --include-path folders (local data: `dataset_path: json`)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointError, LoraLabError
from ..log import get_logger, quiet_library_progress
from ..run_folder import RunFolder, find_adapter

log = get_logger()

LM_EVAL_REQUIREMENT = "lm-eval>=0.4.13,<0.5"
"""The lm-evaluation-harness versions `lora-lab eval --tasks` is tested with (extra `eval`)."""


@dataclass(frozen=True)
class Score:
    """One metric of one task, before (base) and after (fine-tune), with lm-eval's standard errors."""

    task: str
    metric: str
    base: float
    tuned: float
    base_stderr: float | None
    tuned_stderr: float | None

    @property
    def change(self) -> float:
        return self.tuned - self.base

    def line(self) -> str:
        def err(value):
            return f" ±{value:.3f}" if value is not None else ""

        return (
            f"{self.task:<24} {self.metric:<12} {self.base:8.3f}{err(self.base_stderr):<8} "
            f"{self.tuned:8.3f}{err(self.tuned_stderr):<8} {self.change:+8.3f}"
        )


@dataclass(frozen=True)
class BenchmarkSettings:
    """What both sides are evaluated with."""

    tasks: tuple[str, ...]
    include_path: str | None = None
    limit: int | None = None
    """Examples per task (None: all)."""
    num_fewshot: int | None = None
    chat_template: bool = True
    """Render each example with the model's chat template, as the run trained."""
    batch_size: int = 8
    flags: tuple[str, str] = ("--tasks", "--include-path")
    """How the messages name the tasks and the task folder (`lora-lab run` gives its own)."""


def require_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise LoraLabError(
            f"`lora-lab eval --tasks` runs lm-evaluation-harness, which is not installed: "
            f"pip install 'lora-lab[eval]' (or pip install '{LM_EVAL_REQUIREMENT}')."
        ) from None
    return lm_eval


def benchmark_run(path: str | Path, settings: BenchmarkSettings, output: str | Path | None = None) -> dict:
    """The base's and the fine-tune's scores on settings.tasks; written to the run folder's
    benchmark_report.json (or `output`) and returned."""
    from .infer import load_adapter_model

    require_lm_eval()
    adapter_dir, run_dir = find_adapter(path)
    if run_dir is None:
        raise CheckpointError(f"{path}: an adapter folder outside its run; pass the run folder that holds it.")
    task_manager = _task_manager(settings)
    with quiet_library_progress():
        model, tokenizer = load_adapter_model(path)
    with model.disable_adapter():
        base = _evaluate(model, tokenizer, settings, task_manager)
    tuned = _evaluate(model, tokenizer, settings, task_manager)
    scores = scores_of(base, tuned)
    report = {
        "run_dir": str(run_dir),
        "adapter": str(adapter_dir),
        "settings": asdict(settings),
        "lm_eval": require_lm_eval().__version__,
        "scores": [asdict(s) | {"change": s.change} for s in scores],
    }
    target = Path(output) if output else RunFolder(run_dir).benchmark_report
    target.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    report["report_path"] = str(target)
    report["lines"] = [s.line() for s in scores]
    return report


def check_tasks(settings: BenchmarkSettings) -> None:
    """lm-eval is installed and knows every task: said before anything is trained or loaded."""
    _task_manager(settings)


def _task_manager(settings: BenchmarkSettings):
    """lm-eval's TaskManager with the --include-path folders; an unknown task name is refused
    before any model is loaded."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if settings.include_path and not Path(settings.include_path).is_dir():
        raise LoraLabError(f"{settings.flags[1]} {settings.include_path}: no such folder.")
    with quiet_library_progress():
        manager = TaskManager(include_path=settings.include_path)
    known = set(manager.all_tasks)
    unknown = [t for t in settings.tasks if t not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        hint = f" Close names: {', '.join(close)}." if close else ""
        raise LoraLabError(
            f"{settings.flags[0]} {unknown[0]}: not a task lm-eval knows.{hint} A task of your own: its YAML "
            f"file in a folder given with {settings.flags[1]}."
        )
    return manager


def _evaluate(model, tokenizer, settings: BenchmarkSettings, task_manager) -> dict:
    """lm-eval's results of one side: {task: {"metric,filter": value, ...}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    with quiet_library_progress():
        results = simple_evaluate(
            model=lm,
            tasks=list(settings.tasks),
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            task_manager=task_manager,
            apply_chat_template=settings.chat_template,
            log_samples=False,
        )
    if results is None:
        raise LoraLabError("lm-eval returned no results (was it started on several processes?).")
    return results["results"]


def scores_of(base: dict, tuned: dict) -> list[Score]:
    """Every numeric metric of every task both sides report, with its standard error."""
    scores = []
    for task in sorted(base):
        for key, value in base[task].items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, kind = key.split(",", 1)
            stderr_key = f"{metric}_stderr,{kind}"
            scores.append(
                Score(
                    task,
                    metric if kind == "none" else f"{metric} ({kind})",
                    float(value),
                    float(tuned[task][key]),
                    _number(base[task].get(stderr_key)),
                    _number(tuned[task].get(stderr_key)),
                )
            )
    return scores


def _number(value) -> float | None:
    """A standard error as lm-eval gives it ("N/A" where it has none)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def stored_report(run_dir: Path) -> dict | None:
    """The run's benchmark_report.json as benchmark_run returned it (its lines rebuilt), or None
    where the run has none."""
    path = RunFolder(run_dir).benchmark_report
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Score)}
    scores = [Score(**{k: v for k, v in s.items() if k in fields}) for s in report["scores"]]
    return report | {"report_path": str(path), "lines": [s.line() for s in scores]}


def report_lines(report: dict) -> list[str]:
    head = f"{'task':<24} {'metric':<12} {'base':>8}{'':<8} {'tuned':>8}{'':<8} {'change':>8}"
    return [head, *report["lines"], f"report: {report['report_path']}"]
