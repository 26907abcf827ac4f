"""The training orchestrator: config in, run folder out.

train(config) checks everything it can before loading the model (precision, remote code, the run
folder, the data, the memory plan, the disk), then trains with a LoraLabTrainer, retrying with a
smaller micro-batch on CUDA out-of-memory, and writes the final weights and run_summary.json.

With several processes (accelerate launch) every rank trains and reads the run folder, but only
global rank 0 (accelerate's is_main_process, not the per-machine is_local_main_process) writes
into it; each process adds its own RNG state (and the engine its shards) to a checkpoint. Ranks
wait for each other where one reads what another wrote. On several nodes the processes first
agree on config, data and run folder (training/nodes.py).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from pathlib import Path

from ..config import RunConfig, converts_initial_adapter, resolve_fast_lora
from ..data import PreparedData, prepare_data
from ..data.arrow import first_token_at_least, sample_lengths, trained_token_count
from ..data.collate import PACKED_FIELDS, PackedCollator, PadCollator, SupervisedDataset
from ..device import (
    distributed_state,
    gpu_memory_gib,
    in_launched_worker,
    peak_memory_per_gpu,
    release_memory,
    world_size,
)
from ..errors import LoraLabError, ModelError, TrainingError
from ..log import get_logger
from ..models.attention import as_planned, resolve_packed_attention
from ..models.fast_lora import FastLoraOptions
from ..models.kernels import resolve_kernels
from ..models.load import (
    LoadOptions,
    Precision,
    check_model_files,
    check_remote_code,
    choose_precision,
    load_base_model,
    load_tokenizer,
    locate_model,
)
from ..models.lora import (
    LoraOptions,
    apply_lora,
    check_full_finetuning_precision,
    prepare_full_finetuning,
    prepare_quantized_for_training,
    save_converted_adapter,
    save_initial_adapter,
    template_token_ids,
)
from ..paths import replace_folder, staged_folder
from ..planning.choice import check_fits
from ..planning.disk import check_disk_space
from ..planning.memory import choose_memory_means, row_length, usable_gib
from ..registry import family_of, missing_fast_paths, model_config_of, wants_trainable_tokens
from ..run_folder import (
    ADAPTER_FOLDER,
    CONFIG_FILE,
    DATA_PROBLEMS,
    INITIAL_ADAPTER_FOLDER,
    LOGS_FOLDER,
    MODEL_FOLDER,
    STEP_LOG,
    Checkpoint,
    TrainResult,
    check_run_dir,
    checkpoint_step,
    fix_run_dir,
    locate_run_dir,
    record_stop,
    save_config,
    stop_error,
    trim_step_log,
    write_data_problems,
    write_summary,
)
from .args import build_training_arguments, count_optimizer_steps
from .callbacks import NonFiniteGuard, StepTimer, StopOnSignal, ensure_finite, run_callbacks
from .checkpoint import (
    OOM_SOURCE,
    check_drift,
    data_fingerprint,
    find_resume_checkpoint,
    remove_leftovers,
    resolve_resume,
    resumed_batch,
)
from .lock import run_lock
from .nodes import agree_across_nodes
from .plots import report_run
from .process import run_settings
from .trainer import LoraLabTrainer, saved_loss_sum
from .watch import tracker_runs

log = get_logger()
SHARDED_ENGINES = ("deepspeed-zero3", "deepspeed-zero3-offload", "fsdp")
"""Engines that shard the parameters themselves: the model is loaded without a device_map."""


def train(config: RunConfig) -> TrainResult:
    """Fine-tune config.model on config.data; returns where everything was written.

    With config.train.resume the run continues from a complete checkpoint, exactly as if it had
    never stopped, provided the model, data and batch settings are the ones it started with.
    The config is updated with what the run settles (its folder, an out-of-memory batch).
    """
    with run_settings(config):  # process-wide settings, put back when the run returns
        return train_in_process(config)


def train_in_process(config: RunConfig) -> TrainResult:
    """train(), inside the run's process settings (training/process.py)."""
    started = time.time()
    precision = choose_precision(config.model.dtype)
    settle_precision(config, precision)
    if config.train.tuner == "full":
        check_full_finetuning_precision(precision)
    state = distributed_state(precision)
    if config.train.task != "sft":
        from .preference import require_trl, settle_from_run

        require_trl()
        settle_from_run(config)
    model_path = locate_model(config.model.name)
    check_remote_code(model_path, config.model.trust_remote_code)
    check_model_files(model_path)  # before the data are encoded
    run_dir = locate_run_dir(config)
    fix_run_dir(config, run_dir)
    with contextlib.ExitStack() as hold:
        if not in_launched_worker():  # a launched run's folder is held by its launcher
            hold.enter_context(run_lock(run_dir))
        return train_in_folder(config, run_dir, precision, state, model_path, started)


