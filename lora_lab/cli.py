"""The `lora-lab` command: click commands only, each a thin layer over the Python API."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import click

from .config import FLAGS, field_help, list_presets, resolve_config
from .errors import DataError, LoraLabError, RunStopped
from .log import get_logger

log = get_logger()


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


def run_options(func):
    """One option per entry of config.FLAGS; values stay text and are checked by the config."""
    for flag, key in reversed(FLAGS.items()):
        help_text = f"{field_help(key)} [{key}]"
        if "/" in flag:
            func = click.option(flag, key.replace(".", "__"), default=None, help=help_text)(func)
        elif key in ("model.trust_remote_code", "train.allow_config_change"):
            func = click.option(flag, key.replace(".", "__"), is_flag=True, default=None, help=help_text)(func)
        elif key in ("data.datasets", "data.val_data"):
            func = click.option(
                flag, key.replace(".", "__"), multiple=True, help=help_text + " Repeat to mix datasets."
            )(func)
        else:
            func = click.option(flag, key.replace(".", "__"), help=help_text)(func)
    return func


def _given_flags(flag_values) -> dict:
    """The run_options a user gave, as config keys (`--data a --data b` -> a list)."""
    return {
        k.replace("__", "."): (list(v) if isinstance(v, tuple) else v)
        for k, v in flag_values.items()
        if v not in (None, ())
    }


def run_config(preset, config_file, sets, flag_values):
    """The RunConfig `lora-lab run` trains with, from its parsed options (nothing loaded)."""
    from . import choose_preset

    return resolve_config(choose_preset(preset), config_file, _given_flags(flag_values), sets)


@main.command()
@click.option(
    "--preset",
    default="cpu",
    show_default=True,
    help="Hardware tier (lora-lab presets), or auto to pick it from this GPU.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(),
    help="YAML file with model:, lora:, "
    "data:, train: sections (or a run's saved config.yaml); applied after the preset.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any config key, e.g. --set train.weight_decay=0.01. Applied last.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="With --gpus/--engine: write the launch files "
    "(accelerate + DeepSpeed/FSDP configs) and print the command and per-GPU memory "
    "plan, without training or checking this machine's GPUs.",
)
@click.option(
    "--show-config",
    "-v",
    is_flag=True,
    help="Print every resolved setting, defaults included (the run folder's config.yaml holds them all).",
)
@run_options
def run(preset, config_file, sets, dry_run, show_config, **flag_values):
    """Fine-tune a model with LoRA and write a run folder (--gpus N: N processes)."""
    from . import train
    from .run_folder import CONFIG_FILE
    from .training.launch import dry_run_launch, needs_launch

    config = run_config(preset, config_file, sets, flag_values)
    if show_config:
        log.info(f"resolved config (preset {config.preset}):\n{config.describe()}")
    else:
        log.info(
            f"settings that differ from the defaults (preset {config.preset}; every setting: --show-config, "
            f"and {CONFIG_FILE} in the run folder):\n{config.describe(changed_only=True)}"
        )
    if dry_run:
        if not needs_launch(config):
            raise click.UsageError(
                "--dry-run shows a multi-process launch: add --gpus N (and "
                "--engine); for one GPU, `lora-lab plan` shows the memory."
            )
        dry_run_launch(config)
        return
    result = train(config)
    log.info(
        f"\ndone: {result.global_step} steps, train loss {result.train_loss:.4f}"
        + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
        + (
            f"\nadapter: {result.adapter_dir}"
            if result.adapter_dir
            else f"\nmodel (from_pretrained): {result.model_dir}"
        )
        + f"\nrun folder: {result.run_dir}"
    )


@main.command()
@click.option(
    "--preset",
    default="auto",
    show_default=True,
    help="Hardware tier, or auto to pick it from --gpu-memory (or this GPU).",
)
@click.option(
    "--gpu-memory",
    type=float,
    help="GPU memory in GiB (default: this machine's GPU, else the preset's card: 16 for 16gb).",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@run_options
def plan(preset, gpu_memory, sets, **flag_values):
    """Predict the peak GPU memory of a run, broken down, and whether it fits. No GPU needed.
    Takes the flags of `lora-lab run`; --data plans with the data's real longest sample."""
    from . import choose_preset
    from . import plan as plan_run
    from .device import gpu_memory_gib
    from .planning.memory import row_length

    gpu_memory = gpu_memory or gpu_memory_gib()
    if preset == "auto" and gpu_memory is None:
        raise LoraLabError("--preset auto needs a GPU to look at, or --gpu-memory GIB.")
    flags = {"model.name": "qwen2.5-7b", **_given_flags(flag_values)}
    config = resolve_config(choose_preset(preset, gpu_memory), flags=flags, sets=sets, need_data=False)
    if config.data.packing:
        why = (
            f"data.pack_length {config.data.pack_length}"
            if config.data.pack_length
            else f"--max-length {config.data.max_length} x --micro-batch-size {config.train.micro_batch_size}"
        )
        log.info(
            f"packing ({config.sources.get('data.packing', 'default')}): the samples of a "
            f"step share rows of {row_length(config)} tokens ({why}); the plan is for such "
            f"a row. --set data.packing=false plans one sample of --max-length a row."
        )
    result = plan_run(config, gpu_memory, _longest_sample(config) if config.data.datasets else None)
    click.echo(result.report())
    if result.fits is False:
        sys.exit(1)


