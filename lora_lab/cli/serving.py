"""Commands that use a trained run: merge, export, chat, infer, eval, report, serve, and the web page."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import LoraLabError
from ..run_folder.names import EXPORT_PREFIX
from .options import echo_lines, source_options

CHECK_FLAG = "--no-check"
CHECK_HELP = "Skip the check of the new copy against the trained model (lora-lab check)."
FORCE_HELP = "Replace an existing --output folder, and exit 0 when the new copy fails its check."


@click.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--output", type=click.Path(), help="Merged folder (default: RUN_DIR/merged).")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Precision of the merged weights (default: the run's training precision, "
    "fp32 for a CPU run; bf16 for an adapter folder without its run).",
)
@click.option("--force", is_flag=True, help=FORCE_HELP)
@click.option("--served-name", default="finetuned", show_default=True, help="Model name in the printed vLLM commands.")
@click.option(CHECK_FLAG, is_flag=True, help=CHECK_HELP)
def merge(path, output, dtype, force, served_name, no_check):
    """Merge a run's adapter into its base model (PATH: run folder or adapter folder), then check
    the merged copy against the trained model (as `lora-lab check`)."""
    from .. import merge_adapter

    result = merge_adapter(path, output=output, dtype=dtype, force=force)
    echo_lines(result.lines(served_name))
    if not no_check:
        check_new_copy(path, "merged", result.output_dir, force)


@click.command()
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "gguf"]),
    default="safetensors",
    show_default=True,
    help="safetensors: a Hugging Face folder (transformers, vLLM). gguf: one GGUF file "
    "for llama.cpp and Ollama, with a Modelfile (needs lora-lab[gguf]).",
)
@click.option(
    "--quantize",
    type=click.Choice(["nf4", "w4a16", "awq", "f16", "q8_0", "q4_k_m"]),
    help="safetensors: nf4 (bitsandbytes 4-bit; vLLM --quantization bitsandbytes), "
    "w4a16 (GPTQ int4, compressed-tensors; needs lora-lab[export]) or awq (AWQ int4, "
    "the same format; needs lora-lab[export]). gguf: f16 (default), q8_0 or q4_k_m "
    "(llama.cpp).",
)
@click.option(
    "--calib-data",
    multiple=True,
    help="w4a16/awq calibration data (default: the run's training data from config.yaml). Repeat to mix datasets.",
)
@click.option("--calib-samples", type=int, help="w4a16/awq calibration samples  [default: 256]")
@click.option(
    "--output",
    type=click.Path(),
    help="Default: RUN_DIR/export-FORMAT (gguf: export-gguf-TYPE), or MERGED_DIR-FORMAT beside a merged folder.",
)
@click.option(
    "--gpu",
    "gpu_tier",
    type=click.Choice(["8gb", "12gb", "16gb", "24gb"]),
    help="Card to plan vLLM's --max-model-len, --max-num-seqs and memory share for.",
)
@click.option("--force", is_flag=True, help=FORCE_HELP)
@click.option(CHECK_FLAG, is_flag=True, help=CHECK_HELP)
def export(path, fmt, quantize, calib_data, calib_samples, output, gpu_tier, force, no_check):
    """Export a merged folder or a run (merged onto its 16-bit base first) for serving: 4-bit
    safetensors for vLLM, or GGUF for llama.cpp and Ollama; then check the copy against the
    trained model (as `lora-lab check`)."""
    from .. import export_model

    result = export_model(
        path,
        format=fmt,
        quantize=quantize,
        calib_data=calib_data,
        calib_samples=calib_samples,
        output=output,
        gpu_tier=gpu_tier,
        force=force,
    )
    echo_lines(result.lines())
    if not no_check:
        copy = getattr(result, "gguf_file", None) or result.output_dir
        check_new_copy(path, Path(result.output_dir).name.removeprefix(EXPORT_PREFIX), Path(copy), force)


def check_new_copy(path, name: str, copy: Path, force: bool) -> None:
    """The new copy against the model it was made from, the base with the adapter of `path`
    (use/parity.check_copy): its line and the verdict; a copy that fails exits non-zero unless
    --force. A copy of no adapter inside its run (an adapter folder alone, a full fine-tune) has
    nothing to be checked against."""
    from ..run_folder import RunFolder, source_adapter
    from ..use.parity import check_copy

    adapter = source_adapter(Path(path).resolve())
    if adapter is None or not RunFolder(adapter.parent).is_run:
        click.echo("check: skipped (no trained run with an adapter to compare the copy with)")
        return
    report = check_copy(adapter, name, copy)
    click.echo("\n".join(["", "check against the trained model:", *report["lines"], report["verdict"]]))
    if report["failed"] and not force:
        raise click.ClickException(f"{report['verdict']} The copy stays in {copy}; --force keeps exit status 0.")


def _settings(max_new_tokens, temperature, top_p, top_k, repetition_penalty, greedy):
    from ..use.infer import GenerationSettings

    return GenerationSettings(
        max_new_tokens=max_new_tokens,
        do_sample=False if greedy else None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
    )


@click.command()
@source_options
@click.option(
    "--compare",
    is_flag=True,
    help="Answer with the base model and the fine-tuned one side by side (--run or --adapter).",
)
def chat(run_dir, adapter, model, dtype, compare, **generation):
    """Chat in the terminal, streaming tokens. /reset, /system TEXT, /quit."""
    from ..use.infer import chat_loop, load_generation_model

    if compare and model:
        raise LoraLabError("--compare needs --run or --adapter (the base model is the adapter's).")
    loaded, tokenizer = load_generation_model(run_dir, adapter, model, dtype)

    def read(prompt):
        try:
            return input(prompt)
        except EOFError:
            return None

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    chat_loop(loaded, tokenizer, _settings(**generation), read, write, compare)


@click.command()
@source_options
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True),
    help="Prompts in any dataset format (a final assistant reply is the reference).",
)
@click.option(
    "--output",
    "output_path",
    required=True,
    type=click.Path(),
    help="JSONL answers, one per input row, in input order.",
)
@click.option("--batch-size", default=8, show_default=True, type=int)
def infer(run_dir, adapter, model, dtype, input_path, output_path, batch_size, **generation):
    """Batch generation: one answer per input row."""
    from ..use.infer import load_generation_model, run_inference

    loaded, tokenizer = load_generation_model(run_dir, adapter, model, dtype)
    count = run_inference(loaded, tokenizer, input_path, output_path, _settings(**generation), batch_size)
    click.echo(f"wrote {count} answers to {output_path}")


@click.command("eval")
@click.argument("path", type=click.Path(exists=True))
@click.option("--data", "datasets", multiple=True, help="Data to evaluate on.")
@click.option("--samples", default=5, show_default=True, help="Generated answers to show.")
@click.option(
    "--tasks",
    help="lm-evaluation-harness tasks, comma-separated (e.g. arc_easy,hellaswag): the base's and the "
    "fine-tune's scores side by side (needs lora-lab[eval]).",
)
@click.option("--include-path", type=click.Path(), help="--tasks: a folder of your own lm-eval task YAML files.")
@click.option("--limit", type=click.IntRange(1), help="--tasks: examples per task (default: all).")
@click.option("--num-fewshot", type=click.IntRange(0), help="--tasks: few-shot examples (default: the task's).")
@click.option(
    "--chat-template/--no-chat-template",
    default=True,
    show_default=True,
    help="--tasks: render examples with the model's chat template, as the run trained.",
)
@click.option(
    "--output", type=click.Path(), help="JSON report (default RUN_DIR/eval_report.json or benchmark_report.json)."
)
def evaluate(path, datasets, samples, tasks, include_path, limit, num_fewshot, chat_template, output):
    """Eval loss and perplexity on assistant tokens, plus generated answers vs references; on
    preference pairs (chosen / rejected) the reward margin and preference accuracy; on a grpo
    run's prompts the run's rewards of greedy completions before and after training; with --tasks,
    benchmark scores before and after the fine-tune (lm-evaluation-harness)."""
    if not datasets and not tasks:
        raise click.UsageError("pass --data FILE (loss and answers) or --tasks NAMES (benchmarks), or both.")
    if tasks:
        from ..use.benchmarks import BenchmarkSettings, benchmark_run, report_lines

        names = tuple(t.strip() for t in tasks.split(",") if t.strip())
        if not names:
            raise click.UsageError(f"--tasks {tasks!r}: name at least one lm-eval task (e.g. --tasks arc_easy).")
        settings = BenchmarkSettings(names, include_path, limit, num_fewshot, chat_template)
        report = benchmark_run(path, settings, output if not datasets else None)
        click.echo("\n".join(report_lines(report)))
    if datasets:
        _evaluate_on_data(path, list(datasets), samples, output if not tasks else None)


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--prompt", "prompts", multiple=True, help="A prompt to check with (repeat; default: three check prompts)."
)
@click.option(
    "--served", metavar="URL", help="Also check a running OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)."
)
@click.option(
    "--served-model", metavar="NAME", help="The run's model name on that server (default: the run folder's name)."
)
@click.option(
    "--api-key", envvar="LORA_LAB_API_KEY", help="The server's key (prefer LORA_LAB_API_KEY or --api-key-file)."
)
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="A file whose first line is the server's key.")
def check(run_dir, prompts, served, served_model, api_key, api_key_file):
    """Does every form of the run (merged/, export-*/, GGUF files, the server at --served) answer
    as the trained model: the same template, stops, greedy answers and next-token choices? Writes
    parity_report.json; exits non-zero when a form fails."""
    from ..use.parity import check_run
    from ..use.parity_served import ServedForm
    from ..use.serve import read_api_key

    if (served_model or api_key_file) and not served:
        raise click.UsageError("--served-model and --api-key-file name a server: pass its address with --served URL.")
    server = ServedForm(served, served_model, read_api_key(api_key, api_key_file)) if served else None
    report = check_run(run_dir, list(prompts) or None, server)
    click.echo("\n".join(report["lines"]) + f"\nreport: {report['report_path']}")
    if report["failed"]:
        raise click.ClickException(report["verdict"])


def _evaluate_on_data(path, datasets: list, samples: int, output) -> None:
    from .. import evaluate_run

    report = evaluate_run(path, datasets, samples, output)
    if report.get("task") == "grpo":  # held-out prompts of a grpo run
        click.echo("\n".join(reward_lines(report)))
        return
    if "reward_margin" in report:  # preference pairs
        click.echo(
            f"pairs {report['pairs']}  reward margin {report['reward_margin']:.4f}  "
            f"preference accuracy {report['preference_accuracy']:.3f} (beta "
            f"{report['beta']}, against the run's reference model)\nreport: "
            f"{report['report_path']}"
        )
        return
    click.echo(
        f"samples {report['samples']}  assistant tokens {report['assistant_tokens']}  "
        f"eval loss {report['eval_loss']:.4f}  perplexity {report['perplexity']:.2f}"
    )
    for row in report["generations"]:
        click.echo(
            f"\n{row['origin']}\n  prompt:    {row['prompt'][:100]}\n"
            f"  reference: {row['reference'][:100]}\n  answer:    {row['answer'][:100]}"
        )
    click.echo(f"\nreport: {report['report_path']}")


def reward_lines(report: dict) -> list[str]:
    """A grpo run's held-out rewards, before and after, a line each, then a few completions."""

    def shown(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"prompts {report['prompts']}  greedy completions, the run's rewards (before -> after training)"]
    for name, sides in {**report["rewards"], "total (weighted)": report["reward"]}.items():
        lines.append(f"  {name:<20} {shown(sides['before'])} -> {shown(sides['after'])}")
    for row in report["completions"]:
        lines.append(
            f"\n{row['origin']}\n  prompt: {row['prompt'][:100]}\n  before: {row['before'][:100]}\n"
            f"  after:  {row['after'][:100]}"
        )
    return lines + [f"\nreport: {report['report_path']}"]


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def report(run_dir):
    """Plot a run's loss, learning rate, gradient norm, tokens/s and GPU memory against the step
    (PNG files in RUN_DIR/plots/); works while the run trains too."""
    from .. import report_run

    click.echo(report_run(run_dir).summary())


