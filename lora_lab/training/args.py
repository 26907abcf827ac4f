"""transformers TrainingArguments from a RunConfig, and the step count they imply."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from ..config import RunConfig
from ..device import use_cpu
from ..models.load import Precision
from ..run_folder.names import DEEPSPEED_FILE, LAUNCH_FOLDER
from .plan import RunPlan
from .watch import trainer_report_to


def count_optimizer_steps(config: RunConfig, train_samples: int) -> int:
    """Optimizer steps of the run; --task grpo trains on grpo.num_generations completions of
    each prompt (its samples)."""
    if config.train.max_steps > 0:
        return config.train.max_steps
    if config.train.task == "grpo":
        train_samples *= config.grpo.num_generations
    per_epoch = math.ceil(train_samples / config.train.micro_batch_size / config.train.grad_accum)
    return max(1, math.ceil(per_epoch * config.train.epochs))


def warmup_steps(ratio: float, total_steps: int) -> int:
    """Steps of linear warm-up: ratio x steps, rounded down, and never every step there is (the
    run reaches its learning rate before its last step)."""
    return min(math.floor(ratio * total_steps), max(total_steps - 1, 0))


def build_scheduler(args, optimizer, num_training_steps: int):
    """The Trainer's learning-rate schedule (args.lr_scheduler_type and its warm-up), one step
    ahead: the schedule of num_training_steps + 1 steps with one more warm-up step, read at
    step + 1. The first optimizer step of a warm-up trains, at lr / (warm-up + 1), where the
    Trainer's would run at learning rate 0 and change nothing; after the warm-up every step's
    learning rate is the Trainer's own."""
    from torch.optim.lr_scheduler import LambdaLR
    from transformers.optimization import get_scheduler

    warmup = args.get_warmup_steps(num_training_steps)
    kwargs = {"scheduler_specific_kwargs": args.lr_scheduler_kwargs}
    if not warmup:
        return get_scheduler(args.lr_scheduler_type, optimizer, warmup, num_training_steps, **kwargs)
    base = get_scheduler(args.lr_scheduler_type, optimizer, warmup + 1, num_training_steps + 1, **kwargs)
    if not isinstance(base, LambdaLR):  # a schedule of its own making (reduce_lr_on_plateau)
        return base
    # plain functions: a scheduler's state_dict saves the attributes of callable objects, and a
    # checkpoint's scheduler.pt is loaded with weights_only=True
    return LambdaLR(optimizer, [_one_ahead(fn) for fn in base.lr_lambdas])


def _one_ahead(factor: Callable[[int], float]) -> Callable[[int], float]:
    def shifted(step: int) -> float:
        return factor(step + 1)

    return shifted


def build_training_arguments(
    plan: RunPlan,
    precision: Precision,
    total_steps: int,
    has_eval: bool,
    rows_per_step: int | None = None,
    args_class=None,
    **extra,
):
    """rows_per_step: with packing, each micro-batch is one packed row. args_class: a
    TrainingArguments subclass (TRL's DPOConfig ...), given its own settings in `extra`."""
    from transformers import TrainingArguments

    config, run_dir, t = plan.config, plan.folder, plan.config.train
    args = (args_class or TrainingArguments)(
        output_dir=str(run_dir),
        per_device_train_batch_size=1 if rows_per_step else t.micro_batch_size,
        per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=rows_per_step or t.grad_accum,
        learning_rate=t.lr,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        warmup_steps=warmup_steps(t.warmup_ratio, total_steps),
        lr_scheduler_type=t.lr_scheduler,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        bf16=precision.bf16,
        fp16=precision.fp16,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        # the filter reads every micro-batch's loss on the host (a GPU sync); NonFiniteGuard
        # stops on a NaN loss anyway, so only --on-nonfinite skip keeps it
        logging_nan_inf_filter=t.on_nonfinite == "skip",
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        save_only_model=t.save_only_model,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=t.eval_steps,
        neftune_noise_alpha=t.neftune_noise_alpha or None,
        seed=t.seed,
        data_seed=t.seed,
        remove_unused_columns=False,
        report_to=trainer_report_to(t.report_to) or "none",
        run_name=run_dir.name,
        dataloader_num_workers=0,
        use_cpu=use_cpu(precision),  # checkpointing: models/lora.py
        # every trainable tensor takes part in every step; True would walk the autograd graph
        # every backward
        ddp_find_unused_parameters=False,
        deepspeed=deepspeed_config_path(config, run_dir),
        # accelerate reduces after every micro-batch instead of skipping all but the last
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": plan.sync_each_micro_batch}},
        **extra,
    )
    if args.n_gpu > 1:
        # One process that sees several GPUs: the Trainer would spread each micro-batch over
        # them with nn.DataParallel, which fails with the CPU embedding (its ids land on cuda:1).
        # A run trains on one GPU unless --gpus N launches N processes.
        args._n_gpu = 1
    return args


def deepspeed_config_path(config: RunConfig, run_dir: Path) -> str | None:
    """The filled-in DeepSpeed config the launcher wrote (training/launch.py), if any."""
    if not config.train.engine.startswith("deepspeed"):
        return None
    return str(run_dir / LAUNCH_FOLDER / DEEPSPEED_FILE)