def _longest_sample(config) -> int:
    from .data import prepare_data
    from .data.arrow import sample_lengths

    prepared = prepare_data(config.data, _counting_tokenizer(config.model.name))
    longest = max(sample_lengths(prepared.train.samples))
    click.echo(f"longest encoded sample in the data: {longest} tokens")
    return longest


@main.command()
def presets():
    """List the presets with a one-line summary."""
    for preset in list_presets():  # cpu, then the cards by size
        click.echo(f"{preset['name']:<8} {preset['description']}")


@main.command()
@click.option("--output-dir", default="output", show_default=True)
@click.option("--name", default="Aurora", show_default=True, help="The new identity's name.")
@click.option("--author", default="Lora Lab", show_default=True)
@click.option("--max-steps", default=30, show_default=True, type=int)
@click.option("--fetch-only", is_flag=True, help="Only download and convert the demo model.")
def demo(output_dir, name, author, max_steps, fetch_only):
    """Teach the real Qwen2.5-Coder-0.5B-Instruct a new identity on CPU, before/after."""
    from .demo import fetch_demo_model, run_demo

    if fetch_only:
        click.echo(fetch_demo_model())
        return
    run_demo(output_dir, name, author, max_steps)


@main.group()
def data():
    """Inspect datasets: validate, stats, encode, preview."""


def data_options(func):
    func = click.option(
        "--model",
        "model",
        default="qwen2.5-0.5b",
        show_default=True,
        help="Model whose tokenizer and chat template encode the data.",
    )(func)
    func = click.option("--max-length", default="2048", show_default=True)(func)
    func = click.option("--format", "row_format", default="auto", show_default=True)(func)
    func = click.option("--model-name", default=None)(func)
    func = click.option("--model-author", default=None)(func)
    return click.argument("datasets", nargs=-1, required=True)(func)


def _data_config(datasets, model, max_length, row_format, model_name, model_author, training=False):
    """The config the `data` commands read datasets with (the options of data_options). Not
    `training` (validate, stats, preview): the bundled identity set's missing --model-name /
    --model-author read as stand-ins, said in one line (data.with_identity_stand_ins)."""
    from .data import with_identity_stand_ins

    config = resolve_config(
        None,
        flags={
            "data.datasets": list(datasets),
            "model.name": model,
            "data.max_length": max_length,
            "data.format": row_format,
            "data.model_name": model_name,
            "data.model_author": model_author,
        },
        training=training,
    )
    if not training:
        config.data, note = with_identity_stand_ins(config.data)
        if note:
            click.echo(note)
    return config


def _counting_tokenizer(spec: str):
    """The tokenizer the data commands count with (models.load.locate_tokenizer), saying which."""
    from .models.load import load_tokenizer, locate_tokenizer

    path, source = locate_tokenizer(spec)
    click.echo(source)
    return load_tokenizer(spec, path=path)


def _encode(datasets, model, max_length, row_format, model_name, model_author, training):
    from .data import prepare_data

    config = _data_config(datasets, model, max_length, row_format, model_name, model_author, training)
    tokenizer = _counting_tokenizer(config.model.name)
    return tokenizer, prepare_data(config.data, tokenizer)


@data.command("stats")
@data_options
def data_stats(datasets, model, max_length, row_format, model_name, model_author):
    """Token length distribution with the real chat template, and a max_length to use."""
    from .data.stats import dataset_length_stats

    config = _data_config(datasets, model, max_length, row_format, model_name, model_author)
    stats, read = dataset_length_stats(
        config.data.datasets, config.data, _counting_tokenizer(config.model.name), config.train.seed
    )
    click.echo("\n".join(f"format: {spec}: {fmt}" for spec, fmt in read["formats"]))
    click.echo(stats.table())
    if read["problems"]:
        click.echo(f"({read['problems']} rows not usable; `lora-lab data validate` lists them)")


