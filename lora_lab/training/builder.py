"""The trainer of a run plan: training arguments, the base model, the tuner (LoRA with its memory
means, or every weight) and the LoraLabTrainer (or a preference or grpo task's TRL trainer) over the
prepared rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import RunConfig, converts_initial_adapter
from ..data import PreparedData
from ..data.collate import PACKED_FIELDS, PackedCollator, PadCollator, SupervisedDataset
from ..data.packing import PackedData
from ..log import get_logger
from ..models.fast_lora import FastLoraOptions
from ..models.load import LoadOptions, Precision, load_base_model, process_gpu
from ..models.lora import (
    LoraOptions,
    apply_lora,
    prepare_full_finetuning,
    prepare_quantized_for_training,
    save_initial_adapter,
    template_token_ids,
)
from ..models.moe import adapted_experts_to, expert_lora_in_low_rank
from ..paths import staged_folder
from ..planning.policies import resolve_liger_experts
from ..registry import family_of, missing_fast_paths, wants_trainable_tokens
from ..run_folder.names import INITIAL_ADAPTER_FOLDER
from .args import build_training_arguments, count_optimizer_steps
from .callbacks import NonFiniteGuard, run_callbacks
from .plan import RunPlan
from .trainer import LoraLabTrainer, saved_loss_sum

log = get_logger()
SHARDED_ENGINES = ("deepspeed-zero3", "deepspeed-zero3-offload", "fsdp")
"""Engines that shard the parameters themselves: the model is loaded without a device_map."""


@dataclass(frozen=True)
class TrainingInputs:
    """What a run trains on: the prepared data (packed rows when data.packing), its tokenizer and
    the data's fingerprint (checkpoints record it)."""

    data: PreparedData
    packed: PackedData | None
    tokenizer: Any
    fingerprint: dict


def build_trainer(plan: RunPlan, inputs: TrainingInputs, precision: Precision) -> LoraLabTrainer:
    """The trainer of `plan` over `inputs`, its model loaded and its tuner applied."""
    from transformers import set_seed

    config = plan.config
    set_seed(config.train.seed)  # the LoRA initialisation is part of the run's seed
    # TrainingArguments first: with ZeRO-3 they must exist when the model loads, so that
    # transformers partitions the weights while loading (HfDeepSpeedConfig).
    args = training_arguments(plan, inputs, precision)
    preference = config.train.task != "sft"
    tokens = (
        template_token_ids(inputs.tokenizer)
        if wants_trainable_tokens(config.lora.trainable_tokens, config.train.tuner, config.model.name)
        and not preference
        else None
    )  # TRL computes log-probs from the head's weight itself
    loading = LoadOptions(
        fp32_master_weights=config.train.tuner == "full",
        sharded=plan.engine in SHARDED_ENGINES,
        packed_attention=plan.packed_attention if inputs.packed else None,
        path=plan.model.path,
        fused_loss=not (tokens or preference),
        kernels=plan.kernels,
        liger_experts=resolve_liger_experts(config),
        longest_row=0 if inputs.packed else config.data.max_length,
    )
    model = load_base_model(config.model, precision, loading)
    say_family(model.config.model_type)
    model = apply_tuner(plan, model, precision, tokens, args.should_save, inputs)
    trainer_parts = {
        "guard": NonFiniteGuard(config.train.on_nonfinite, precision.name, plan.folder),
        "train_data": inputs.fingerprint,
        "memory_means": plan.memory_means.describe() if plan.memory_means else "none",
        "resumed_loss_sum": saved_loss_sum(plan.resume_from),
        "loraplus_lr_ratio": config.train.loraplus_lr_ratio,
    }
    if preference:
        from .grpo import build_grpo_trainer
        from .preference import build_preference_trainer

        data = inputs.data
        build = build_grpo_trainer if config.train.task == "grpo" else build_preference_trainer
        return build(
            config,
            model,
            args,
            data.train.samples,
            data.val.samples if data.val else None,
            inputs.tokenizer,
            run_callbacks(plan.folder, config.train.report_to),
            **trainer_parts,
        )
    return supervised_trainer(plan, inputs, model, args, trainer_parts)


def training_arguments(plan: RunPlan, inputs: TrainingInputs, precision: Precision):
    """transformers' TrainingArguments (or a preference task's TRL config) of the plan."""
    config, packed = plan.config, inputs.packed
    return build_training_arguments(
        plan,
        precision,
        count_optimizer_steps(config, len(inputs.data.train.samples)),
        inputs.data.val is not None,
        packed.rows_per_step if packed else None,
        **task_arguments(config, inputs.tokenizer),
    )


