"""Training with the out-of-memory retry: on CUDA out-of-memory the run goes on under a new plan
with half the micro-batch and twice the gradient accumulation (the same effective batch),
recorded in config.yaml, from its last checkpoint."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ..data.packing import pack_samples
from ..device import release_memory, world_size
from ..errors import TrainingError
from ..log import get_logger
from ..models.load import Precision
from ..planning.generation import generation_sequences
from ..planning.memory import row_length
from ..run_folder import Checkpoint, checkpoint_step, record_stop, save_config, stop_error, trim_step_log
from ..run_folder.names import CONFIG_FILE, STEP_LOG
from .args import count_optimizer_steps
from .builder import TrainingInputs, build_trainer
from .callbacks import StopOnSignal
from .checkpoint import OOM_SOURCE, find_resume_checkpoint
from .plan import RunPlan
from .trainer import LoraLabTrainer, saved_loss_sum

log = get_logger()


def train_with_oom_retry(
    plan: RunPlan, inputs: TrainingInputs, precision: Precision
) -> tuple[LoraLabTrainer, float, RunPlan]:
    """Train; on CUDA out-of-memory go on under the halved plan (same effective batch) from the
    last checkpoint. Returns the trainer, the mean loss over every step of the run (a resumed one
    too) and the plan it finished under."""
    import torch

    total_steps = count_optimizer_steps(plan.config, len(inputs.data.train.samples))
    while True:
        if inputs.packed is not None:
            log.info(inputs.packed.summary())
        trainer = load_trainer(plan, inputs, precision)
        resume_from = plan.resume_from
        if resume_from is not None and (checkpoint_step(resume_from) or 0) >= total_steps:
            return trainer, finish_from_checkpoint(trainer, resume_from), plan
        try:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            stop_if_signalled(trainer, plan.folder)
            steps = max(trainer.state.global_step, 1)
            return trainer, (trainer.resumed_loss_sum + trainer._total_loss_scalar) / steps, plan
        except torch.cuda.OutOfMemoryError:
            step = trainer.state.global_step + 1
            refuse_retry_on_several(plan, step)
        del trainer
        release_memory()
        plan, inputs = retry_plan(plan, inputs, step, precision)


def load_trainer(plan: RunPlan, inputs: TrainingInputs, precision: Precision) -> LoraLabTrainer:
    """build_trainer, with out-of-memory while loading said as what it is."""
    import torch

    try:
        return build_trainer(plan, inputs, precision)
    except torch.cuda.OutOfMemoryError:
        raise TrainingError(
            f"out of GPU memory while loading {plan.config.model.name} "
            f"({precision.name}): the weights alone do not fit. Use "
            f"--quantization nf4 (QLoRA), or a preset for a smaller "
            f"model."
        ) from None


def refuse_retry_on_several(plan: RunPlan, step: int) -> None:
    """With several processes lora-lab does not retry: say how to continue."""
    if world_size() <= 1:
        return
    batch = plan.config.train.micro_batch_size
    raise TrainingError(
        f"out of GPU memory at step {step} in one of {world_size()} processes "
        f"(--micro-batch-size {batch}); with several GPUs "
        f"lora-lab does not retry. Continue with --micro-batch-size "
        f"{max(1, batch // 2)} and a doubled --grad-accum "
        f"(--resume auto), or an engine that shards more (--engine "
        f"deepspeed-zero3)."
    ) from None


def retry_plan(
    plan: RunPlan, inputs: TrainingInputs, step: int, precision: Precision
) -> tuple[RunPlan, TrainingInputs]:
    """The plan to go on under after out-of-memory at `step`, recorded in config.yaml, with the
    rows repacked for its micro-batch and its resume point the newest checkpoint."""
    longest_sample = plan.row_tokens
    plan = halved_plan(plan, step, precision)
    save_config(plan.config, plan.folder / CONFIG_FILE)
    if inputs.packed is not None:  # the row length follows the micro-batch
        t = plan.config.train
        packed = pack_samples(
            inputs.data.train.samples, t.micro_batch_size * t.grad_accum, row_length(plan.config), t.seed
        )
        inputs = replace(inputs, packed=packed)
    resume_from = find_resume_checkpoint(plan.folder)
    trim_step_log(plan.folder / STEP_LOG, (checkpoint_step(resume_from) or 0) if resume_from else 0)
    log.info(f"resuming from {resume_from}" if resume_from else "no checkpoint yet; starting over")
    rows = longest_sample if inputs.packed is None else inputs.packed.longest_row
    assert rows is not None  # the plan trained with its rows settled (run.prepare_inputs)
    return replace(plan, resume_from=resume_from).with_rows(rows), inputs


def _generation_hint(config) -> str:
    """--task grpo: the generation batch, which a smaller micro-batch does not shrink."""
    if config.train.task != "grpo":
        return ""
    t, completion = config.train, config.grpo.max_completion_length
    return (
        f"--task grpo generates the step's {generation_sequences(t.micro_batch_size, t.grad_accum)} completions of up to {completion} "
        f"tokens at once, whatever the micro-batch: lower --max-completion-length (e.g. {max(1, completion // 2)}) "
        f"or the completions a step (--grad-accum, in whole groups of --num-generations {config.grpo.num_generations}). "
    )


def halved_plan(plan: RunPlan, step: int, precision: Precision) -> RunPlan:
    """A new plan with half the micro-batch and grad_accum doubled, or stop with what to change."""
    config = plan.config
    t = config.train
    if t.micro_batch_size == 1:
        quantized = config.model.quantization != "none"
        weights = f"{config.model.quantization} weights, " if quantized else ""
        qlora = "" if quantized else ", or --quantization nf4 (QLoRA)"
        raise TrainingError(
            f"out of GPU memory at step {step} even with --micro-batch-size 1 "
            f"({config.model.name}, {weights}{precision.name}, --max-length {config.data.max_length}). "
            + _generation_hint(config)
            + f"Lower --max-length (e.g. {max(8, config.data.max_length // 2)}), use a preset for a "
            f"smaller GPU or a smaller model{qlora}."
        )
    if not t.oom_retry:
        raise TrainingError(
            f"out of GPU memory at step {step} with --micro-batch-size {t.micro_batch_size}. "
            f"Continue with --micro-batch-size {t.micro_batch_size // 2} --grad-accum "
            f"{t.grad_accum * 2} --resume auto (same effective batch), or pass --oom-retry to "
            f"let lora-lab do that itself."
        )
    effective, batch = t.micro_batch_size * t.grad_accum, t.micro_batch_size // 2
    accum = math.ceil(effective / batch)
    values = {"train.micro_batch_size": batch, "train.grad_accum": accum}
    kept = batch * accum
    same = (
        f"same effective batch of {effective}"
        if kept == effective
        else f"effective batch {effective} -> {kept}: {effective} has no whole half"
    )
    log.warning(
        f"warning: out of GPU memory at step {step} with micro-batch {t.micro_batch_size} x "
        f"grad-accum {t.grad_accum}; retrying with micro-batch {batch} x grad-accum {accum} ({same})."
    )
    return plan.with_config(config.with_changes(values, OOM_SOURCE))


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


def stop_if_signalled(trainer: LoraLabTrainer, run_dir: Path) -> None:
    """After a SIGTERM / SIGINT stop (callbacks.StopOnSignal): say where the run can continue."""
    stop = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StopOnSignal))
    if stop.received is None:
        return
    step = trainer.state.global_step
    if trainer.is_world_process_zero():
        raise record_stop(run_dir, stop.received, step)
    raise stop_error(run_dir, stop.received, step)
