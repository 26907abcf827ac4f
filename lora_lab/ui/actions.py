"""What the page's buttons do, through lora-lab's Python API: plan, check data, chat, merge and
export. Nothing here trains: a run is always the `lora-lab run` process (runs.RunProcess)."""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import FLAG_FOR_KEY, PLANNED_MODEL, resolve_config
from ..errors import LoraLabError
from .form import RunForm

HISTOGRAM_BINS = 12


def config_flags(form: RunForm) -> dict:
    """The form's flags as config keys, the way `lora-lab run` reads them."""
    given = form.flags()
    return {key: given[flag] for key, flag in FLAG_FOR_KEY.items() if given.get(flag) not in (None, "", [])}


@dataclass
class PlanView:
    verdict: str
    """One line: fits / does NOT fit and which knob to turn."""
    report: str
    preset: str


def plan_form(form: RunForm, gpu_memory_gib: float | None, longest_sample_tokens: int | None = None) -> PlanView:
    """The memory plan of the form's run on a GPU of gpu_memory_gib (`lora-lab plan`)."""
    from .. import choose_preset, plan

    preset = choose_preset(form.preset or "auto", gpu_memory_gib)
    flags = {"model.name": PLANNED_MODEL, **config_flags(form)}
    flags.pop("data.datasets", None)
    config = resolve_config(preset, flags=flags, sets=form.set_entries(), need_data=False)
    result = plan(config, gpu_memory_gib, longest_sample_tokens)
    return PlanView(result.verdict(), result.report(), preset)


def launch_preset(form: RunForm) -> str:
    """The preset a run from this machine trains with (auto: from this machine's GPU)."""
    from .. import choose_preset

    return choose_preset(form.preset or "auto")


def run_folder_of(form: RunForm, preset: str) -> Path:
    """Where the run will write: --output-dir / --run-name, named as a run names itself."""
    from ..run_folder import default_run_name

    if form.run_name.strip():
        return Path(form.output_dir or "output") / form.run_name.strip()
    config = resolve_config(preset, flags={"model.name": form.model.strip()}, need_data=False)
    return Path(form.output_dir or "output") / default_run_name(config)


@dataclass
class DataView:
    problems: str
    """Every row problem, one `file:line: severity: reason` a line."""
    summary: str
    stats: str
    histogram: list
    """(tokens, samples) rows: the lower edge of each length bin and its count."""
    recommended_max_length: int | None
    longest: int | None


def check_data(form: RunForm) -> DataView:
    """`lora-lab data validate` and `lora-lab data stats` of the form's data with its model."""
    from .. import check_data as check

    data = [d for d in form.data if d.strip()]
    if not data:
        raise LoraLabError("data: give at least one data file.")
    result = check(
        data, model=form.model.strip() or "qwen2.5-0.5b", max_length=form.max_length.strip() or "2048", stats=True
    )
    problems, summary = "\n".join(result.problem_lines()), "\n".join(result.summary_lines())
    if result.stats is None:
        return DataView(problems, summary, "no usable sample", [], None, None)
    stats = result.stats
    return DataView(
        problems or "no problems",
        summary,
        stats.table(),
        histogram(stats.lengths),
        stats.recommended_max_length,
        stats.max,
    )


