"""The peer cells: Unsloth (an optional dependency) on the cells lora-lab is measured on.

Same random-weight Qwen2.5 folders (workloads.make_random_model) and data generators; Unsloth's
recommended settings: FastLanguageModel, LoRA r 8, alpha 32 on all linear layers, dropout 0,
use_gradient_checkpointing="unsloth". Steps are timed by lora-lab's own StepTimer (CUDA events
at every optimizer step's end, no host wait; the median after 2 warm-up steps, or of every step
where there are 2 or fewer); peak = torch.cuda.max_memory_reserved.

- kind "unsloth": fixed-length samples (workloads.write_full_length_rows, every sample exactly
  max_length tokens) through the plain transformers Trainer, `batch` samples a micro-batch and
  `grad_accum` micro-batches a step; `qlora` loads 4-bit (nf4).
- kind "unsloth-sft": one epoch of the SFT mix (workloads.write_sft_mix_rows) through trl's
  SFTTrainer, packed into rows of 8192 tokens like lora-lab's 24gb preset.

Where Unsloth is not installed the cell records error "not installed".
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import statistics

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAINER_SETTINGS = {"bf16": True, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0}
"""The Trainer arguments of every peer cell beside its own (no checkpoints, no trackers)."""
PACK_LENGTH = 8192


def versions() -> dict:
    found = {}
    for name in ("unsloth", "unsloth_zoo", "trl", "transformers", "peft", "torch", "bitsandbytes"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def import_unsloth():
    """Unsloth patches transformers and peft when imported, so before either; None if absent."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    try:
        import unsloth  # noqa: F401
    except ImportError:
        return None
    from unsloth import FastLanguageModel

    return FastLanguageModel


def load(fast, model_dir: str, max_length: int, qlora: bool, rank: int = 8, alpha: int = 32):
    import torch

    model, tokenizer = fast.from_pretrained(
        model_name=model_dir, max_seq_length=max_length, dtype=torch.bfloat16, load_in_4bit=qlora
    )
    model = fast.get_peft_model(
        model,
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0,
        bias="none",
        target_modules=TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=0,
        max_seq_length=max_length,
    )
    return model, tokenizer


def chat_ids(tokenizer, messages) -> list:
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def fixed_rows(tokenizer, path, max_length: int) -> list:
    import json

    rows = []
    for line in open(path):
        messages = json.loads(line)["messages"]
        ids = chat_ids(tokenizer, messages)
        assert len(ids) >= max_length, (len(ids), max_length)
        rows.append(ids[:max_length])
    return rows


def run_fixed(cell: dict, model_dir: str, data_path) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    fast = import_unsloth()
    if fast is None:
        return {"error": "not installed", "versions": versions()}
    from lora_lab.training.callbacks import StepTimer

    batch, accum = cell.get("batch", 1), cell.get("grad_accum", 4)
    model, tokenizer = load(
        fast, model_dir, cell["max_length"], cell.get("qlora", False), cell.get("rank", 8), cell.get("alpha", 32)
    )
    rows = fixed_rows(tokenizer, data_path, cell["max_length"])

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i]}

    def collate(features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    timer = StepTimer()
    args = TrainingArguments(
        output_dir="/tmp/lora-lab-bench/unsloth",
        max_steps=cell["steps"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        learning_rate=1e-4,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        warmup_steps=0,
        **TRAINER_SETTINGS,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=collate, callbacks=[timer])
    trainer.train()
    steps = timer.step_seconds[2:] or timer.step_seconds  # 2 steps or fewer: time them all
    median = statistics.median(steps)
    tokens = batch * accum * cell["max_length"]
    return {
        "median_step_seconds": median,
        "timed_steps": len(steps),
        "first_step_seconds": [round(s, 3) for s in timer.step_seconds[:2]],
        "tokens_per_s": tokens / median,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 4),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "batch": batch,
        "versions": versions(),
    }


def run_sft(cell: dict, model_dir: str, data_path) -> dict:
    import json

    import torch

    fast = import_unsloth()
    if fast is None:
        return {"error": "not installed", "versions": versions()}
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from lora_lab.training.callbacks import StepTimer

    model, tokenizer = load(fast, model_dir, PACK_LENGTH, False)
    rows = [json.loads(line) for line in open(data_path)]
    dataset = Dataset.from_list(rows)
    tokens = sum(len(chat_ids(tokenizer, r["messages"])) for r in rows)
    timer = StepTimer()
    config = SFTConfig(
        output_dir="/tmp/lora-lab-bench/unsloth-sft",
        num_train_epochs=1,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        max_length=PACK_LENGTH,
        packing=True,
        dataset_num_proc=1,
        **TRAINER_SETTINGS,
    )
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=dataset, args=config, callbacks=[timer]
    )
    output = trainer.train()
    seconds = output.metrics["train_runtime"]
    return {
        "train_seconds": seconds,
        "samples": len(rows),
        "tokens": tokens,
        "optimizer_steps": output.global_step,
        "tokens_per_s": tokens / seconds,
        "final_loss": output.training_loss,
        "median_step_seconds": statistics.median(timer.step_seconds[2:] or [0]),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 4),
        "versions": versions(),
    }


def run_grpo(cell: dict, model_dir: str, data_path) -> dict:
    """kind "unsloth-grpo": TRL's GRPOTrainer on Unsloth's model with the settings lora-lab's
    preset chose for the same model (bench/run.py grpo_cells): completions a step, group size,
    completion length, loss (DAPO), beta 0, and lora-lab's `length` reward itself; generation
    through transformers (no vLLM on the GPU machine)."""
    import json

    import torch

    fast = import_unsloth()
    if fast is None:
        return {"error": "not installed", "versions": versions()}
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lora_lab.data.rewards import build_rewards
    from lora_lab.training.callbacks import StepTimer
    from lora_lab.training.grpo import LOSS_SETTINGS

    length = cell["max_completion_length"]
    model, tokenizer = load(fast, model_dir, cell["max_length"] + length, cell["qlora"], cell["rank"], cell["alpha"])
    dataset = Dataset.from_list([json.loads(line) for line in open(data_path)])
    timer = StepTimer()
    args = GRPOConfig(
        output_dir="/tmp/lora-lab-bench/unsloth-grpo",
        max_steps=cell["steps"],
        per_device_train_batch_size=cell["batch"],
        gradient_accumulation_steps=cell["grad_accum"],
        num_generations=cell["num_generations"],
        max_completion_length=length,
        temperature=1.0,
        beta=0.0,
        learning_rate=1e-4,
        use_vllm=False,
        **LOSS_SETTINGS["dapo"],
        **TRAINER_SETTINGS,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=build_rewards(["length"], length),
        args=args,
        train_dataset=dataset,
        callbacks=[timer],
    )
    trainer.train()
    steps = timer.step_seconds[2:] or timer.step_seconds
    median = statistics.median(steps)
    return {
        "median_step_seconds": median,
        "timed_steps": len(steps),
        "first_step_seconds": [round(s, 3) for s in timer.step_seconds[:2]],
        "completions_per_s": cell["batch"] * cell["grad_accum"] / median,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 4),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "versions": versions(),
    }
