"""Training: a transformers Trainer over a PEFT LoRA model, writing a self-describing run folder.

output/<run-name>/
  config.yaml            the resolved config and where each value came from
  adapter/               final adapter (adapter_config.json, adapter_model.safetensors)
                         plus tokenizer files and chat template
  checkpoint-<step>/     intermediate adapters and trainer state (for resume)
  logs/                  TensorBoard events, train_log.jsonl, data_problems.jsonl
  run_summary.json       steps, losses, samples, time
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from transformers import TrainerCallback

from .config import RunConfig, save_config
from .data import IGNORE_INDEX, PreparedData, prepare_data
from .errors import LoraLabError
from .model import Precision, apply_lora, choose_precision, load_base_model, load_tokenizer

log = logging.getLogger("lora_lab")


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    global_step: int
    train_loss: float
    eval_loss: float | None
    train_samples: int
    trained_tokens: int
    seconds: float


def default_run_name(config: RunConfig) -> str:
    model = Path(config.model.name.rstrip("/")).name.lower().replace(".gguf", "")
    return f"{model}-{config.preset}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def create_run_dir(config: RunConfig) -> Path:
    name = config.train.run_name or default_run_name(config)
    run_dir = Path(config.train.output_dir) / name
    if (run_dir / "adapter").exists() or any(run_dir.glob("checkpoint-*")):
        raise LoraLabError(f"--run-name {name}: {run_dir} already holds a run. Pick another "
                           f"--run-name or --output-dir, or delete that folder.")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config.train.run_name = name
    return run_dir


class SupervisedDataset:
    """Encoded samples as the Trainer expects them (a list of dicts)."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        sample = self.samples[index]
        return {"input_ids": sample.input_ids, "labels": sample.labels}


class PadCollator:
    """Right-pads a micro-batch to its longest sample; padding never carries loss."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for f in features:
            pad = longest - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def count_optimizer_steps(config: RunConfig, train_samples: int) -> int:
    if config.train.max_steps > 0:
        return config.train.max_steps
    per_epoch = math.ceil(train_samples / config.train.micro_batch_size / config.train.grad_accum)
    return max(1, math.ceil(per_epoch * config.train.epochs))


def build_training_arguments(config: RunConfig, run_dir: Path, precision: Precision,
                             total_steps: int, has_eval: bool):
    from transformers import TrainingArguments

    t = config.train
    return TrainingArguments(
        output_dir=str(run_dir),
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr, num_train_epochs=t.epochs, max_steps=t.max_steps,
        warmup_steps=math.ceil(t.warmup_ratio * total_steps), lr_scheduler_type=t.lr_scheduler,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        bf16=precision.bf16, fp16=precision.fp16,
        logging_steps=t.logging_steps, logging_first_step=True,
        save_strategy="steps", save_steps=t.save_steps, save_total_limit=t.save_total_limit,
        eval_strategy="steps" if has_eval else "no", eval_steps=t.eval_steps,
        seed=t.seed, data_seed=t.seed, report_to="none", remove_unused_columns=False,
        dataloader_num_workers=0, use_cpu=precision.name == "fp32" and not _cuda(),
        gradient_checkpointing=False,  # enabled on the base model in apply_lora
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _callbacks(run_dir: Path) -> list:
    from transformers.integrations import TensorBoardCallback

    tensorboard = TensorBoardCallback()
    tensorboard.logging_dir = str(run_dir / "logs")  # also after train end, for the final eval
    return [tensorboard, JsonlLog(run_dir / "logs" / "train_log.jsonl"), StepTimer()]


class JsonlLog(TrainerCallback):
    """Every logged value, one JSON line per log event (logs/train_log.jsonl)."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step and the peak GPU memory (for run_summary.json)."""

    def __init__(self):
        self.step_seconds, self._last = [], None

    @staticmethod
    def _now():
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._last is None:
            self._last = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now()
        self.step_seconds.append(now - self._last)
        self._last = now

    def summary(self, warmup: int = 2) -> dict:
        import torch

        timed = self.step_seconds[warmup:] or self.step_seconds
        peak = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None
        return {"median_step_seconds": statistics.median(timed) if timed else None,
                "timed_steps": len(timed), "peak_reserved_gib": peak}


def write_data_problems(run_dir: Path, data: PreparedData) -> None:
    with open(run_dir / "logs" / "data_problems.jsonl", "w") as handle:
        for problem in data.all_problems():
            handle.write(json.dumps({"origin": problem.origin, "reason": problem.reason},
                                    ensure_ascii=False) + "\n")
        for origin in data.train.truncated + (data.val.truncated if data.val else []):
            handle.write(json.dumps({"origin": origin, "reason": "truncated to max_length"}) +
                         "\n")


def train(config: RunConfig, echo=print) -> TrainResult:
    """Fine-tune config.model with LoRA on config.data; returns where everything was written."""
    started = time.time()
    precision = choose_precision(config.model.dtype)
    tokenizer = load_tokenizer(config.model.name, config.model.trust_remote_code)
    data = prepare_data(config.data, tokenizer, config.train.seed)
    echo(data.summary(config.data.max_length))
    for problem in data.all_problems()[:10]:
        echo(f"  skipped {problem}")
    if len(data.all_problems()) > 10:
        echo(f"  ... {len(data.all_problems()) - 10} more in logs/data_problems.jsonl")
    run_dir = create_run_dir(config)
    save_config(config, run_dir / "config.yaml")
    write_data_problems(run_dir, data)

    model = load_base_model(config.model, precision)
    if config.model.quantization == "nf4":
        model = prepare_quantized_for_training(model)
    model = apply_lora(model, config.lora, config.train.gradient_checkpointing)
    trainable, total = model.get_nb_trainable_parameters()
    echo(f"precision {precision.name}; LoRA r={config.lora.rank} alpha={config.lora.alpha}: "
         f"{trainable:,} trainable of {total:,} parameters")

    from transformers import Trainer

    total_steps = count_optimizer_steps(config, len(data.train.samples))
    trainer = Trainer(
        model=model,
        args=build_training_arguments(config, run_dir, precision, total_steps, data.val is not None),
        train_dataset=SupervisedDataset(data.train.samples),
        eval_dataset=SupervisedDataset(data.val.samples) if data.val else None,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=_callbacks(run_dir),
    )
    output = trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"] if data.val else None

    adapter_dir = run_dir / "adapter"
    model.save_pretrained(adapter_dir, safe_serialization=True)
    tokenizer.save_pretrained(adapter_dir)
    result = TrainResult(run_dir=run_dir, adapter_dir=adapter_dir,
                         global_step=trainer.state.global_step,
                         train_loss=float(output.training_loss), eval_loss=eval_loss,
                         train_samples=len(data.train.samples),
                         trained_tokens=sum(s.trained_tokens for s in data.train.samples),
                         seconds=round(time.time() - started, 1))
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepTimer))
    summary["performance"] = timer.summary()
    (run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result


def prepare_quantized_for_training(model):
    """QLoRA set-up without peft's fp32 upcast of embedding and lm_head (about 2 GiB on 7B)."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model