def settle_precision(config: RunConfig, precision: Precision) -> None:
    """--dtype auto becomes the precision chosen here, so that config.yaml records what the run
    trained in (`lora-lab merge` merges in it by default)."""
    if config.model.dtype == "auto":
        config.model.dtype = precision.name
        config.sources["model.dtype"] = "auto (CPU)" if precision.name == "fp32" else "auto (GPU)"


def train_in_folder(
    config: RunConfig, run_dir: Path, precision: Precision, state, model_path: str, started: float
) -> TrainResult:
    """train(), from the moment the run folder is fixed and held."""
    resume_from = resolve_resume(config.train.resume, run_dir) if config.train.resume else None
    check_run_dir(run_dir, config, resume_from)
    tokenizer = load_tokenizer(config.model.name, config.model.trust_remote_code, model_path)
    data = prepare_data(config.data, tokenizer, config.train.seed, config.train.task)
    report_data(data, config.data.max_length)
    check_token_ids(config.model.name, model_path, data, tokenizer)
    fingerprint = data.train.fingerprint or data_fingerprint(data.train.samples)
    agree_across_nodes(config, run_dir, fingerprint)  # before rank 0 writes into the folder
    if state.is_main_process:
        remove_unfinished_saves(run_dir)  # before the disk check counts the free space
    if resume_from is not None:
        adopt_resumed_batch(config, run_dir)
    packed = pack_training_data(config, data) if config.data.packing else None
    check_gpu_memory(config, longest_row(data, packed))
    check_disk_space(config, run_dir, count_optimizer_steps(config, len(data.train.samples)))
    open_run_dir(config, run_dir, data, resume_from, fingerprint, state.is_main_process, state.wait_for_everyone)
    state.wait_for_everyone()
    with tracker_runs(run_dir, config.train.report_to, state.is_main_process):
        trainer, train_loss = train_with_oom_retry(
            config, data, packed, tokenizer, precision, run_dir, resume_from, fingerprint, model_path
        )
        eval_loss = trainer.evaluate()["eval_loss"] if data.val else None
    full = config.train.tuner == "full"
    saved_dir = run_dir / (MODEL_FOLDER if full else ADAPTER_FOLDER)
    ensure_finite(trainer.model, "the model" if full else "the adapter")
    if full and precision.name == "bf16" and config.train.engine == "ddp":
        trainer.model.to(precision.torch_dtype)  # trained on fp32 master weights; saved in bf16
    save_final_weights(
        trainer,
        saved_dir,
        state,
        run_dir / INITIAL_ADAPTER_FOLDER if converts_initial_adapter(config.lora) and not full else None,
    )
    result = TrainResult(
        run_dir=run_dir,
        adapter_dir=None if full else saved_dir,
        model_dir=saved_dir if full else None,
        global_step=trainer.state.global_step,
        train_loss=train_loss,
        eval_loss=eval_loss,
        train_samples=len(data.train.samples),
        trained_tokens=trained_token_count(data.train.samples),
        seconds=round(time.time() - started, 1),
        nonfinite_skipped_steps=trainer.guard.skipped_steps,
    )
    timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepTimer))
    peaks = peak_memory_per_gpu(timer)
    if state.is_main_process:
        write_summary(result, timer, peaks, trainer.memory_means)
        try:
            log.info(report_run(run_dir).summary())
        except LoraLabError as exc:  # the run itself is complete
            log.warning(f"warning: no plots: {exc}")
    state.wait_for_everyone()
    if result.nonfinite_skipped_steps:
        log.warning(
            f"warning: skipped {len(result.nonfinite_skipped_steps)} update(s) with a "
            f"NaN or inf loss or gradient, at steps {result.nonfinite_skipped_steps}"
        )
    return result


