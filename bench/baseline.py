"""The plain recipe lora-lab is compared against: transformers Trainer + peft.get_peft_model.

LoRA on all linear layers, dropout 0.05, AdamW, gradient checkpointing (use_reentrant=False),
sdpa attention, every sequence full length, no lora-lab code in the training path (the data is
tokenized here with the chat template, labels on the whole sequence as the simplest recipes do).
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

from lora_lab.training.callbacks import StepTimer  # as lora-lab's and Unsloth's cells


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count, length, vocab=150000, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class _Conversations(torch.utils.data.Dataset):
    """Chat rows tokenized with the model's own chat template, cut at max_length; labels on the
    whole sequence (the simplest recipe; it costs the same compute as reply-only labels)."""

    def __init__(self, model_dir: str, data_path: str, max_length: int):
        import json

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = [json.loads(line) for line in open(data_path)]
        self.ids = [
            tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"][:max_length]
            for r in rows
        ]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = torch.tensor(self.ids[index])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def run_baseline_sft(
    model_dir: str, data_path: str, max_length: int = 2048, grad_accum: int = 16, output_dir: str = "/tmp/baseline-sft"
) -> dict:
    """The popular recipe on real-length data: micro-batch 1 (one sample per pass, so no padding)
    x gradient accumulation 16, one epoch; wall time of Trainer.train()."""
    dataset = _Conversations(model_dir, data_path, max_length)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": 0}
    )
    model.config.use_cache = False
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=grad_accum,
        num_train_epochs=1,
        learning_rate=1e-4,
        bf16=True,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
    )
    torch.cuda.reset_peak_memory_stats()
    output = Trainer(model=model, args=args, train_dataset=dataset).train()
    seconds = output.metrics["train_runtime"]
    tokens = sum(len(ids) for ids in dataset.ids)
    return {
        "train_seconds": seconds,
        "samples": len(dataset),
        "tokens": tokens,
        "optimizer_steps": output.global_step,
        "tokens_per_s": tokens / seconds,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "final_loss": output.training_loss,
    }


def run_baseline(
    model_dir: str,
    max_length: int,
    micro_batch_size: int = 1,
    grad_accum: int = 4,
    steps: int = 8,
    warmup_steps: int = 2,
    rank: int = 8,
    alpha: int = 32,
    dtype: str = "bf16",
    qlora: bool = False,
    output_dir: str = "/tmp/baseline",
) -> dict:
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    kwargs = {"dtype": torch_dtype, "attn_implementation": "sdpa", "device_map": {"": 0}}
    if qlora:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.use_cache = False
    if qlora:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(
        model,
        LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    timer = StepTimer()
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=grad_accum,
        max_steps=steps,
        learning_rate=1e-4,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
    )
    torch.cuda.reset_peak_memory_stats()
    Trainer(
        model=model,
        args=args,
        callbacks=[timer],
        train_dataset=_Rows(steps * grad_accum * micro_batch_size, max_length),
    ).train()
    performance = timer.summary(warmup_steps)
    tokens = micro_batch_size * grad_accum * max_length
    return {
        "median_step_seconds": performance["median_step_seconds"],
        "tokens_per_s": tokens / performance["median_step_seconds"],
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "timed_steps": performance["timed_steps"],
    }