def apply_tuner(plan: RunPlan, model, precision: Precision, tokens, should_save: bool, inputs: TrainingInputs):
    """Full fine-tuning, or LoRA (DoRA, IA3) with the plan's memory means; says which in the log."""
    config = plan.config
    if config.train.tuner == "full":  # the engines' own checkpointing
        model = prepare_full_finetuning(model, config.train.gradient_checkpointing)
        total = sum(p.numel() for p in model.parameters())
        log.info(f"precision {precision.name} (fp32 master weights); full fine-tuning: all {total:,} parameters train")
        return model
    if config.model.quantization == "nf4":
        model = prepare_quantized_for_training(model)
    building = LoraOptions(
        gradient_checkpointing=config.train.gradient_checkpointing,
        means=plan.memory_means,
        fast=FastLoraOptions.of(config.model) if plan.fast_lora else None,
        offload_copy_stream=config.train.offload_copy_stream and plan.gpu_gib is not None,
        trainable_tokens=tuple(tokens) if tokens else None,
        tuner=config.train.tuner,
        adapter_dir=plan.from_run_adapter,
    )
    model = apply_lora(model, config.lora, building)
    if config.model.quantization == "nf4":  # a mixture of experts' experts, adapter attached: to 4 bits
        adapted_experts_to(model, None if plan.engine in SHARDED_ENGINES else process_gpu())
    elif config.lora.experts:
        expert_lora_in_low_rank(model)
    initial = plan.folder / INITIAL_ADAPTER_FOLDER
    if converts_initial_adapter(config.lora) and not initial.is_dir() and should_save:
        with staged_folder(initial) as staging:
            save_initial_adapter(model, staging)
    if tokens:
        log.info(
            f"lora.trainable_tokens: the embedding rows of the template's "
            f"{len(tokens)} special tokens train too "
            f"({' '.join(inputs.tokenizer.convert_ids_to_tokens(tokens))})"
        )
    log.info(adapted_modules(model.peft_config["default"]))
    trainable, total = model.get_nb_trainable_parameters()
    log.info(
        f"precision {precision.name}; {describe_tuner(config)}: {trainable:,} "
        f"trainable of {total:,} parameters; kernels {plan.kernels}"
        f"{', fast LoRA' if plan.fast_lora else ''}; memory means: {plan.memory_means.describe() if plan.memory_means else 'none'}"
        + (f"; packed rows attend with {plan.packed_attention}" if inputs.packed else "")
    )
    return model


def adapted_modules(peft_config) -> str:
    """The run's line naming what the adapter adapts (lora.target_modules as peft resolved it, and
    the experts' parameters with lora.experts)."""
    modules = peft_config.target_modules
    names = [modules] if isinstance(modules, str) else sorted(modules or [])
    experts = list(getattr(peft_config, "target_parameters", None) or [])
    return "adapts " + ", ".join(names) + (f"; the fused experts' {', '.join(experts)}" if experts else "")


def supervised_trainer(plan: RunPlan, inputs: TrainingInputs, model, args, parts: dict) -> LoraLabTrainer:
    """The LoraLabTrainer of an sft run: packed rows or padded samples."""
    data, packed, pad = inputs.data, inputs.packed, inputs.tokenizer.pad_token_id
    return LoraLabTrainer(
        model=model,
        args=args,
        train_dataset=SupervisedDataset(packed.rows, PACKED_FIELDS)
        if packed
        else SupervisedDataset(data.train.samples),
        eval_dataset=SupervisedDataset(data.val.samples) if data.val else None,
        data_collator=PackedCollator(pad, plan.packed_attention) if packed else PadCollator(pad),
        processing_class=inputs.tokenizer,
        callbacks=run_callbacks(plan.folder, plan.config.train.report_to),
        **parts,
    )


def say_family(model_type: str | None) -> None:
    """One line on the family's fast paths when lora-lab lacks some for it."""
    family = family_of(model_type)
    missing = missing_fast_paths(family)
    if missing:
        log.info(
            f"model_type {model_type!r} ({family.name}): trains on the generic path, without {' and '.join(missing)}"
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


def task_arguments(config: RunConfig, tokenizer) -> dict:
    """A preference or grpo task's TRL config class and settings for build_training_arguments."""
    if config.train.task == "sft":
        return {}
    if config.train.task == "grpo":
        from .grpo import grpo_config_class, grpo_settings

        return {"args_class": grpo_config_class(), **grpo_settings(config, tokenizer)}
    from .preference import task_settings, trainer_config

    return {"args_class": trainer_config(config.train.task), **task_settings(config)}