def save_final_weights(trainer: LoraLabTrainer, saved_dir: Path, state, initial_adapter: Path | None = None) -> None:
    """adapter/ (or model/), staged and put in place whole: a kill during the save leaves the
    folder as it was. Trainer.save_model gathers sharded weights (ZeRO-3, FSDP) and writes on
    rank 0 only: weights, tokenizer, and a pickled training_args.bin that is removed.
    initial_adapter (lora.init pissa / olora): the adapter is saved converted against it, so
    that it applies to the original base."""
    staging = saved_dir.with_name(saved_dir.name + ".partial")
    if state.is_main_process and staging.exists():
        shutil.rmtree(staging)
    state.wait_for_everyone()
    trainer.save_model(str(staging))
    if state.is_main_process:
        if initial_adapter is not None:
            save_converted_adapter(trainer.model, staging, initial_adapter)
        (staging / "training_args.bin").unlink(missing_ok=True)
        replace_folder(staging, saved_dir)
    state.wait_for_everyone()


# ----------------------------------------------------------------------------- before training


def report_data(data: PreparedData, max_length: int) -> None:
    log.info(data.summary(max_length))
    problems = data.all_problems()
    for problem in problems[:10]:
        log.info(f"  skipped {problem}")
    for warning in data.all_warnings()[:10]:
        log.info(f"  warning: {warning}")
    if len(problems) > 10 or len(data.all_warnings()) > 10:
        log.info(f"  ... the full list is in {DATA_PROBLEMS}")


def check_token_ids(spec: str, model_path: str, data: PreparedData, tokenizer) -> None:
    """Every id the model will read (the samples' and the padding's) is a row of its input
    embedding (vocab_size in config.json): a tokenizer of another model, or tokens added to the
    tokenizer without resizing the embedding, stop here rather than inside the forward pass."""
    rows = (model_config_of(model_path) or {}).get("vocab_size")
    if not rows:
        return
    found = next(
        filter(None, (first_token_at_least(report.samples, rows) for report in (data.train, data.val) if report)), None
    )
    if found is None and (tokenizer.pad_token_id or 0) >= rows:
        found = ("the padding (the tokenizer's pad token)", tokenizer.pad_token_id)
    if found is not None:
        where, token = found
        raise ModelError(
            f"--model {spec}: the tokenizer gives token id {token} "
            f"({tokenizer.convert_ids_to_tokens(token)!r}, in {where}), but the model's input "
            f"embedding has {rows} rows (vocab_size in {model_path}/config.json): the tokenizer "
            f"is not the one these weights were trained with. Use the model's own tokenizer, or "
            f"resize the embedding (model.resize_token_embeddings) after adding tokens to it."
        )


def pack_training_data(config: RunConfig, data: PreparedData):
    """data.packing: the training samples packed into rows (data/packing.py)."""
    from ..data.packing import pack_samples

    t = config.train
    return pack_samples(data.train.samples, t.micro_batch_size * t.grad_accum, row_length(config), t.seed)


def longest_row(data: PreparedData, packed=None) -> int:
    """Tokens in the longest training row: a packed row, or the longest sample."""
    if packed is not None:
        return packed.longest_row
    return max(sample_lengths(data.train.samples))


def check_gpu_memory(config: RunConfig, longest_row_tokens: int) -> None:
    """On a GPU, stop before loading the model if the planner says the run will not fit."""
    gpu_gib = gpu_memory_gib()
    if not (config.train.memory_check and gpu_gib is not None):
        return
    plan = check_fits(as_planned(config), gpu_gib, longest_row_tokens)
    if plan:
        hint = plan.room_hint()
        log.info(
            f"memory plan: about {plan.total_gib:.1f} GiB of {plan.budget_gib:.1f} usable"
            + (f"; {hint}" if hint else "")
        )


def remove_unfinished_saves(run_dir: Path) -> None:
    """Finish or delete what a killed save left behind (training/checkpoint.py)."""
    if run_dir.is_dir():
        for folder in remove_leftovers(run_dir):
            log.info(f"removed {folder} (a save that never finished)")


def adopt_resumed_batch(config: RunConfig, run_dir: Path) -> None:
    """A run that moved to a smaller micro-batch after running out of memory resumes with it."""
    batch = resumed_batch(run_dir, config)
    if batch is None:
        return
    log.info(
        f"resuming with micro-batch {batch[0]} x grad-accum {batch[1]}, as the run did after running out of memory"
    )
    config.train.micro_batch_size, config.train.grad_accum = batch
    config.sources["train.micro_batch_size"] = config.sources["train.grad_accum"] = OOM_SOURCE


