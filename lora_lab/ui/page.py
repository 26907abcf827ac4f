"""The page of `lora-lab ui`: one gradio page with the tabs Settings, Train, Chat and Export.
Each handler turns the form into lora-lab's own calls (actions.py) or its `lora-lab run`
process (runs.py) and shows a user's mistake as the message a LoraLabError carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import list_presets
from ..errors import LoraLabError
from ..log import get_logger
from ..run_folder.names import CONSOLE_LOG
from . import actions
from .form import AllowedFolders, RunForm, resume_arguments, run_arguments
from .runs import (
    RunProcess,
    can_resume,
    find_runs,
    live_figures,
    read_console,
    read_step_log_here,
    run_state,
    stop_run,
)

CONSOLE_LINES = 20
"""The console box shows the newest lines of RUN/logs/console.log, as many as it is tall."""
log = get_logger()

FORM_FIELDS = (
    "model",
    "preset",
    "data",
    "lora_rank",
    "lora_alpha",
    "max_length",
    "micro_batch_size",
    "grad_accum",
    "lr",
    "epochs",
    "max_steps",
    "qlora",
    "output_dir",
    "run_name",
    "sets",
)


def form_of(values: tuple) -> RunForm:
    given = dict(zip(FORM_FIELDS, values))
    given["data"] = (given["data"] or "").splitlines()
    given["sets"] = (given["sets"] or "").splitlines()
    return RunForm(**given)


class Page:
    """The page's state: the allowed folders and the runs this page started."""

    def __init__(self, allowed: AllowedFolders, gpu_memory_gib: float | None, max_runs: int = 1):
        self.allowed, self.gpu_memory_gib, self.max_runs = allowed, gpu_memory_gib, max_runs
        self.processes: dict[str, RunProcess] = {}
        self.chat = actions.ChatModels()
        self.served: actions.ServedRun | None = None
        self._plotted: tuple | None = None

    # --------------------------------------------------------------- settings
    def plan(self, gpu_memory, longest, *values):
        try:
            form = form_of(values)
            form.check_text()
            form.model = self.allowed.check_model(form.model)  # a model folder's config.json: allowed ones only
            view = actions.plan_form(form, float(gpu_memory) if gpu_memory else None, longest or None)
        except LoraLabError as exc:
            return f"cannot plan: {exc}", ""
        except ValueError:
            return "cannot plan: the GPU memory is not a number", ""
        return view.verdict, f"preset {view.preset}\n{view.report}"

    def check_data(self, *values):
        import pandas as pd

        form = form_of(values)
        try:
            form.check_text()
            form.data = [self.allowed.check_data(d) for d in form.data if d.strip()]
            form.model = self.allowed.check_model(form.model or "qwen2.5-0.5b")
            view = actions.check_data(form)
        except LoraLabError as exc:
            return f"error: {exc}", "", "", pd.DataFrame({"tokens": [], "samples": []}), None
        frame = pd.DataFrame(view.histogram, columns=["tokens", "samples"])
        frame["tokens"] = frame["tokens"].astype(str)
        suggested = f"\nsuggested max_length: {view.recommended_max_length}" if view.recommended_max_length else ""
        return view.problems, view.summary + suggested, view.stats, frame, view.longest

    # --------------------------------------------------------------- runs
    def run_choices(self) -> list[str]:
        folders = {str(Path(p).parent) for p in self.processes}
        for folder in self.allowed.folders:
            folders |= {str(folder), str(folder / "output")}
        return [str(p) for p in find_runs(sorted(folders))]

    def _selected(self, run_dir: str | None, saved: bool = False) -> Path:
        """The chosen run folder: inside an allowed folder (never one itself, whose exports would
        land beside it); with saved, its config.yaml must not widen what the page allows."""
        if not run_dir:
            raise LoraLabError("no run chosen: start one, or pick one from the list.")
        path = self.allowed.check(run_dir, "run folder")
        if path in self.allowed.folders:
            raise LoraLabError(f"run folder: {run_dir} is an allowed folder itself, not a run inside one.")
        if saved:
            self.allowed.check_saved_run(path)
        return path

    def _check_capacity(self) -> None:
        running = [p for p in self.processes.values() if p.running]
        if len(running) >= self.max_runs:
            raise LoraLabError(
                f"{len(running)} run(s) started here are still training (at most {self.max_runs} at once: "
                f"`lora-lab ui --max-runs N`); stop one or wait."
            )

    def _state(self, path: Path) -> str:
        process = self.processes.get(str(path))
        return run_state(path, process.process if process else None)

    def start(self, *values):
        import gradio as gr

        form = form_of(values)
        try:
            self.allowed.check_form(form)
            form.output_dir = str(self.allowed.check(form.output_dir or "output", "output"))
            preset = actions.launch_preset(form)
            run_dir = self.allowed.check(actions.run_folder_of(form, preset), "run folder")
            form.run_name = run_dir.name
            if str(run_dir) in self.processes and self.processes[str(run_dir)].running:
                raise LoraLabError(f"{run_dir.name} is already running.")
            self._check_capacity()
            self.processes[str(run_dir)] = RunProcess(run_arguments(form, preset), run_dir)
        except LoraLabError as exc:
            return gr.update(), f"not started: {exc}"
        return (gr.update(choices=self.run_choices(), value=str(run_dir)), f"started {run_dir.name}")

    def stop(self, run_dir):
        try:
            path = self._selected(run_dir)
            process = self.processes.get(str(path))
            if process is not None and process.running:
                process.stop()
            else:
                stop_run(path)  # started elsewhere (a terminal, an earlier `lora-lab ui`)
        except LoraLabError as exc:
            return f"error: {exc}"
        return f"stopping {path.name}: it saves a checkpoint, then exits"

    def resume(self, run_dir):
        try:
            path = self._selected(run_dir, saved=True)
            if self._state(path) == "running":
                raise LoraLabError(f"{path.name} is running.")
            self._check_capacity()
            if not can_resume(path):
                raise LoraLabError(f"{path.name} has no checkpoint to resume from, or is finished.")
            self.processes[str(path)] = RunProcess(resume_arguments(path), path)
        except LoraLabError as exc:
            return f"error: {exc}"
        return f"resuming {path.name}"

    def watch(self, run_dir, redraw: bool = True):
        """Status line, loss curve and console of the chosen run, read from its files; the
        curve is sent again only when it gained a point (or on redraw)."""
        import gradio as gr
        import pandas as pd

        empty = None  # an empty frame first leaves gradio's coloured lines undrawn later
        if not run_dir:
            return "no run chosen", empty, ""
        try:
            path = self._selected(run_dir)
        except LoraLabError as exc:
            return f"error: {exc}", empty, ""
        console = read_console(path)
        figures = live_figures(read_step_log_here(path), console)
        console = "\n".join(console.splitlines()[-CONSOLE_LINES:])
        state = self._state(path)
        shown = (str(path), len(figures.losses))
        if not redraw and self._plotted == shown:
            frame = gr.skip()
        else:
            frame = pd.DataFrame(figures.losses, columns=["step", "loss", "series"]) if figures.losses else empty
        self._plotted = shown
        return f"{path.name}: {state}\n{figures.line()}", frame, console

    def tick(self, run_dir):
        return self.watch(run_dir, redraw=False)

    # --------------------------------------------------------------- chat
    def send(self, run_dir, message, base_history, tuned_history, max_new_tokens):
        if not (message or "").strip():
            yield base_history, tuned_history, base_history, tuned_history, ""
            return
        try:
            path = self._selected(run_dir, saved=True)
            if self._state(path) != "finished":
                raise LoraLabError(f"{path.name} is not finished: chat needs its adapter.")
        except LoraLabError as exc:
            note = [{"role": "assistant", "content": f"error: {exc}"}]
            yield base_history + note, tuned_history + note, base_history, tuned_history, ""
            return
        user = {"role": "user", "content": message.strip()}
        base, tuned = base_history + [user], tuned_history + [user]
        for side, history in (("base", base), ("tuned", tuned)):
            asked = list(history)
            history.append({"role": "assistant", "content": ""})
            for text in self.chat.stream(path, asked, side == "base", int(max_new_tokens)):
                history[-1] = {"role": "assistant", "content": text}
                yield base, tuned, base, tuned, ""
        yield base, tuned, base, tuned, ""

    # --------------------------------------------------------------- export
    def merge(self, run_dir):
        return self._use(actions.merge_run, run_dir)

    def export(self, run_dir, choice):
        return self._use(actions.export_run, run_dir, choice)

    def check_forms(self, run_dir):
        return self._use(actions.check_run_forms, run_dir)

    def serve(self, run_dir, port):
        """The chosen run behind an OpenAI-compatible API on 127.0.0.1 (one at a time)."""
        self.stop_serving()
        try:
            self.served = actions.start_serving(self._selected(run_dir, saved=True), int(port or 8000))
        except LoraLabError as exc:
            return f"error: {exc}"
        except ValueError:
            return "error: port: not a number"
        return self.served.describe()

    def stop_serving(self):
        if self.served is None:
            return "nothing is being served"
        self.served.stop()
        name, self.served = self.served.run_dir.name, None
        return f"stopped serving {name}"

    def benchmarks(self, run_dir, tasks, include, limit):
        try:
            folder = self.allowed.check(include, "task folder") if include and include.strip() else None
        except LoraLabError as exc:
            return f"error: {exc}"
        return self._use(actions.score_run, run_dir, tasks or "", folder, int(limit) if limit else None)

    def _use(self, action, run_dir, *args) -> str:
        """A merge or export of the chosen run; what went wrong is said in the result box (a
        failure of the library below with its type, its traceback in the server's log)."""
        try:
            return action(self._selected(run_dir, saved=True), *args)
        except LoraLabError as exc:
            return f"error: {exc}"
        except Exception as exc:
            log.exception(f"{action.__name__} of {run_dir} failed")
            return f"failed: {type(exc).__name__}; the details are in the log of `lora-lab ui`."


