"""Training: a transformers Trainer over a PEFT LoRA model, writing a self-describing run folder.

output/<run-name>/
  config.yaml            the resolved config and where each value came from
  adapter/               final adapter (adapter_config.json, adapter_model.safetensors)
                         plus tokenizer files and chat template
  model/                 (--tuner full, instead of adapter/) the whole model as safetensors,
                         loadable with from_pretrained, plus tokenizer files
  checkpoint-<step>/     intermediate adapters and trainer state (for resume), with a
                         manifest.json of sha256 sums written last (lora_lab.checkpoint)
  logs/                  TensorBoard events, train_log.jsonl, data_problems.jsonl
  run_summary.json       steps, losses, samples, time
  launch/                (--gpus N, lora_lab.launch) how the worker processes were launched

With several processes (accelerate launch) every rank trains and reads the run folder, but only
rank 0 (the main process) writes into it: config.yaml, logs, checkpoint manifests and renames,
the adapter and run_summary.json. Ranks wait for each other where one reads what another wrote.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from transformers import TrainerCallback

from .activations import resolve_packed_attention
from .checkpoint import (OOM_SOURCE, check_disk_space, check_drift, checkpoint_step,
                         data_fingerprint, find_resume_checkpoint, remove_leftovers,
                         resolve_resume, run_dir_of, trim_step_log)
from .config import RunConfig, save_config, syncs_each_micro_batch
from .data import IGNORE_INDEX, PreparedData, prepare_data
from .errors import CheckpointError, ConfigError, LoraLabError, TrainingError
from .memory import choose_memory_means, row_length, usable_gib
from .model import (Precision, apply_lora, check_full_finetuning_precision, check_remote_code,
                    choose_precision, load_base_model, load_tokenizer, locate_model,
                    prepare_full_finetuning, resolve_kernels)
from .trainer import LoraLabTrainer, NonFiniteGuard, ensure_finite

log = logging.getLogger("lora_lab")
LAUNCH_FOLDER = "launch"
SHARDED_ENGINES = ("deepspeed-zero3", "deepspeed-zero3-offload", "fsdp")
"""Engines that shard the parameters themselves: the model is loaded without a device_map."""


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path | None
    """adapter/ of a LoRA run (None for --tuner full)."""
    global_step: int
    train_loss: float
    eval_loss: float | None
    train_samples: int
    trained_tokens: int
    seconds: float
    nonfinite_skipped_steps: list
    model_dir: Path | None = None
    """model/ of a --tuner full run: loadable with from_pretrained."""


def default_run_name(config: RunConfig) -> str:
    model = Path(config.model.name.rstrip("/")).name.lower().replace(".gguf", "")
    return f"{model}-{config.preset}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def locate_run_dir(config: RunConfig) -> Path:
    """The run folder: --resume PATH names it; otherwise --output-dir / --run-name."""
    resume = config.train.resume
    named = run_dir_of(resume) if resume else None
    if named is not None:
        config.train.output_dir, config.train.run_name = str(named.parent), named.name
        return named
    if resume == "auto" and not config.train.run_name:
        raise ConfigError(["--resume auto: also pass --run-name (and --output-dir) to say which "
                           "run to continue, or pass the run folder: --resume output/NAME."])
    name = config.train.run_name or default_run_name(config)
    config.train.run_name = name
    return Path(config.train.output_dir) / name


def holds_run(run_dir: Path) -> bool:
    return ((run_dir / "adapter").exists() or (run_dir / "model").exists()
            or any(run_dir.glob("checkpoint-*")))


def check_run_dir(run_dir: Path, config: RunConfig, resume_from: Path | None) -> None:
    """A run folder is reused only to resume; a finished run is never started over."""
    if resume_from is not None or not holds_run(run_dir):
        return
    if config.train.resume and (run_dir / "adapter").exists():
        raise CheckpointError(f"--resume {config.train.resume}: {run_dir} holds a finished run "
                              f"(adapter/) but no complete checkpoint of it; refusing to start "
                              f"over in it. Pick another --run-name.")
    if config.train.resume:
        return  # only incomplete checkpoints: a fresh start replaces them step by step
    raise LoraLabError(f"--run-name {run_dir.name}: {run_dir} already holds a run. Pass --resume "
                       f"auto to continue it, pick another --run-name or --output-dir, or delete "
                       f"that folder.")


def create_run_dir(run_dir: Path) -> Path:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for folder in remove_leftovers(run_dir):
        log.info("removed %s (a save that never finished)", folder)
    return run_dir


class SupervisedDataset:
    """Encoded samples (or packed rows, fields=PACKED_FIELDS) as the Trainer expects them: a
    list of dicts."""

    def __init__(self, samples: list, fields: tuple = ("input_ids", "labels")):
        self.samples, self.fields = samples, fields

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        sample = self.samples[index]
        return {field: getattr(sample, field) for field in self.fields}


PACKED_FIELDS = ("input_ids", "labels", "lengths")


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


class PackedCollator:
    """One packed row per micro-batch: position ids restart at every sample and a block-diagonal
    causal mask keeps each sample's attention inside the sample (attention "segments" or
    "varlen": the sample lengths and their cumulative sums instead, for lora_lab.activations)."""

    def __init__(self, pad_token_id: int, attention: str = "mask"):
        self.pad_token_id, self.attention = pad_token_id, attention
        self.padded = PadCollator(pad_token_id)

    def __call__(self, features: list) -> dict:
        import torch

        if "lengths" not in features[0]:
            return self.padded(features)  # evaluation batches are not packed
        if len(features) != 1:
            raise ValueError("packed rows are collated one per micro-batch")
        row = features[0]
        ids, labels, lengths = row["input_ids"], row["labels"], row["lengths"]
        if not ids:  # the last step of an epoch may leave a row without samples
            ids, labels, lengths = [self.pad_token_id], [IGNORE_INDEX], [1]
        batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                 "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
        if len(lengths) == 1:  # one sample: plain causal attention (flash kernels), no mask
            return batch
        if self.attention in ("segments", "varlen"):
            ends = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return {**batch, "packed_lengths": list(lengths),
                    "packed_cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), ends])}
        sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        causal = torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool))
        mask = (sample[:, None] == sample[None, :]) & causal
        return {**batch, "attention_mask": mask[None, None]}


def pack_training_data(config: RunConfig, data: PreparedData, echo=print):
    """data.packing: the training samples packed into rows (lora_lab.data.packing)."""
    from .data.packing import pack_samples

    t = config.train
    packed = pack_samples(data.train.samples, t.micro_batch_size * t.grad_accum,
                          row_length(config), t.seed)
    echo(packed.summary())
    return packed


def longest_row(data: PreparedData, packed=None) -> int:
    """Tokens in the longest training row: a packed row, or the longest sample."""
    if packed is not None:
        return packed.longest_row
    return max(len(s.input_ids) for s in data.train.samples)


def count_optimizer_steps(config: RunConfig, train_samples: int) -> int:
    if config.train.max_steps > 0:
        return config.train.max_steps
    per_epoch = math.ceil(train_samples / config.train.micro_batch_size / config.train.grad_accum)
    return max(1, math.ceil(per_epoch * config.train.epochs))


def build_training_arguments(config: RunConfig, run_dir: Path, precision: Precision,
                             total_steps: int, has_eval: bool, rows_per_step: int | None = None):
    """rows_per_step: with packing, each micro-batch is one packed row."""
    from transformers import TrainingArguments

    t = config.train
    args = TrainingArguments(
        output_dir=str(run_dir),
        per_device_train_batch_size=1 if rows_per_step else t.micro_batch_size,
        per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=rows_per_step or t.grad_accum,
        learning_rate=t.lr, num_train_epochs=t.epochs, max_steps=t.max_steps,
        warmup_steps=math.ceil(t.warmup_ratio * total_steps), lr_scheduler_type=t.lr_scheduler,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        bf16=precision.bf16, fp16=precision.fp16,
        logging_steps=t.logging_steps, logging_first_step=True,
        save_strategy="steps", save_steps=t.save_steps, save_total_limit=t.save_total_limit,
        save_only_model=t.save_only_model,
        eval_strategy="steps" if has_eval else "no", eval_steps=t.eval_steps,
        seed=t.seed, data_seed=t.seed, report_to="none", remove_unused_columns=False,
        dataloader_num_workers=0, use_cpu=_use_cpu(precision),
        gradient_checkpointing=False,  # enabled on the model (apply_lora, prepare_full_finetuning)
        ddp_find_unused_parameters=False,  # every trainable tensor takes part in every step
        deepspeed=deepspeed_config_path(config, run_dir),
        # accelerate reduces after every micro-batch instead of skipping all but the last
        accelerator_config={"gradient_accumulation_kwargs": {
            "sync_each_batch": syncs_each_micro_batch(t)}},
    )
    if args.n_gpu > 1:
        # One process that sees several GPUs: the Trainer would spread each micro-batch over
        # them with nn.DataParallel (it failed on two H200s: the embedding's ids on cuda:1).
        # A run trains on one GPU unless --gpus N launches N processes.
        args._n_gpu = 1
    return args


def deepspeed_config_path(config: RunConfig, run_dir: Path) -> str | None:
    """The filled-in DeepSpeed config the launcher wrote (lora_lab.launch), if any."""
    if not config.train.engine.startswith("deepspeed"):
        return None
    return str(run_dir / LAUNCH_FOLDER / "deepspeed.json")


def _use_cpu(precision: Precision) -> bool:
    return precision.name == "fp32" and not _cuda()


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_state(precision: Precision):
    """accelerate's process state, set up as the Trainer will (gloo on CPU, NCCL on GPUs)."""
    from accelerate import PartialState

    return PartialState(cpu=_use_cpu(precision))