def open_run_dir(
    config: RunConfig,
    run_dir: Path,
    data: PreparedData,
    resume_from: Path | None,
    fingerprint: dict,
    is_main_process: bool = True,
    wait=lambda: None,
) -> None:
    """Refuse drift, then (re)write config.yaml and the data report; trim the step log.

    Every rank checks (so that all of them stop on drift), and all have read config.yaml
    (`wait`: a barrier) before the main process alone rewrites it."""
    if resume_from is not None:
        for change in check_drift(run_dir, resume_from, config, fingerprint):
            log.warning(f"warning: --allow-config-change: {change}")
    wait()
    if not is_main_process:
        return
    (run_dir / LOGS_FOLDER).mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / CONFIG_FILE)
    write_data_problems(run_dir, data)
    if config.train.resume:
        step = checkpoint_step(resume_from) if resume_from else 0
        trim_step_log(run_dir / STEP_LOG, step)
        if resume_from:
            log.info(f"resuming from {resume_from} (step {step})")


# ----------------------------------------------------------------------------- training


def finish_from_checkpoint(trainer: LoraLabTrainer, checkpoint: Path) -> float:
    """A checkpoint at the run's last step: the training is done. Its weights and state are
    loaded as they are (training again would add a step past --max-steps); returns the mean
    step loss it recorded."""
    from transformers import TrainerState

    log.info(f"{checkpoint.name} is the run's last step: training is complete; writing the final weights from it")
    trainer._load_from_checkpoint(str(checkpoint))
    trainer.state = TrainerState.load_from_json(str(Checkpoint(checkpoint).trainer_state))
    steps = max(trainer.state.global_step, 1)
    return saved_loss_sum(checkpoint) / steps


def say_family(model_type: str | None) -> None:
    """One line on the family's fast paths when lora-lab lacks some for it."""
    family = family_of(model_type)
    missing = missing_fast_paths(family)
    if missing:
        log.info(
            f"model_type {model_type!r} ({family.name}): trains on the generic path, without {' and '.join(missing)}"
        )