def histogram(lengths: list, bins: int = HISTOGRAM_BINS) -> list[tuple[int, int]]:
    """(lower edge, count) of `bins` equal-width token-length bins."""
    if not lengths:
        return []
    low, high = min(lengths), max(lengths)
    bins = min(bins, high - low + 1)
    width = max(1, -(-(high - low + 1) // bins))
    counts = [0] * bins
    for length in lengths:
        counts[(length - low) // width] += 1
    return [(low + i * width, n) for i, n in enumerate(counts)]


# ----------------------------------------------------------------------------- chat


class ChatModels:
    """The fine-tuned model of a run, loaded once; its base is the same model with the adapter
    turned off (as `lora-lab chat --compare` does)."""

    def __init__(self):
        self.run_dir, self.model, self.tokenizer = None, None, None

    def load(self, run_dir: Path):
        from ..use.infer import load_generation_model

        if self.run_dir != Path(run_dir):
            self.model, self.tokenizer = load_generation_model(run=str(run_dir))
            self.run_dir = Path(run_dir)
        return self.model, self.tokenizer

    def stream(self, run_dir: Path, messages: list, base: bool, max_new_tokens: int):
        """The reply's text so far, after every piece the model writes (use.infer.stream_reply
        in a thread)."""
        from ..use.infer import GenerationSettings, stream_reply

        model, tokenizer = self.load(run_dir)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, do_sample=False)
        pieces: queue.Queue = queue.Queue()
        failure = []

        def generate():
            try:
                off = (
                    model.disable_adapter() if base and hasattr(model, "disable_adapter") else contextlib.nullcontext()
                )
                with off:
                    stream_reply(model, tokenizer, messages, settings, pieces.put)
            except Exception as exc:  # reported on the page, not lost in a thread
                failure.append(exc)
            finally:
                pieces.put(None)

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        text = ""
        while (piece := pieces.get()) is not None:
            text += piece
            yield text
        worker.join()
        if failure:
            raise LoraLabError(f"generation failed: {failure[0]}")
        yield text


# ----------------------------------------------------------------------------- merge, export


def merge_run(run_dir: Path) -> str:
    """`lora-lab merge RUN --force`: what it prints."""
    from .. import merge_adapter

    return "\n".join(merge_adapter(str(run_dir), force=True).lines())


EXPORTS = {
    "nf4 (safetensors, vLLM)": ("safetensors", "nf4"),
    "w4a16 (GPTQ int4, vLLM)": ("safetensors", "w4a16"),
    "gguf f16 (llama.cpp, Ollama)": ("gguf", "f16"),
    "gguf q8_0 (llama.cpp, Ollama)": ("gguf", "q8_0"),
    "gguf q4_k_m (llama.cpp, Ollama)": ("gguf", "q4_k_m"),
}


def export_run(run_dir: Path, choice: str) -> str:
    """`lora-lab export RUN --format F --quantize Q --force`: what it prints."""
    from .. import export_model

    if choice not in EXPORTS:
        raise LoraLabError(f"export: choose one of {', '.join(EXPORTS)}.")
    fmt, quantize = EXPORTS[choice]
    return "\n".join(export_model(str(run_dir), format=fmt, quantize=quantize, force=True).lines())


def score_run(run_dir: Path, tasks: str, include_path: Path | None, limit: int | None) -> str:
    """The forgetting report (`lora-lab eval RUN --tasks`): lm-eval scores of the base and the
    fine-tune on `tasks` (comma-separated); without tasks, the run's stored report."""
    from ..use.benchmarks import BenchmarkSettings, benchmark_run, report_lines, stored_report

    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not names:
        report = stored_report(run_dir)
        if report is None:
            raise LoraLabError("lm-eval tasks: name at least one (this run has no benchmark report yet).")
        return "\n".join(report_lines(report))
    include = str(include_path) if include_path else None
    settings = BenchmarkSettings(names, include, limit, flags=("lm-eval tasks", "task folder"))
    return "\n".join(report_lines(benchmark_run(run_dir, settings)))


def check_run_forms(run_dir: Path) -> str:
    """`lora-lab check RUN`: each copy's line and the verdict."""
    from ..use.parity import check_run

    report = check_run(run_dir)
    return "\n".join([*report["lines"], f"report: {report['report_path']}", report["verdict"]])


@dataclass
class ServedRun:
    """A `lora-lab serve RUN` process the page started, on 127.0.0.1 with its own API key."""

    process: Any
    run_dir: Path
    address: str
    key: str

    def describe(self) -> str:
        return "\n".join(
            [
                f"serving {self.run_dir.name} (and its base) at {self.address}, an OpenAI-compatible API on "
                f"this machine only",
                f"API key: {self.key}",
                f'from Python: OpenAI(base_url="{self.address}", api_key="{self.key}")',
                f"models: {self.run_dir.name} (the fine-tune) and the base's name (GET {self.address}/models)",
            ]
        )

    def stop(self) -> None:
        import atexit
        import subprocess

        atexit.unregister(self.stop)
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_serving(run_dir: Path, port: int, wait_s: float = 180.0) -> ServedRun:
    """`lora-lab serve RUN` (use/serve.py) in its own process on 127.0.0.1:`port` with a new random
    API key (handed over in the environment, never on its command line), its output in
    RUN/logs/serve.log; returns once the server answers, or says why it did not."""
    import atexit
    import os
    import secrets
    import subprocess
    import sys
    import time

    from ..run_folder import RunFolder

    if not 1024 <= port <= 65535:
        raise LoraLabError(f"port: {port} is not a port the page may use (1024-65535).")
    key, log_path = secrets.token_urlsafe(24), RunFolder(run_dir).serve_log
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lora_lab", "serve", str(run_dir), "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, env={**os.environ, "LORA_LAB_API_KEY": key}, stdout=out, stderr=out)
    served = ServedRun(process, run_dir, f"http://127.0.0.1:{port}/v1", key)
    atexit.register(served.stop)  # the server ends with the page
    deadline = time.monotonic() + wait_s
    while process.poll() is None and time.monotonic() < deadline:
        if _answers(served):
            return served
        time.sleep(0.5)
    served.stop()
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    raise LoraLabError(f"the server did not start ({log_path}): " + (" / ".join(tail) or "no output"))


def _answers(served: ServedRun) -> bool:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{served.address}/models", headers={"Authorization": f"Bearer {served.key}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
