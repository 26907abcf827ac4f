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
import shutil
import time
from pathlib import Path

from ..config import RunConfig, converts_initial_adapter
from ..data import PreparedData, prepare_data
from ..data.arrow import first_token_at_least, sample_lengths, trained_token_count
from ..device import distributed_state, in_launched_worker, peak_memory_per_gpu
from ..errors import LoraLabError, ModelError
from ..log import get_logger
from ..models.load import check_model_files, check_remote_code, choose_precision, load_tokenizer
from ..models.lora import check_full_finetuning_precision, save_converted_adapter
from ..paths import replace_folder
from ..planning.choice import check_fits
from ..planning.disk import check_disk_space
from ..planning.memory import row_length
from ..run_folder import (
    TrainResult,
    check_run_dir,
    checkpoint_step,
    save_config,
    trim_step_log,
    write_data_problems,
    write_summary,
)
from ..run_folder.names import (
    ADAPTER_FOLDER,
    CONFIG_FILE,
    DATA_PROBLEMS,
    INITIAL_ADAPTER_FOLDER,
    LOGS_FOLDER,
    MODEL_FOLDER,
    STEP_LOG,
    TRAINING_ARGS_PICKLE,
)
from .args import count_optimizer_steps
from .builder import TrainingInputs
from .callbacks import StepTimer, ensure_finite
from .checkpoint import OOM_SOURCE, check_drift, data_fingerprint, remove_leftovers, resumed_batch
from .lock import run_lock
from .nodes import agree_across_nodes
from .oom import train_with_oom_retry
from .plan import RunPlan, plan_run
from .plots import report_run
from .process import run_settings
from .trainer import LoraLabTrainer
from .watch import tracker_runs

log = get_logger()


def train(config: RunConfig, plan: RunPlan | None = None) -> TrainResult:
    """Fine-tune config.model on config.data; returns where everything was written.

    `config` is left as it is: the run settles its plan (training/plan.py) once, or takes the
    one given (a launched worker: its launcher's). With config.train.resume the run continues
    from a complete checkpoint, exactly as if it had never stopped, provided the model, data and
    batch settings are the ones it started with.
    """
    started = time.time()
    if config.train.task != "sft":
        from .preference import require_trl

        require_trl()
    plan = plan or plan_run(config)
    with run_settings(plan):  # process-wide settings, put back when the run returns
        return train_in_process(plan, started)


def train_in_process(plan: RunPlan, started: float) -> TrainResult:
    """train(), inside the run's process settings (training/process.py)."""
    precision = choose_precision(plan.precision)  # refuses a forced dtype this machine lacks
    if plan.config.train.tuner == "full":
        check_full_finetuning_precision(precision)
    state = distributed_state(precision)
    check_remote_code(plan.model.path, plan.config.model.trust_remote_code)
    check_model_files(plan.model.path)  # before the data are encoded
    with contextlib.ExitStack() as hold:
        if not in_launched_worker():  # a launched run's folder is held by its launcher
            hold.enter_context(run_lock(plan.folder))
        return train_in_folder(plan, precision, state, started)


def train_in_folder(plan: RunPlan, precision, state, started: float) -> TrainResult:
    """train(), from the moment the run folder is fixed and held."""
    check_run_dir(plan.folder, plan.config, plan.resume_from)
    plan, inputs = prepare_inputs(plan, state)
    open_run_dir(plan, inputs.data, inputs.fingerprint, state.is_main_process, state.wait_for_everyone)
    state.wait_for_everyone()
    with tracker_runs(plan.folder, plan.config.train.report_to, state.is_main_process):
        trainer, train_loss, plan = train_with_oom_retry(plan, inputs, precision)
        eval_loss = trainer.evaluate()["eval_loss"] if inputs.data.val else None
    saved_dir = finish_weights(plan, trainer, precision, state)
    full = plan.config.train.tuner == "full"
    result = TrainResult(
        run_dir=plan.folder,
        adapter_dir=None if full else saved_dir,
        model_dir=saved_dir if full else None,
        global_step=trainer.state.global_step,
        train_loss=train_loss,
        eval_loss=eval_loss,
        train_samples=len(inputs.data.train.samples),
        trained_tokens=trained_token_count(inputs.data.train.samples),
        seconds=round(time.time() - started, 1),
        nonfinite_skipped_steps=trainer.guard.skipped_steps,
    )
    summarize(result, trainer, state)
    return result


def prepare_inputs(plan: RunPlan, state) -> tuple[RunPlan, TrainingInputs]:
    """Tokenizer and data, checked against the model and agreed across nodes; returns the plan
    with the resumed batch and the rows' memory means settled, and what it trains on."""
    config = plan.config
    tokenizer = load_tokenizer(config.model.name, config.model.trust_remote_code, plan.model.path)
    data = prepare_data(config.data, tokenizer, config.train.seed, config.train.task)
    report_data(data, config.data.max_length)
    check_token_ids(plan, data, tokenizer)
    fingerprint = data.train.fingerprint or data_fingerprint(data.train.samples)
    agree_across_nodes(config, plan.folder, fingerprint)  # before rank 0 writes into the folder
    if state.is_main_process:
        remove_unfinished_saves(plan.folder)  # before the disk check counts the free space
    if plan.resume_from is not None:
        plan = resumed_plan(plan)
    packed = pack_training_data(plan.config, data) if plan.config.data.packing else None
    plan = plan.with_rows(longest_row(data, packed))
    check_gpu_memory(plan)
    check_disk_space(plan.config, plan.folder, count_optimizer_steps(plan.config, len(data.train.samples)))
    return plan, TrainingInputs(data, packed, tokenizer, fingerprint)