def build_trainer(
    config: RunConfig,
    data: PreparedData,
    packed,
    tokenizer,
    precision: Precision,
    run_dir: Path,
    fingerprint: dict,
    model_path: str,
    resume_from: Path | None = None,
) -> LoraLabTrainer:
    from transformers import set_seed

    set_seed(config.train.seed)  # the LoRA initialisation is part of the run's seed
    total_steps = count_optimizer_steps(config, len(data.train.samples))
    # TrainingArguments first: with ZeRO-3 they must exist when the model loads, so that
    # transformers partitions the weights while loading (HfDeepSpeedConfig).
    args = build_training_arguments(
        config,
        run_dir,
        precision,
        total_steps,
        data.val is not None,
        packed.rows_per_step if packed else None,
        **preference_arguments(config),
    )
    full = config.train.tuner == "full"
    attention = resolve_packed_attention(config.data.packed_attention)
    preference = config.train.task != "sft"
    tokens = (
        template_token_ids(tokenizer)
        if wants_trainable_tokens(config.lora.trainable_tokens, config.train.tuner, config.model.name)
        and not preference
        else None
    )  # TRL computes log-probs from the head's weight itself
    loading = LoadOptions(
        fp32_master_weights=full,
        sharded=config.train.engine in SHARDED_ENGINES,
        packed_attention=attention if packed else None,
        path=model_path,
        fused_loss=not (tokens or preference),
    )
    model = load_base_model(config.model, precision, loading)
    say_family(model.config.model_type)
    memory_means = "none"  # full fine-tuning: the engines' own checkpointing
    if full:
        model = prepare_full_finetuning(model, config.train.gradient_checkpointing)
        total = sum(p.numel() for p in model.parameters())
        log.info(f"precision {precision.name} (fp32 master weights); full fine-tuning: all {total:,} parameters train")
    else:
        if config.model.quantization == "nf4":
            model = prepare_quantized_for_training(model)
        gpu_gib = gpu_memory_gib()
        means = choose_memory_means(
            as_planned(config),
            on_gpu=gpu_gib is not None,
            tied_embeddings=model.config.tie_word_embeddings,
            row_tokens=longest_row(data, packed),
            budget_gib=usable_gib(gpu_gib),
        )
        fast = resolve_fast_lora(config)
        building = LoraOptions(
            gradient_checkpointing=config.train.gradient_checkpointing,
            means=means,
            fast=FastLoraOptions.of(config.model) if fast else None,
            offload_copy_stream=config.train.offload_copy_stream and gpu_gib is not None,
            trainable_tokens=tuple(tokens) if tokens else None,
            tuner=config.train.tuner,
            adapter_dir=from_run_adapter(config),
        )
        model = apply_lora(model, config.lora, building)
        initial = run_dir / INITIAL_ADAPTER_FOLDER
        if converts_initial_adapter(config.lora) and not initial.is_dir() and args.should_save:
            with staged_folder(initial) as staging:
                save_initial_adapter(model, staging)
        if tokens:
            log.info(
                f"lora.trainable_tokens: the embedding rows of the template's "
                f"{len(tokens)} special tokens train too "
                f"({' '.join(tokenizer.convert_ids_to_tokens(tokens))})"
            )
        memory_means = means.describe()
        trainable, total = model.get_nb_trainable_parameters()
        log.info(
            f"precision {precision.name}; {describe_tuner(config)}: {trainable:,} "
            f"trainable of {total:,} parameters; "
            f"kernels {resolve_kernels(config.model.kernels)}"
            f"{', fast LoRA' if fast else ''}; memory means: {memory_means}"
            + (f"; packed rows attend with {attention}" if packed else "")
        )
    guard = NonFiniteGuard(config.train.on_nonfinite, precision.name, run_dir)
    lora_lab = {
        "guard": guard,
        "train_data": fingerprint,
        "memory_means": memory_means,
        "resumed_loss_sum": saved_loss_sum(resume_from),
        "loraplus_lr_ratio": config.train.loraplus_lr_ratio,
    }
    if preference:
        from .preference import build_preference_trainer

        return build_preference_trainer(
            config,
            model,
            args,
            data.train.samples,
            data.val.samples if data.val else None,
            tokenizer,
            run_callbacks(run_dir, config.train.report_to),
            **lora_lab,
        )
    return LoraLabTrainer(
        model=model,
        args=args,
        train_dataset=SupervisedDataset(packed.rows, PACKED_FIELDS)
        if packed
        else SupervisedDataset(data.train.samples),
        eval_dataset=SupervisedDataset(data.val.samples) if data.val else None,
        data_collator=PackedCollator(tokenizer.pad_token_id, attention)
        if packed
        else PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=run_callbacks(run_dir, config.train.report_to),
        **lora_lab,
    )


def describe_tuner(config: RunConfig) -> str:
    """The adapter in words, for the training log: "DoRA r=8 alpha=32 (rsLoRA, init pissa)"."""
    lora, tuner = config.lora, config.train.tuner
    if tuner == "ia3":
        return "IA3"
    extras = [
        name
        for name, on in (
            ("rsLoRA", lora.use_rslora),
            (f"init {lora.init}", lora.init != "default"),
            (f"LoRA+ ratio {config.train.loraplus_lr_ratio:g}", config.train.loraplus_lr_ratio > 0),
        )
        if on
    ]
    return f"{'DoRA' if tuner == 'dora' else 'LoRA'} r={lora.rank} alpha={lora.alpha:g}" + (
        f" ({', '.join(extras)})" if extras else ""
    )


def preference_arguments(config: RunConfig) -> dict:
    """A preference task's TRL config class and settings for build_training_arguments."""
    if config.train.task == "sft":
        return {}
    from .preference import task_settings, trainer_config

    return {"args_class": trainer_config(config.train.task), **task_settings(config)}


def from_run_adapter(config: RunConfig):
    """--from-run: the SFT run's adapter folder, which this run continues."""
    if not config.train.from_run:
        return None
    from ..run_folder import read_sft_run

    return read_sft_run(config.train.from_run)[0]