MEMORY_CAP_ENV = "LORA_LAB_GPU_MEMORY_GIB"


def cap_gpu_memory() -> float | None:
    """LORA_LAB_GPU_MEMORY_GIB=N: let this process use at most N GiB of its GPU, to act like a
    smaller card (how the presets and the multi-GPU table were measured on H200s)."""
    import torch

    value = os.environ.get(MEMORY_CAP_ENV)
    if not value or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(value) * 2**30 / total), device)
    return float(value)


def gpu_memory_gib() -> float | None:
    """The GPU memory this process may use, in GiB: LORA_LAB_GPU_MEMORY_GIB when set (a smaller
    card), else the first GPU's; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    cap = os.environ.get(MEMORY_CAP_ENV)
    return min(total, float(cap)) if cap else total


def peak_memory_per_gpu(timer: "StepTimer") -> list:
    """Every process's memory figures (StepTimer.memory), in rank order (all ranks call)."""
    import torch

    figures = timer.memory()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [figures]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, figures)
    return gathered


def use_cudnn_attention(enabled: bool) -> None:
    """model.cudnn_attention: allow or forbid sdpa's cuDNN backend in this (training) process."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(enabled)


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
    """Wall time of every optimizer step and the memory figures of run_summary.json.

    GPU figures are torch.cuda's, in GiB: the reserved peak (what the planner predicts) overall,
    before training (model and engine set up) and up to the end of training; for the first
    optimizer step the allocated peak of its forward and backward passes, what stays allocated
    when they are done (weights, gradients, optimizer state) and the allocated peak of the
    optimizer's update (DeepSpeed updates inside its backward pass: there the forward and
    backward figure includes it). cpu_peak_rss_gib: this process's resident CPU memory peak
    (what the offload engines are planned with)."""

    def __init__(self):
        self.step_seconds, self._last = [], None
        self.phases = {}

    @staticmethod
    def _gib(name: str) -> float | None:
        import torch

        return getattr(torch.cuda, name)() / 2**30 if torch.cuda.is_available() else None

    def _once(self, **figures):
        for key, name in figures.items():
            self.phases.setdefault(key, self._gib(name))

    def on_train_begin(self, args, state, control, **kwargs):
        """The peak so far: loading the model and setting up the engine."""
        self._once(peak_reserved_gib_before_training="max_memory_reserved")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._once(peak_allocated_gib_forward_backward="max_memory_allocated",
                   allocated_gib_before_update="memory_allocated")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._once(peak_allocated_gib_update="max_memory_allocated")

    def on_train_end(self, args, state, control, **kwargs):
        """The peak up to the end of training: before the final evaluation and save (a ZeRO-3
        or FSDP save gathers the whole model)."""
        self._once(peak_reserved_gib_training="max_memory_reserved")

    def memory(self) -> dict:
        import resource

        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        figures = {"peak_reserved_gib": self._gib("max_memory_reserved"), **self.phases,
                   "cpu_peak_rss_gib": rss_kib / 2**20}
        return {k: None if v is None else round(v, 4) for k, v in figures.items()}

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
        timed = self.step_seconds[warmup:] or self.step_seconds
        return {"median_step_seconds": statistics.median(timed) if timed else None,
                "timed_steps": len(timed),
                "first_step_seconds": [round(s, 3) for s in self.step_seconds[:warmup]]}


def write_data_problems(run_dir: Path, data: PreparedData) -> None:
    """Every row not used (error), truncated or read with a remark (warning), one JSON line each."""
    truncated = data.train.truncated + (data.val.truncated if data.val else [])
    with open(run_dir / "logs" / "data_problems.jsonl", "w") as handle:
        for severity, problems in (("error", data.all_problems()),
                                   ("warning", data.all_warnings())):
            for problem in problems:
                handle.write(json.dumps({"origin": problem.origin, "severity": severity,
                                         "reason": problem.reason}, ensure_ascii=False) + "\n")
        for origin in truncated:
            handle.write(json.dumps({"origin": origin, "severity": "warning",
                                     "reason": "truncated to max_length"}) + "\n")


def report_data(data: PreparedData, max_length: int, echo=print) -> None:
    echo(data.summary(max_length))
    problems = data.all_problems()
    for problem in problems[:10]:
        echo(f"  skipped {problem}")
    for warning in data.all_warnings()[:10]:
        echo(f"  warning: {warning}")
    if len(problems) > 10 or len(data.all_warnings()) > 10:
        echo("  ... the full list is in logs/data_problems.jsonl")


def train(config: RunConfig, echo=print) -> TrainResult:
    """Fine-tune config.model with LoRA on config.data; returns where everything was written.

    With config.train.resume the run continues from a complete checkpoint, exactly as if it had
    never stopped, provided the model, data and batch settings are the ones it started with.
    """
    started = time.time()
    precision = choose_precision(config.model.dtype)
    if config.train.tuner == "full":
        check_full_finetuning_precision(precision)
    state = distributed_state(precision)
    cap_gpu_memory()
    check_remote_code(locate_model(config.model.name), config.model.trust_remote_code)
    run_dir = locate_run_dir(config)
    resume_from = resolve_resume(config.train.resume, run_dir, echo) if config.train.resume \
        else None
    check_run_dir(run_dir, config, resume_from)
    tokenizer = load_tokenizer(config.model.name, config.model.trust_remote_code)
    data = prepare_data(config.data, tokenizer, config.train.seed)
    report_data(data, config.data.max_length, echo)
    check_gpu_memory(config, data, echo)
    check_disk_space(config, run_dir, count_optimizer_steps(config, len(data.train.samples)))
    fingerprint = data_fingerprint(data.train.samples)
    open_run_dir(config, run_dir, data, resume_from, fingerprint, echo, state.is_main_process)
    state.wait_for_everyone()
    trainer, output = train_with_oom_retry(config, data, tokenizer, precision, run_dir,
                                           resume_from, fingerprint, echo)
    eval_loss = trainer.evaluate()["eval_loss"] if data.val else None
    full = config.train.tuner == "full"
    saved_dir = run_dir / ("model" if full else "adapter")
    ensure_finite(trainer.model, "the model" if full else "the adapter")
    if full and precision.name == "bf16" and config.train.engine == "ddp":
        trainer.model.to(precision.torch_dtype)  # trained on fp32 master weights; saved in bf16
    # Trainer.save_model gathers sharded weights (ZeRO-3, FSDP) and writes on rank 0 only:
    # adapter (or model) files and tokenizer, plus a pickled training_args.bin that is removed.
    trainer.save_model(str(saved_dir))
    if state.is_main_process:
        (saved_dir / "training_args.bin").unlink(missing_ok=True)
    result = TrainResult(run_dir=run_dir, adapter_dir=None if full else saved_dir,
                         model_dir=saved_dir if full else None,
                         global_step=trainer.state.global_step,
                         train_loss=float(output.training_loss), eval_loss=eval_loss,
                         train_samples=len(data.train.samples),
                         trained_tokens=sum(s.trained_tokens for s in data.train.samples),
                         seconds=round(time.time() - started, 1),
                         nonfinite_skipped_steps=trainer.guard.skipped_steps)
    timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepTimer))
    peaks = peak_memory_per_gpu(timer)
    if state.is_main_process:
        write_summary(result, timer, peaks, trainer.memory_means)
    state.wait_for_everyone()
    if result.nonfinite_skipped_steps:
        echo(f"warning: skipped {len(result.nonfinite_skipped_steps)} update(s) with a NaN or "
             f"inf loss or gradient, at steps {result.nonfinite_skipped_steps}")
    return result


def check_gpu_memory(config: RunConfig, data: PreparedData, echo) -> None:
    """On a GPU, stop before loading the model if the planner says the run will not fit."""
    import torch

    if not (config.train.memory_check and torch.cuda.is_available()):
        return
    from .memory import check_fits

    gpu_gib = gpu_memory_gib()
    packed = pack_training_data(config, data, lambda *_: None) if config.data.packing else None
    plan = check_fits(config, gpu_gib, longest_row(data, packed))
    if plan:
        echo(f"memory plan: about {plan.total_gib:.1f} GiB of {plan.budget_gib:.1f} usable")


def open_run_dir(config: RunConfig, run_dir: Path, data: PreparedData, resume_from: Path | None,
                 fingerprint: dict, echo=print, is_main_process: bool = True) -> None:
    """Refuse drift, then (re)write config.yaml and the data report; trim the step log.

    Every rank checks (so that all of them stop on drift); only the main process writes."""
    if resume_from is not None:
        for change in check_drift(run_dir, resume_from, config, fingerprint, echo):
            echo(f"warning: --allow-config-change: {change}")
    if not is_main_process:
        return
    create_run_dir(run_dir)
    save_config(config, run_dir / "config.yaml")
    write_data_problems(run_dir, data)
    if config.train.resume:
        step = checkpoint_step(resume_from) if resume_from else 0
        trim_step_log(run_dir / "logs" / "train_log.jsonl", step)
        if resume_from:
            echo(f"resuming from {resume_from} (step {step})")


def write_summary(result: TrainResult, timer: StepTimer, peaks: list,
                  memory_means: str = "none") -> None:
    """run_summary.json; with several processes each memory figure is the largest of them, and
    the figure of every process is kept under <name>_per_gpu (rank order)."""
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    summary["memory_means"] = memory_means
    performance = summary["performance"] = timer.summary()
    for key in peaks[0]:
        values = [p.get(key) for p in peaks]
        known = [v for v in values if v is not None]
        performance[key] = max(known) if known else None
        if len(peaks) > 1:
            performance[f"{key}_per_gpu"] = values
    (result.run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def build_trainer(config: RunConfig, data: PreparedData, tokenizer, precision: Precision,
                  run_dir: Path, fingerprint: dict, echo=print):
    from transformers import set_seed

    set_seed(config.train.seed)  # the LoRA initialisation is part of the run's seed
    total_steps = count_optimizer_steps(config, len(data.train.samples))
    # TrainingArguments first: with ZeRO-3 they must exist when the model loads, so that
    # transformers partitions the weights while loading (HfDeepSpeedConfig).
    packed = pack_training_data(config, data, echo) if config.data.packing else None
    args = build_training_arguments(config, run_dir, precision, total_steps, data.val is not None,
                                    packed.rows_per_step if packed else None)
    full = config.train.tuner == "full"
    use_cudnn_attention(config.model.cudnn_attention)
    attention = resolve_packed_attention(config.data.packed_attention)
    model = load_base_model(config.model, precision, fp32_master_weights=full,
                            sharded=config.train.engine in SHARDED_ENGINES,
                            packed_attention=attention if config.data.packing else None)
    memory_means = "none"  # full fine-tuning: the engines' own checkpointing
    if full:
        model = prepare_full_finetuning(model, config.train.gradient_checkpointing)
        total = sum(p.numel() for p in model.parameters())
        echo(f"precision {precision.name} (fp32 master weights); full fine-tuning: all "
             f"{total:,} parameters train")
    else:
        if config.model.quantization == "nf4":
            model = prepare_quantized_for_training(model)
        gpu_gib = gpu_memory_gib()
        means = choose_memory_means(config, on_gpu=gpu_gib is not None,
                                    tied_embeddings=model.config.tie_word_embeddings,
                                    row_tokens=longest_row(data, packed),
                                    budget_gib=usable_gib(gpu_gib))
        model = apply_lora(model, config.lora, config.train.gradient_checkpointing, means)
        memory_means = means.describe()
        trainable, total = model.get_nb_trainable_parameters()
        echo(f"precision {precision.name}; LoRA r={config.lora.rank} alpha={config.lora.alpha}: "
             f"{trainable:,} trainable of {total:,} parameters; kernels "
             f"{resolve_kernels(config.model.kernels)}; memory means: {memory_means}"
             + (f"; packed rows attend with {attention}" if packed else ""))
    guard = NonFiniteGuard(config.train.on_nonfinite, precision.name, run_dir, echo)
    return LoraLabTrainer(
        model=model,
        args=args,
        train_dataset=SupervisedDataset(packed.rows, PACKED_FIELDS) if packed else
        SupervisedDataset(data.train.samples),
        eval_dataset=SupervisedDataset(data.val.samples) if data.val else None,
        data_collator=PackedCollator(tokenizer.pad_token_id, attention)
        if packed else PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=_callbacks(run_dir),
        guard=guard, train_data=fingerprint,
        memory_means=memory_means,
    )


def train_with_oom_retry(config: RunConfig, data: PreparedData, tokenizer, precision: Precision,
                         run_dir: Path, resume_from: Path | None, fingerprint: dict, echo=print):
    """Train; on CUDA out-of-memory halve the micro-batch (same effective batch) and resume."""
    import torch

    while True:
        try:
            trainer = build_trainer(config, data, tokenizer, precision, run_dir, fingerprint,
                                    echo)
        except torch.cuda.OutOfMemoryError:
            raise TrainingError(f"out of GPU memory while loading {config.model.name} "
                                f"({precision.name}): the weights alone do not fit. Use "
                                f"--quantization nf4 (QLoRA), or a preset for a smaller "
                                f"model.") from None
        try:
            output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from
                                   else None)
            return trainer, output
        except torch.cuda.OutOfMemoryError:
            step = trainer.state.global_step + 1
            if world_size() > 1:
                raise TrainingError(
                    f"out of GPU memory at step {step} in one of {world_size()} processes "
                    f"(--micro-batch-size {config.train.micro_batch_size}); with several GPUs "
                    f"lora-lab does not retry. Continue with --micro-batch-size "
                    f"{max(1, config.train.micro_batch_size // 2)} and a doubled --grad-accum "
                    f"(--resume auto), or an engine that shards more (--engine "
                    f"deepspeed-zero3).") from None
        trainer = None
        release_memory()
        shrink_batch_after_oom(config, step, precision, echo)
        save_config(config, run_dir / "config.yaml")
        resume_from = find_resume_checkpoint(run_dir, echo)
        trim_step_log(run_dir / "logs" / "train_log.jsonl",
                      checkpoint_step(resume_from) if resume_from else 0)
        echo(f"resuming from {resume_from}" if resume_from else "no checkpoint yet; starting over")


def release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shrink_batch_after_oom(config: RunConfig, step: int, precision: Precision, echo=print) -> None:
    """Halve micro_batch_size and double grad_accum, or stop with what to change."""
    t = config.train
    if t.micro_batch_size == 1:
        raise TrainingError(
            f"out of GPU memory at step {step} even with --micro-batch-size 1 "
            f"({config.model.name}, {precision.name}, --max-length {config.data.max_length}). "
            f"Lower --max-length (e.g. {max(8, config.data.max_length // 2)}), use a preset for a "
            f"smaller GPU or a smaller model, or --quantization nf4 (QLoRA).")
    if not t.oom_retry:
        raise TrainingError(
            f"out of GPU memory at step {step} with --micro-batch-size {t.micro_batch_size}. "
            f"Continue with --micro-batch-size {t.micro_batch_size // 2} --grad-accum "
            f"{t.grad_accum * 2} --resume auto (same effective batch), or pass --oom-retry to "
            f"let lora-lab do that itself.")
    before, effective = (t.micro_batch_size, t.grad_accum), t.micro_batch_size * t.grad_accum
    t.micro_batch_size = t.micro_batch_size // 2
    t.grad_accum = math.ceil(effective / t.micro_batch_size)
    config.sources["train.micro_batch_size"] = config.sources["train.grad_accum"] = OOM_SOURCE
    kept = t.micro_batch_size * t.grad_accum
    same = f"same effective batch of {effective}" if kept == effective else \
        f"effective batch {effective} -> {kept}: {effective} has no whole half"
    echo(f"warning: out of GPU memory at step {step} with micro-batch {before[0]} x grad-accum "
         f"{before[1]}; retrying with micro-batch {t.micro_batch_size} x grad-accum "
         f"{t.grad_accum} ({same}).")


def prepare_quantized_for_training(model):
    """QLoRA set-up without peft's fp32 upcast of embedding and lm_head (about 2 GiB on 7B)."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model