@data.command("encode")
@data_options
@click.option("--output", required=True, type=click.Path(), help="JSONL file to write.")
def data_encode(datasets, model, max_length, row_format, model_name, model_author, output):
    """Write every encoded sample (input_ids, labels) as JSONL."""
    _, prepared = _encode(
        datasets, model, max_length, row_format, model_name, model_author, training=True
    )  # the ids written are what a run trains on
    with open(output, "w") as handle:
        for sample in prepared.train.samples:
            handle.write(
                json.dumps({"origin": sample.origin, "input_ids": sample.input_ids, "labels": sample.labels}) + "\n"
            )
    click.echo(prepared.summary(int(max_length)))
    for problem in prepared.all_problems():
        click.echo(f"  not used: {problem}")
    click.echo(f"wrote {output}")


@data.command("preview")
@data_options
@click.option("--index", default=0, show_default=True, type=int, help="Which sample to show.")
def data_preview(datasets, model, max_length, row_format, model_name, model_author, index):
    """Print one encoded sample with the trained spans marked [[like this]]."""
    from .data.encode import show_trained_spans

    tokenizer, prepared = _encode(datasets, model, max_length, row_format, model_name, model_author, training=False)
    samples = prepared.train.samples
    if not 0 <= index < len(samples):
        raise LoraLabError(f"--index {index}: the data has {len(samples)} usable samples.")
    sample = samples[index]
    click.echo("\n".join(f"format: {spec}: {fmt}" for spec, fmt in prepared.formats))
    click.echo(f"{sample.origin}: {len(sample.input_ids)} tokens, {sample.trained_tokens} trained (inside [[ ]])\n")
    click.echo(show_trained_spans(tokenizer, sample))


@data.command("validate")
@click.argument("datasets", nargs=-1, required=True)
@click.option(
    "--model",
    default=None,
    help="Also encode with this model's chat template, checking lengths and trained tokens (default: structure only).",
)
@click.option("--max-length", default="2048", show_default=True)
@click.option("--format", "row_format", default="auto", show_default=True)
@click.option("--model-name", default=None)
@click.option("--model-author", default=None)
@click.option(
    "--strict/--no-strict",
    default=True,
    show_default=True,
    help="Exit with status 2 if any row has an error (a run would skip it).",
)
@click.option(
    "--task",
    type=click.Choice(["sft", "dpo", "orpo", "simpo", "kto"]),
    default="sft",
    show_default=True,
    help="Check the rows as this --task of `lora-lab run` reads them.",
)
def data_validate(datasets, model, max_length, row_format, model_name, model_author, strict, task):
    """Check datasets row by row; every problem as file:line and reason."""
    from .data import validate_data

    config = _data_config(datasets, model, max_length, row_format, model_name, model_author)
    tokenizer = _counting_tokenizer(config.model.name) if model else None
    report = validate_data(list(datasets), config.data, tokenizer, config.train.seed, task)
    for severity, problems in (("error", report.errors), ("warning", report.warnings)):
        for problem in problems:
            click.echo(f"{problem.origin}: {severity}: {problem.reason}")
    click.echo(report.summary())
    if report.errors and strict:
        raise DataError(
            f"{len(report.errors)} error(s) listed above; a run would skip those "
            f"rows. Fix them, or pass --no-strict to only report."
        )


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--output", type=click.Path(), help="Merged folder (default: RUN_DIR/merged).")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Precision of the merged weights (default: the run's training precision, "
    "fp32 for a CPU run; bf16 for an adapter folder without its run).",
)
@click.option("--force", is_flag=True, help="Replace an existing --output folder.")
@click.option("--served-name", default="finetuned", show_default=True, help="Model name in the printed vLLM commands.")
def merge(path, output, dtype, force, served_name):
    """Merge a run's adapter into its base model (PATH: run folder or adapter folder)."""
    from . import merge_adapter
    from .planning.serving import vllm_commands

    result = merge_adapter(path, output, dtype, force)
    click.echo(result.summary())
    if result.trained_with_quantization != "none":
        click.echo(
            f"note: trained with {result.trained_with_quantization} QLoRA; merged onto "
            f"the 16-bit base, not into 4-bit weights."
        )
    serving = vllm_commands(result, served_name)
    click.echo("\nserve with vLLM:")
    for kind, command in serving["commands"].items():
        click.echo(f"  {kind + ':':<9}{command}")
    for warning in serving["warnings"]:
        click.secho(f"warning: {warning}", fg="yellow")


@main.command()
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
@click.option("--force", is_flag=True, help="Replace an existing --output folder.")
def export(path, fmt, quantize, calib_data, calib_samples, output, gpu_tier, force):
    """Export a merged folder or a run (merged onto its 16-bit base first) for serving: 4-bit
    safetensors for vLLM, or GGUF for llama.cpp and Ollama."""
    from . import export_gguf, export_quantized
    from .use.export import DEFAULT_CALIB_SAMPLES, serving_handoff
    from .use.gguf_export import check_gguf_arguments

    if fmt == "gguf":
        quantize = check_gguf_arguments(quantize, calib_data, calib_samples, gpu_tier)
        result = export_gguf(path, quantize, output, force)
        handoff = result.serving_lines()
    else:
        samples = DEFAULT_CALIB_SAMPLES if calib_samples is None else calib_samples
        result = export_quantized(path, quantize, list(calib_data), samples, output, gpu_tier, force)
        handoff = serving_handoff(result, gpu_tier)
    click.echo(result.summary())
    for warning in result.warnings:
        click.secho(f"warning: {warning}", fg="yellow")
    click.echo("\n" + "\n".join(handoff))


