"""The Trainer lora-lab trains with: crash-safe checkpoints, and no NaN or inf update applied.

LoraLabMixin changes six things in transformers' Trainer (LoraLabTrainer mixes it into
Trainer; training/preference.py into TRL's preference trainers):
  - a checkpoint is staged, fsynced, given a manifest and only then renamed to checkpoint-N
    (training/checkpoint.py); rotation runs after that, so nothing is deleted before the new one
    is complete. Training arguments are saved as JSON, never pickled.
  - NonFiniteGuard looks at the loss of every micro-batch and at the gradients before every
    optimizer step: a NaN or inf is never applied. The run stops (--on-nonfinite stop) or the
    update is skipped and counted (--on-nonfinite skip).
  - no checkpoint or adapter is written while a trainable tensor is not finite.
  - every training log event carries tokens/s, GPU memory and the skipped updates, and the
    progress line (training/watch.py) takes the place of the tqdm bar and printed dicts.
  - the learning-rate warm-up's first step trains (training/args.py, build_scheduler), where the
    Trainer's runs at learning rate 0.
  - a run resumed under torch DDP replays DDP's bucket rebuild before its first micro-batch
    (replay_bucket_rebuild), so it reduces gradients in the buckets the uninterrupted run had.
It also keeps the Trainer's per-step Python off the GPU's critical path: the Trainer walks every
module (thousands in a PEFT 7B, milliseconds each while the GPU waits) for model.train() on every
micro-batch, for the flop count of every micro-batch and for clipping and zero_grad at every
optimizer step; here each of those reads what was listed once (same tensors, same order).
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from transformers import Trainer
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback

from ..log import get_logger
from ..models.memory_means import uses_cpu_embedding
from ..run_folder import Checkpoint, RunFolder
from ..run_folder.names import TRAINING_ARGS_FILE, TRAINING_ARGS_PICKLE
from .callbacks import NonFiniteGuard, ensure_finite
from .checkpoint import commit_checkpoint, rotate_checkpoints, staging_dir, write_manifest
from .ddp_buckets import rebuilds_buckets, replay_bucket_rebuild
from .watch import ProgressLine, StepMetrics

log = get_logger()

LOSS_SUM_KEY = "LoraLabLossSum"
"""trainer_state.json stateful_callbacks entry: the loss summed over every optimizer step so far,
so that a resumed run reports the mean over all its steps, not over those since the resume."""


TRAIN_MODE_SET = "_lora_lab_train_mode_set"
BUCKETS_CHECKED = "_lora_lab_buckets_checked"
WARM_UP_TOKENS = 8
"""Token ids in the row a resumed DDP run warms up with (replay_bucket_rebuild)."""


@contextmanager
def train_mode_kept(model):
    """Inside, model.train() returns at once: the first call walks every module, later ones only
    while the root still reports training mode since that walk (a root eval(), as evaluation
    does, clears it, and the next call walks again)."""
    if not (model.training and model.__dict__.get(TRAIN_MODE_SET)):
        model.train()
        model.__dict__[TRAIN_MODE_SET] = True
    model.__dict__["train"] = lambda mode=True: model if mode else type(model).train(model, mode)
    try:
        yield
    finally:
        model.__dict__.pop("train", None)


def saved_loss_sum(checkpoint: Path | None) -> float:
    """The summed step losses a checkpoint recorded (0 without a checkpoint)."""
    if checkpoint is None:
        return 0.0
    state = json.loads(Checkpoint(Path(checkpoint)).trainer_state.read_text())
    return float(state.get("stateful_callbacks", {}).get(LOSS_SUM_KEY, {}).get("loss_sum", 0.0))


if TYPE_CHECKING:
    _Base = Trainer  # the mixin is only ever mixed in before a Trainer subclass
else:
    _Base = object


class LoraLabMixin(_Base):
    """lora-lab's guarantees for any transformers Trainer subclass: crash-safe checkpoints, the
    non-finite guard, the loss sum an exact resume reports. Mixed in before the trainer class
    (LoraLabTrainer here; TRL's preference trainers in training/preference.py)."""

    def __init__(
        self,
        *args,
        guard: NonFiniteGuard,
        train_data: dict | None = None,
        memory_means: str = "none",
        resumed_loss_sum: float = 0.0,
        loraplus_lr_ratio: float = 0.0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.loraplus_lr_ratio = loraplus_lr_ratio
        """train.loraplus_lr_ratio: above 0, create_optimizer builds peft's LoRA+ optimizer."""
        self.guard, self.train_data = guard, train_data
        self.memory_means = memory_means  # planning.memory.MemoryMeans.describe(), for the summary
        self.resumed_loss_sum = resumed_loss_sum
        """Summed step losses of the steps before the checkpoint this run resumed from."""
        # listed once (see the module doc)
        self._trained: tuple[Any, list] | None = None
        self._parameter_count: int | None = None
        self.add_callback(guard)
        self.step_metrics = StepMetrics(guard)
        for bar in (ProgressCallback, PrinterCallback, DEFAULT_PROGRESS_CALLBACK):
            self.remove_callback(bar)  # the progress line says it instead of printed dicts
        self.add_callback(ProgressLine())

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """A training log event gains lora-lab's figures (training/watch.py) before the step
        log, TensorBoard and the --report-to backends see it."""
        if "loss" in logs:
            reduce = self._sum_over_processes if self.args.world_size > 1 else None
            logs.update(self.step_metrics.take(reduce))
        super().log(logs, start_time)

    def _sum_over_processes(self, count):
        import torch

        total = torch.as_tensor(count, dtype=torch.float64, device=self.args.device)
        return self.accelerator.reduce(total, reduction="sum").item()

    def run_loss_sum(self) -> float:
        """Step losses summed from the run's first step to now (every rank calls it: the part
        not logged yet is averaged over the processes, as the Trainer's logging does)."""
        from transformers.trainer_pt_utils import nested_gather

        pending = nested_gather(self._tr_loss.detach(), self.args.parallel_mode).mean().item()
        return self.resumed_loss_sum + self._total_loss_scalar + pending

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's schedule, but the warm-up's first step already trains (args.build_scheduler)."""
        if self.lr_scheduler is None:
            from .args import build_scheduler

            self.lr_scheduler = build_scheduler(self.args, optimizer or self.optimizer, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (AdamW, its betas, eps and weight decay), but with
        train.loraplus_lr_ratio the parameter groups of peft's create_loraplus_optimizer: the
        LoRA B matrices (and 1-D tensors such as DoRA's magnitudes) at lr x ratio."""
        if not self.loraplus_lr_ratio or self.optimizer is not None:
            return super().create_optimizer(model)
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        kwargs.pop("lr", None)
        self.optimizer = create_loraplus_optimizer(
            model or self.model,
            optimizer_cls,
            lr=self.args.learning_rate,
            loraplus_lr_ratio=self.loraplus_lr_ratio,
            loraplus_weight_decay=self.args.weight_decay,
            **kwargs,
        )
        return self.optimizer

    def _prepare_inputs(self, inputs):
        """The batch on the model's device, but input ids for an embedding kept in CPU memory
        stay on the CPU (models.memory_means.CpuEmbedding looks them up there)."""
        if not hasattr(inputs, "get"):  # grpo: prompts, whose completions are sampled in here
            prepared = super()._prepare_inputs(inputs)
            if self.model.training:
                self.step_metrics.note_batch(prepared)
            return prepared
        ids = inputs.get("input_ids")
        if ids is None or ids.device.type != "cpu" or not uses_cpu_embedding(self.model):
            return super()._prepare_inputs(inputs)
        prepared = super()._prepare_inputs({k: v for k, v in inputs.items() if k != "input_ids"})
        return {**prepared, "input_ids": ids}

    def _lists_parameters(self) -> bool:
        """Whether clipping and zero_grad may use the listed parameters: one process or DDP
        (DeepSpeed and FSDP clip and zero their own shards)."""
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)

    def _trained_parameters(self, model) -> list:
        """model's parameters that train, in model.parameters() order, listed once per model."""
        if self._trained is None or self._trained[0] is not model:
            self._trained = (model, [p for p in model.parameters() if p.requires_grad])
        return self._trained[1]

    def _clip_grad_norm(self, model):
        """The Trainer's clipping over the listed parameters (those without a gradient are
        skipped by torch either way); its norm is the one the non-finite guard checks, so the
        gradients are not read twice a step."""
        if self._lists_parameters():
            norm = self.accelerator.clip_grad_norm_(self._trained_parameters(model), self.args.max_grad_norm)
        else:
            norm = super()._clip_grad_norm(model)
        self.guard.clipped_norm = norm
        return norm

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's 6 x tokens x parameters without embeddings, the count taken once."""
        model: Any = self.model  # a transformers or PEFT model when it has num_parameters
        main = getattr(model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(model, "num_parameters"):
            return 0
        if self._parameter_count is None:
            self._parameter_count = model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._parameter_count

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.step_metrics.note_batch(inputs)
        if self._lists_parameters() and "zero_grad" not in model.__dict__:
            model.__dict__["zero_grad"] = self._zero_grad_of(model)
        with train_mode_kept(model):
            self._replay_bucket_rebuild_once(model)
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.guard.note_loss(loss)
        return loss

    def _replay_bucket_rebuild_once(self, model) -> None:
        """Before the first micro-batch a DDP model trains in a run resumed past step 0 (every
        rank resumes at the same step, so every rank takes part): replay_bucket_rebuild on a
        row of WARM_UP_TOKENS token ids. The order gradients become ready is the autograd
        graph's, not the tokens': every trained parameter takes part in every forward, as
        find_unused_parameters=False requires. DeepSpeed and FSDP models are no DDP: skipped."""
        if BUCKETS_CHECKED in model.__dict__:
            return
        model.__dict__[BUCKETS_CHECKED] = True
        if self.state.global_step == 0 or not rebuilds_buckets(model):
            return
        import torch

        ids = torch.arange(WARM_UP_TOKENS)[None]
        inputs = self._prepare_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

        def loss_of(ddp):
            with self.compute_loss_context_manager():
                return ddp(**inputs).logits.float().mean()

        log.info(
            f"resumed under DDP: one zero-weighted forward and backward of "
            f"{WARM_UP_TOKENS} tokens, so that DDP's gradient buckets are those of the "
            f"uninterrupted run"
        )
        replay_bucket_rebuild(model, loss_of)

    def _zero_grad_of(self, model):
        """model.zero_grad for the Trainer's loop: only trained parameters hold gradients."""
        params = self._trained_parameters(model)

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none:
                return type(model).zero_grad(model, set_to_none)
            for param in params:
                param.grad = None

        return zero_grad

    def _save_checkpoint(self, model, trial) -> None:
        """Stage every file, fsync, write the manifest, rename; then rotate old checkpoints.

        With several processes each writes its own files (RNG state) into the staging folder;
        the main process alone writes the manifest, renames and rotates."""
        assert self.args.output_dir is not None, "TrainingArguments fills output_dir in"
        run_dir, step = Path(self.args.output_dir), self.state.global_step
        ensure_finite(self.model, RunFolder(run_dir).checkpoint(step).path.name)
        self._stateful_callbacks()[LOSS_SUM_KEY] = {"loss_sum": self.run_loss_sum()}
        staging = staging_dir(run_dir, step)
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self.store_flos()
        self.save_model(str(staging), _internal_call=True)
        if not self.args.save_only_model:  # train.save_only_model: the weights alone
            self._save_optimizer_and_scheduler(str(staging))
            self._save_scaler(str(staging))
            self._save_rng_state(str(staging))
        if self.args.should_save:
            (staging / TRAINING_ARGS_PICKLE).unlink(missing_ok=True)  # pickled: JSON instead
            (staging / TRAINING_ARGS_FILE).write_text(self.args.to_json_string())
            self._save_trainer_state(staging)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._commit_checkpoint(staging, run_dir, step)
        self.accelerator.wait_for_everyone()

    def _commit_checkpoint(self, staging: Path, run_dir: Path, step: int) -> None:
        """Main process: the staged files are complete; manifest, rename, rotate."""
        write_manifest(staging, step, self.train_data)
        final = commit_checkpoint(staging, RunFolder(run_dir).checkpoint(step).path)
        rotate_checkpoints(run_dir, self.args.save_total_limit, final, keep=(self.state.best_model_checkpoint,))

    def _stateful_callbacks(self) -> dict[str, Any]:
        """TrainerState.stateful_callbacks: a dict from TrainerState.__post_init__ on, though
        transformers annotates it as a list."""
        return cast(dict[str, Any], self.state.stateful_callbacks)

    def _save_trainer_state(self, folder: Path) -> None:
        """trainer_state.json, with the state of stateful callbacks (as Trainer does)."""
        stateful = self._stateful_callbacks()
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name, value = callback.__class__.__name__, callback.state()
                if isinstance(stateful.get(name), list):
                    stateful[name].append(value)
                else:
                    stateful[name] = value
        self.state.save_to_json(str(Checkpoint(folder).trainer_state))


class LoraLabTrainer(LoraLabMixin, Trainer):
    """transformers' Trainer with crash-safe checkpoints and the non-finite guard."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss; a mixture of experts' load-balancing loss (aux_loss) of a training
        micro-batch is noted for the step log (model.router_aux_loss_coef weighs it in)."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else getattr(outputs, "aux_loss", None)
        if aux is not None and model.training:
            self.step_metrics.note_aux_loss(aux)
        return (loss, outputs) if return_outputs else loss