def finish_weights(plan: RunPlan, trainer: LoraLabTrainer, precision, state) -> Path:
    """The final adapter/ (or model/) of the trained run; returns its folder."""
    config, run_dir = plan.config, plan.folder
    full = config.train.tuner == "full"
    saved_dir = run_dir / (MODEL_FOLDER if full else ADAPTER_FOLDER)
    ensure_finite(trainer.model, "the model" if full else "the adapter")
    if full and precision.name == "bf16" and plan.engine == "ddp":
        trainer.model.to(precision.torch_dtype)  # type: ignore[union-attr]  # the trainer holds its model; trained on fp32 master weights; saved in bf16
    initial = run_dir / INITIAL_ADAPTER_FOLDER if converts_initial_adapter(config.lora) and not full else None
    save_final_weights(trainer, saved_dir, state, initial)
    return saved_dir


def summarize(result: TrainResult, trainer: LoraLabTrainer, state) -> None:
    """run_summary.json and the plots (rank 0), and a word on skipped updates."""
    timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepTimer))
    peaks = peak_memory_per_gpu(timer)
    if state.is_main_process:
        write_summary(result, timer, peaks, trainer.memory_means)
        try:
            log.info(report_run(result.run_dir).summary())
        except LoraLabError as exc:  # the run itself is complete
            log.warning(f"warning: no plots: {exc}")
    state.wait_for_everyone()
    if result.nonfinite_skipped_steps:
        log.warning(
            f"warning: skipped {len(result.nonfinite_skipped_steps)} update(s) with a "
            f"NaN or inf loss or gradient, at steps {result.nonfinite_skipped_steps}"
        )


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
        (staging / TRAINING_ARGS_PICKLE).unlink(missing_ok=True)
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


def check_token_ids(plan: RunPlan, data: PreparedData, tokenizer) -> None:
    """Every id the model will read (the samples' and the padding's) is a row of its input
    embedding (vocab_size in config.json): a tokenizer of another model, or tokens added to the
    tokenizer without resizing the embedding, stop here rather than inside the forward pass."""
    rows = plan.model.vocab_size
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
            f"--model {plan.model.spec}: the tokenizer gives token id {token} "
            f"({tokenizer.convert_ids_to_tokens(token)!r}, in {where}), but the model's input "
            f"embedding has {rows} rows (vocab_size in {plan.model.path}/config.json): the tokenizer "
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


def check_gpu_memory(plan: RunPlan) -> None:
    """On a GPU, stop before loading the model if the planner says the run will not fit the GPU
    or this machine's RAM."""
    if not (plan.config.train.memory_check and plan.gpu_gib is not None):
        return
    memory = check_fits(plan.planner_config, plan.gpu_gib, plan.row_tokens, plan.cpu_gib)
    if memory:
        hint = memory.room_hint()
        log.info(
            f"memory plan: about {memory.total_gib:.1f} GiB of {memory.budget_gib:.1f} usable"
            + (f"; {hint}" if hint else "")
        )


def remove_unfinished_saves(run_dir: Path) -> None:
    """Finish or delete what a killed save left behind (training/checkpoint.py)."""
    if run_dir.is_dir():
        for folder in remove_leftovers(run_dir):
            log.info(f"removed {folder} (a save that never finished)")


def resumed_plan(plan: RunPlan) -> RunPlan:
    """A run that moved to a smaller micro-batch after running out of memory resumes with it: a
    new plan of that batch."""
    batch = resumed_batch(plan.folder, plan.config)
    if batch is None:
        return plan
    log.info(
        f"resuming with micro-batch {batch[0]} x grad-accum {batch[1]}, as the run did after running out of memory"
    )
    values = {"train.micro_batch_size": batch[0], "train.grad_accum": batch[1]}
    return plan.with_config(plan.config.with_changes(values, OOM_SOURCE))


def open_run_dir(
    plan: RunPlan, data: PreparedData, fingerprint: dict, is_main_process: bool = True, wait=lambda: None
) -> None:
    """Refuse drift, then (re)write config.yaml and the data report; trim the step log.

    Every rank checks (so that all of them stop on drift), and all have read config.yaml
    (`wait`: a barrier) before the main process alone rewrites it."""
    config, run_dir, resume_from = plan.config, plan.folder, plan.resume_from
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
        step = (checkpoint_step(resume_from) or 0) if resume_from else 0
        trim_step_log(run_dir / STEP_LOG, step)
        if resume_from:
            log.info(f"resuming from {resume_from} (step {step})")