def source_options(func):
    func = click.option(
        "--run", "run_dir", type=click.Path(exists=True), help="Run folder (its adapter on its base model)."
    )(func)
    func = click.option("--adapter", type=click.Path(exists=True), help="Adapter folder.")(func)
    func = click.option("--model", help="Base or merged model (folder, hub id, alias).")(func)
    func = click.option("--dtype", default="auto", show_default=True)(func)
    func = click.option("--max-new-tokens", default=512, show_default=True, type=int)(func)
    func = click.option("--temperature", type=float, help="Default: the model's own.")(func)
    func = click.option("--top-p", type=float)(func)
    func = click.option("--top-k", type=int)(func)
    func = click.option("--repetition-penalty", type=float)(func)
    return click.option("--greedy", is_flag=True, help="Greedy decoding (no sampling).")(func)


def _settings(max_new_tokens, temperature, top_p, top_k, repetition_penalty, greedy):
    from .use.infer import GenerationSettings

    return GenerationSettings(
        max_new_tokens=max_new_tokens,
        do_sample=False if greedy else None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
    )


@main.command()
@source_options
@click.option(
    "--compare",
    is_flag=True,
    help="Answer with the base model and the fine-tuned one side by side (--run or --adapter).",
)
def chat(run_dir, adapter, model, dtype, compare, **generation):
    """Chat in the terminal, streaming tokens. /reset, /system TEXT, /quit."""
    from .use.infer import chat_loop, load_generation_model

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


@main.command()
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
    from .use.infer import load_generation_model, run_inference

    loaded, tokenizer = load_generation_model(run_dir, adapter, model, dtype)
    count = run_inference(loaded, tokenizer, input_path, output_path, _settings(**generation), batch_size)
    click.echo(f"wrote {count} answers to {output_path}")


@main.command("eval")
@click.argument("path", type=click.Path(exists=True))
@click.option("--data", "datasets", multiple=True, required=True, help="Data to evaluate on.")
@click.option("--samples", default=5, show_default=True, help="Generated answers to show.")
@click.option("--output", type=click.Path(), help="JSON report (default RUN_DIR/eval_report.json).")
def evaluate(path, datasets, samples, output):
    """Eval loss and perplexity on assistant tokens, plus generated answers vs references; on
    preference pairs (chosen / rejected) the reward margin and preference accuracy."""
    from . import evaluate_run

    report = evaluate_run(path, list(datasets), samples, output)
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


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def report(run_dir):
    """Plot a run's loss, learning rate, gradient norm, tokens/s and GPU memory against the step
    (PNG files in RUN_DIR/plots/); works while the run trains too."""
    from . import report_run

    click.echo(report_run(run_dir).summary())


@main.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to serve on; any other than loopback asks for a token.",
)
@click.option("--port", default=7860, show_default=True, type=int)
@click.option(
    "--token",
    help="Deprecated (visible in `ps`): the token the page asks for. Prefer $LORA_LAB_UI_TOKEN or --token-file.",
)
@click.option(
    "--token-file",
    type=click.Path(),
    help="A file holding the token the page asks for (default with another --host: a new one, printed).",
)
@click.option("--max-runs", default=1, show_default=True, type=click.IntRange(1), help="Runs the page trains at once.")
@click.option(
    "--allow",
    "allowed",
    multiple=True,
    type=click.Path(),
    help="A folder the page may read and write (models, data, runs). Repeat for more; default: the current folder.",
)
def ui(host, port, token, token_file, max_runs, allowed):
    """A web page to plan, start, watch, resume, chat with and export runs (needs lora-lab[ui])."""
    from .ui import launch_ui

    launch_ui(host, port, token, list(allowed) or ["."], token_file=token_file, max_runs=max_runs)


@main.command()
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
def serve(runs, base, host, port, api_key, api_key_file, dtype, trust_remote_code):
    """An OpenAI-compatible API over runs' adapters of one base (RUN_DIR or NAME=RUN_DIR each;
    the base model answers too). Needs lora-lab[serve]."""
    from .use.serve import read_api_key, serve_runs

    key = read_api_key(api_key, api_key_file)
    serve_runs(list(runs), base, host, port, key, dtype, trust_remote_code)


if __name__ == "__main__":
    main()