def build_page(page: Page, safety_note: str):
    """The gradio Blocks of the page."""
    import gradio as gr

    presets = ["auto"] + [p["name"] for p in list_presets()]
    output_default = str(page.allowed.folders[0] / "output")
    with gr.Blocks(title="lora-lab", analytics_enabled=False) as blocks:
        gr.Markdown(f"## lora-lab\n{safety_note}")
        with gr.Tab("Settings"):
            with gr.Row():
                model = gr.Textbox(
                    label="Model: alias, model folder or .gguf file", value="qwen2.5-0.5b", elem_id="model"
                )
                preset = gr.Dropdown(presets, value="auto", label="Preset", elem_id="preset")
                gpu_memory = gr.Number(
                    value=page.gpu_memory_gib or 24, label="GPU memory to plan for (GiB)", elem_id="gpu-memory"
                )
            data = gr.Textbox(
                label="Data files, one a line (file.jsonl#N repeats it N times)", lines=2, elem_id="data"
            )
            with gr.Row():
                knobs = [
                    gr.Textbox(label=label, elem_id=name.replace("_", "-"), min_width=90)
                    for name, label in (
                        ("lora_rank", "LoRA rank"),
                        ("lora_alpha", "LoRA alpha"),
                        ("max_length", "max_length"),
                        ("micro_batch_size", "micro-batch"),
                        ("grad_accum", "accumulation"),
                        ("lr", "learning rate"),
                        ("epochs", "epochs"),
                        ("max_steps", "max steps"),
                    )
                ]
                qlora = gr.Checkbox(label="QLoRA (4-bit base)", elem_id="qlora")
            with gr.Row():
                output_dir = gr.Textbox(value=output_default, label="Output folder", elem_id="output-dir")
                run_name = gr.Textbox(label="Run name (default: model-preset-time)", elem_id="run-name")
            sets = gr.Textbox(label="Extra settings, KEY=VALUE a line (--set)", lines=1, elem_id="sets")
            longest = gr.State(None)
            verdict = gr.Textbox(label="Memory plan", elem_id="plan-verdict", interactive=False)
            plan_report = gr.Textbox(
                label="Plan breakdown (lora-lab plan)", lines=8, elem_id="plan-report", interactive=False
            )
            check = gr.Button("Check data (validate + stats)", elem_id="check-data")
            with gr.Row():
                problems = gr.Textbox(
                    label="Rows with problems (file:line)", lines=6, elem_id="data-problems", interactive=False
                )
                summary = gr.Textbox(label="Summary", lines=6, elem_id="data-summary", interactive=False)
            with gr.Row():
                stats = gr.Textbox(
                    label="Token lengths (lora-lab data stats)", lines=9, elem_id="data-stats", interactive=False
                )
                lengths = gr.BarPlot(
                    x="tokens", y="samples", label="Length histogram", elem_id="length-histogram", sort="x"
                )
        # every field of the run form: gradio components of several kinds, each with .change
        form: list[Any] = [model, preset, data, *knobs, qlora, output_dir, run_name, sets]
        with gr.Tab("Train"):
            with gr.Row():
                start = gr.Button("Start", variant="primary", elem_id="start")
                stop = gr.Button("Stop (SIGTERM: checkpoint, then exit)", elem_id="stop")
                resume = gr.Button("Resume", elem_id="resume")
            with gr.Row():
                run_dir = gr.Dropdown(
                    page.run_choices(), label="Run folder", elem_id="run-dir", allow_custom_value=True, scale=4
                )
                refresh = gr.Button("Refresh list", scale=1)
            action = gr.Textbox(label="Last action", elem_id="action", interactive=False)
            status = gr.Textbox(label="Status", lines=2, elem_id="run-status", interactive=False)
            loss_plot = gr.LinePlot(x="step", y="loss", color="series", label="Loss", elem_id="loss-plot")
            console = gr.Textbox(
                label=f"Console (the end of RUN/{CONSOLE_LOG})",
                lines=CONSOLE_LINES,
                max_lines=CONSOLE_LINES,
                elem_id="console",
                interactive=False,
            )
        with gr.Tab("Chat"):
            gr.Markdown("The chosen run's base model and its fine-tuned model answer side by side (greedy).")
            with gr.Row():
                base_chat = gr.Chatbot(label="Base", elem_id="chat-base")
                tuned_chat = gr.Chatbot(label="Fine-tuned", elem_id="chat-tuned")
            with gr.Row():
                message = gr.Textbox(label="Message", elem_id="message", scale=4)
                max_new_tokens = gr.Slider(1, 1024, value=64, step=1, label="max new tokens", elem_id="max-new-tokens")
                send = gr.Button("Send", variant="primary", elem_id="send", scale=1)
            base_state, tuned_state = gr.State([]), gr.State([])
        with gr.Tab("Export"):
            with gr.Row():
                merge = gr.Button("Merge adapter into the base", elem_id="merge")
                export_choice = gr.Dropdown(
                    list(actions.EXPORTS), value=list(actions.EXPORTS)[0], label="Export as", elem_id="export-choice"
                )
                export = gr.Button("Export", elem_id="export")
                check_forms = gr.Button("Check every copy against the trained model", elem_id="check-forms")
            export_out = gr.Textbox(
                label="Result and serving commands", lines=14, elem_id="export-output", interactive=False
            )
        with gr.Tab("Serve"):  # `lora-lab serve RUN` on 127.0.0.1, with a new API key
            with gr.Row():
                serve_port = gr.Number(value=8000, label="port (127.0.0.1)", precision=0, elem_id="serve-port")
                serve = gr.Button("Serve the run (OpenAI-compatible API)", elem_id="serve")
                unserve = gr.Button("Stop serving", elem_id="stop-serving")
            serve_out = gr.Textbox(label="Address and key", lines=5, elem_id="serve-output", interactive=False)
        with gr.Tab("Benchmarks"):  # the forgetting report: `lora-lab eval RUN --tasks`
            with gr.Row():
                bench_tasks = gr.Textbox(
                    label="lm-eval tasks (comma-separated; empty: the stored report)", elem_id="bench-tasks"
                )
                bench_folder = gr.Textbox(label="Folder of your own task files (optional)", elem_id="bench-folder")
                bench_limit = gr.Number(label="examples per task (empty: all)", precision=0, elem_id="bench-limit")
                bench = gr.Button("Score the base and the fine-tune", elem_id="bench-run")
            bench_out = gr.Textbox(label="Forgetting report", lines=10, elem_id="bench-output", interactive=False)

        plan_inputs = [gpu_memory, longest, *form]
        # One listener for every field the plan reads: its calls run one at a time and the last
        # one wins, so an answer to older settings never overwrites the answer to newer ones.
        gr.on(
            [component.change for component in [gpu_memory, *form]],
            page.plan,
            plan_inputs,
            [verdict, plan_report],
            trigger_mode="always_last",
            show_progress="hidden",
        )
        blocks.load(page.plan, plan_inputs, [verdict, plan_report])
        check.click(page.check_data, form, [problems, summary, stats, lengths, longest]).then(
            page.plan, plan_inputs, [verdict, plan_report]
        )
        start.click(page.start, form, [run_dir, action])
        stop.click(page.stop, [run_dir], [action])
        resume.click(page.resume, [run_dir], [action])
        refresh.click(lambda: gr.update(choices=page.run_choices()), None, [run_dir])
        blocks.load(lambda: gr.update(choices=page.run_choices()), None, [run_dir])
        timer = gr.Timer(1.0)
        timer.tick(page.tick, [run_dir], [status, loss_plot, console], show_progress="hidden")
        run_dir.change(page.watch, [run_dir], [status, loss_plot, console])
        send.click(
            page.send,
            [run_dir, message, base_state, tuned_state, max_new_tokens],
            [base_chat, tuned_chat, base_state, tuned_state, message],
        )
        merge.click(page.merge, [run_dir], [export_out])
        export.click(page.export, [run_dir, export_choice], [export_out])
        check_forms.click(page.check_forms, [run_dir], [export_out])
        serve.click(page.serve, [run_dir, serve_port], [serve_out])
        unserve.click(page.stop_serving, None, [serve_out])
        bench.click(page.benchmarks, [run_dir, bench_tasks, bench_folder, bench_limit], [bench_out])
    return blocks
