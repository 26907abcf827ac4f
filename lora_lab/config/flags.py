"""The named flags of `lora-lab run` and the keys they set: what the CLI builds its options from
and what messages name."""

from __future__ import annotations

import dataclasses

from .fields import SECTIONS

# The named flags of `lora-lab run`, and the key each sets. The CLI builds its options from this
# table and errors name the flag when that is where a value came from.
FLAGS = {
    "--model": "model.name",
    "--dtype": "model.dtype",
    "--quantization": "model.quantization",
    "--trust-remote-code": "model.trust_remote_code",
    "--lora-rank": "lora.rank",
    "--lora-alpha": "lora.alpha",
    "--lora-dropout": "lora.dropout",
    "--data": "data.datasets",
    "--val-data": "data.val_data",
    "--val-ratio": "data.val_ratio",
    "--format": "data.format",
    "--max-length": "data.max_length",
    "--truncation": "data.truncation",
    "--system": "data.system",
    "--model-name": "data.model_name",
    "--model-author": "data.model_author",
    "--output-dir": "train.output_dir",
    "--run-name": "train.run_name",
    "--micro-batch-size": "train.micro_batch_size",
    "--grad-accum": "train.grad_accum",
    "--lr": "train.lr",
    "--epochs": "train.epochs",
    "--max-steps": "train.max_steps",
    "--seed": "train.seed",
    "--memory-check/--no-memory-check": "train.memory_check",
    "--save-steps": "train.save_steps",
    "--logging-steps": "train.logging_steps",
    "--eval-steps": "train.eval_steps",
    "--eval-tasks": "train.eval_tasks",
    "--report-to": "train.report_to",
    "--gradient-checkpointing/--no-gradient-checkpointing": "train.gradient_checkpointing",
    "--resume": "train.resume",
    "--allow-config-change": "train.allow_config_change",
    "--on-nonfinite": "train.on_nonfinite",
    "--oom-retry/--no-oom-retry": "train.oom_retry",
    "--gpus": "train.gpus",
    "--nodes": "train.nodes",
    "--node-rank": "train.node_rank",
    "--main-address": "train.main_address",
    "--engine": "train.engine",
    "--tuner": "train.tuner",
    "--task": "train.task",
    "--from-run": "train.from_run",
    "--beta": "train.pref_beta",
    "--reward": "grpo.rewards",
    "--num-generations": "grpo.num_generations",
    "--max-completion-length": "grpo.max_completion_length",
}


FLAG_FOR_KEY = {key: flag.split("/")[0] for flag, key in FLAGS.items()}
"""Config key -> the named flag that sets it (its positive form), for messages."""


def field_help(key: str) -> str:
    section, name = key.split(".")
    spec = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    return spec.metadata["help"]


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