@click.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to serve on (another than loopback can be reached from other machines).",
)
@click.option("--port", default=7860, show_default=True, type=int)
@click.option(
    "--token",
    help="Deprecated (visible in `ps`): the token the page asks for. Prefer $LORA_LAB_UI_TOKEN or --token-file.",
)
@click.option(
    "--token-file",
    type=click.Path(),
    help="A file holding the token the page asks for (default: a new one, printed once in a login link).",
)
@click.option(
    "--no-token", is_flag=True, help="On 127.0.0.1 only: no token, so every account of this machine can use the page."
)
@click.option("--max-runs", default=1, show_default=True, type=click.IntRange(1), help="Runs the page trains at once.")
@click.option(
    "--allow",
    "allowed",
    multiple=True,
    type=click.Path(),
    help="A folder the page may read and write (models, data, runs). Repeat for more; default: the current folder.",
)
def ui(host, port, token, token_file, no_token, max_runs, allowed):
    """A web page to plan, start, watch, resume, chat with and export runs (needs lora-lab[ui])."""
    from ..ui import launch_ui

    launch_ui(
        host=host,
        port=port,
        token=token,
        allow=list(allowed) or ["."],
        token_file=token_file,
        max_runs=max_runs,
        no_token=no_token,
    )


@click.command()
@click.argument("runs", nargs=-1, required=True)
@click.option("--base", help="The base model to serve the adapters on (default: the one their runs recorded).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address; any but loopback needs an API key.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--api-key",
    envvar="LORA_LAB_API_KEY",
    help="Key clients send as `Authorization: Bearer KEY` (prefer the LORA_LAB_API_KEY variable or --api-key-file).",
)
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="A file whose first line is the API key.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bf16", "fp16", "fp32"]))
@click.option("--trust-remote-code", is_flag=True, help="Run Python code shipped with the base model.")
@click.option(
    "--engine",
    default="transformers",
    show_default=True,
    type=click.Choice(["transformers", "vllm"]),
    help="vllm: start `vllm serve` with the adapters (where vLLM is installed; else print its command).",
)
@click.option(
    "--gpu",
    type=click.Choice(["8gb", "12gb", "16gb", "24gb"]),
    help="--engine vllm: the card to plan vLLM's context, sequences and memory share for.",
)
def serve(runs, base, host, port, api_key, api_key_file, dtype, trust_remote_code, engine, gpu):
    """An OpenAI-compatible API over runs' adapters of one base (RUN_DIR or NAME=RUN_DIR each;
    the base model answers too). Needs lora-lab[serve], or vLLM with --engine vllm."""
    from ..use.serve import read_api_key, serve_runs

    key = read_api_key(api_key, api_key_file)
    if engine == "vllm":
        from ..use.serve_vllm import serve_with_vllm

        if trust_remote_code or dtype != "auto":
            raise click.UsageError("--engine vllm: --dtype and --trust-remote-code are vLLM's own flags; drop them.")
        serve_with_vllm(list(runs), base, host, port, key, gpu)
        return
    if gpu:
        raise click.UsageError("--gpu plans vLLM's settings: pass it with --engine vllm.")
    serve_runs(
        list(runs), base=base, host=host, port=port, api_key=key, dtype=dtype, trust_remote_code=trust_remote_code
    )