def train_with_oom_retry(
    config: RunConfig,
    data: PreparedData,
    packed,
    tokenizer,
    precision: Precision,
    run_dir: Path,
    resume_from: Path | None,
    fingerprint: dict,
    model_path: str,
) -> tuple[LoraLabTrainer, float]:
    """Train; on CUDA out-of-memory halve the micro-batch (same effective batch) and resume.
    Returns the trainer and the mean loss over every step of the run (a resumed one too)."""
    import torch

    total_steps = count_optimizer_steps(config, len(data.train.samples))
    while True:
        if packed is not None:
            log.info(packed.summary())
        try:
            trainer = build_trainer(
                config, data, packed, tokenizer, precision, run_dir, fingerprint, model_path, resume_from
            )
        except torch.cuda.OutOfMemoryError:
            raise TrainingError(
                f"out of GPU memory while loading {config.model.name} "
                f"({precision.name}): the weights alone do not fit. Use "
                f"--quantization nf4 (QLoRA), or a preset for a smaller "
                f"model."
            ) from None
        if resume_from is not None and checkpoint_step(resume_from) >= total_steps:
            return trainer, finish_from_checkpoint(trainer, resume_from)
        try:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            stop_if_signalled(trainer, run_dir)
            steps = max(trainer.state.global_step, 1)
            return trainer, (trainer.resumed_loss_sum + trainer._total_loss_scalar) / steps
        except torch.cuda.OutOfMemoryError:
            step = trainer.state.global_step + 1
            if world_size() > 1:
                raise TrainingError(
                    f"out of GPU memory at step {step} in one of {world_size()} processes "
                    f"(--micro-batch-size {config.train.micro_batch_size}); with several GPUs "
                    f"lora-lab does not retry. Continue with --micro-batch-size "
                    f"{max(1, config.train.micro_batch_size // 2)} and a doubled --grad-accum "
                    f"(--resume auto), or an engine that shards more (--engine "
                    f"deepspeed-zero3)."
                ) from None
        trainer = None
        release_memory()
        shrink_batch_after_oom(config, step, precision)
        save_config(config, run_dir / CONFIG_FILE)
        if packed is not None:  # the row length follows the micro-batch
            packed = pack_training_data(config, data)
        resume_from = find_resume_checkpoint(run_dir)
        trim_step_log(run_dir / STEP_LOG, checkpoint_step(resume_from) if resume_from else 0)
        log.info(f"resuming from {resume_from}" if resume_from else "no checkpoint yet; starting over")


def stop_if_signalled(trainer: LoraLabTrainer, run_dir: Path) -> None:
    """After a SIGTERM / SIGINT stop (callbacks.StopOnSignal): say where the run can continue."""
    stop = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StopOnSignal))
    if stop.received is None:
        return
    step = trainer.state.global_step
    if trainer.is_world_process_zero():
        raise record_stop(run_dir, stop.received, step)
    raise stop_error(run_dir, stop.received, step)


def shrink_batch_after_oom(config: RunConfig, step: int, precision: Precision) -> None:
    """Halve micro_batch_size and double grad_accum, or stop with what to change."""
    t = config.train
    if t.micro_batch_size == 1:
        raise TrainingError(
            f"out of GPU memory at step {step} even with --micro-batch-size 1 "
            f"({config.model.name}, {precision.name}, --max-length {config.data.max_length}). "
            f"Lower --max-length (e.g. {max(8, config.data.max_length // 2)}), use a preset for a "
            f"smaller GPU or a smaller model, or --quantization nf4 (QLoRA)."
        )
    if not t.oom_retry:
        raise TrainingError(
            f"out of GPU memory at step {step} with --micro-batch-size {t.micro_batch_size}. "
            f"Continue with --micro-batch-size {t.micro_batch_size // 2} --grad-accum "
            f"{t.grad_accum * 2} --resume auto (same effective batch), or pass --oom-retry to "
            f"let lora-lab do that itself."
        )
    before, effective = (t.micro_batch_size, t.grad_accum), t.micro_batch_size * t.grad_accum
    t.micro_batch_size = t.micro_batch_size // 2
    t.grad_accum = math.ceil(effective / t.micro_batch_size)
    config.sources["train.micro_batch_size"] = config.sources["train.grad_accum"] = OOM_SOURCE
    kept = t.micro_batch_size * t.grad_accum
    same = (
        f"same effective batch of {effective}"
        if kept == effective
        else f"effective batch {effective} -> {kept}: {effective} has no whole half"
    )
    log.warning(
        f"warning: out of GPU memory at step {step} with micro-batch {before[0]} x "
        f"grad-accum {before[1]}; retrying with micro-batch {t.micro_batch_size} x "
        f"grad-accum {t.grad_accum} ({same})."
    )
