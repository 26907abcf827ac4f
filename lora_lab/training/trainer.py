"""The Trainer lora-lab trains with: crash-safe checkpoints, and no NaN or inf update applied.

LoraLabMixin changes three things in transformers' Trainer (LoraLabTrainer mixes it into
Trainer; training/preference.py into TRL's preference trainers):
  - a checkpoint is staged, fsynced, given a manifest and only then renamed to checkpoint-N
    (training/checkpoint.py); rotation runs after that, so nothing is deleted before the new one
    is complete. Training arguments are saved as JSON, never pickled.
  - NonFiniteGuard looks at the loss of every micro-batch and at the gradients before every
    optimizer step: a NaN or inf is never applied. The run stops (--on-nonfinite stop) or the
    update is skipped and counted (--on-nonfinite skip).
  - no checkpoint or adapter is written while a trainable tensor is not finite.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import Trainer
from transformers.trainer_callback import ExportableState

from ..models.memory_means import uses_cpu_embedding
from .callbacks import NonFiniteGuard, ensure_finite
from .checkpoint import commit_checkpoint, rotate_checkpoints, staging_dir, write_manifest


LOSS_SUM_KEY = "LoraLabLossSum"
"""trainer_state.json stateful_callbacks entry: the loss summed over every optimizer step so far,
so that a resumed run reports the mean over all its steps, not over those since the resume."""


def saved_loss_sum(checkpoint: Path | None) -> float:
    """The summed step losses a checkpoint recorded (0 without a checkpoint)."""
    if checkpoint is None:
        return 0.0
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return float(state.get("stateful_callbacks", {}).get(LOSS_SUM_KEY, {}).get("loss_sum", 0.0))


class LoraLabMixin:
    """lora-lab's guarantees for any transformers Trainer subclass: crash-safe checkpoints, the
    non-finite guard, the loss sum an exact resume reports. Mixed in before the trainer class
    (LoraLabTrainer here; TRL's preference trainers in training/preference.py)."""

    def __init__(self, *args, guard: NonFiniteGuard, train_data: dict | None = None,
                 memory_means: str = "none", resumed_loss_sum: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard, self.train_data = guard, train_data
        self.memory_means = memory_means  # planning.memory.MemoryMeans.describe(), for the summary
        self.resumed_loss_sum = resumed_loss_sum
        """Summed step losses of the steps before the checkpoint this run resumed from."""
        self.add_callback(guard)

    def run_loss_sum(self) -> float:
        """Step losses summed from the run's first step to now (every rank calls it: the part
        not logged yet is averaged over the processes, as the Trainer's logging does)."""
        from transformers.trainer_pt_utils import nested_gather

        pending = nested_gather(self._tr_loss.detach(), self.args.parallel_mode).mean().item()
        return self.resumed_loss_sum + self._total_loss_scalar + pending

    def _prepare_inputs(self, inputs):
        """The batch on the model's device, but input ids for an embedding kept in CPU memory
        stay on the CPU (models.memory_means.CpuEmbedding looks them up there)."""
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if ids is None or ids.device.type != "cpu" or not uses_cpu_embedding(self.model):
            return super()._prepare_inputs(inputs)
        prepared = super()._prepare_inputs({k: v for k, v in inputs.items() if k != "input_ids"})
        return {**prepared, "input_ids": ids}

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.guard.note_loss(loss)
        return loss

    def _save_checkpoint(self, model, trial) -> None:
        """Stage every file, fsync, write the manifest, rename; then rotate old checkpoints.

        With several processes each writes its own files (RNG state) into the staging folder;
        the main process alone writes the manifest, renames and rotates."""
        run_dir, step = Path(self.args.output_dir), self.state.global_step
        ensure_finite(self.model, f"checkpoint-{step}")
        self.state.stateful_callbacks[LOSS_SUM_KEY] = {"loss_sum": self.run_loss_sum()}
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
            (staging / "training_args.bin").unlink(missing_ok=True)  # pickled: JSON instead
            (staging / "training_args.json").write_text(self.args.to_json_string())
            self._save_trainer_state(staging)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._commit_checkpoint(staging, run_dir, step)
        self.accelerator.wait_for_everyone()

    def _commit_checkpoint(self, staging: Path, run_dir: Path, step: int) -> None:
        """Main process: the staged files are complete; manifest, rename, rotate."""
        write_manifest(staging, step, self.train_data)
        final = commit_checkpoint(staging, run_dir / f"checkpoint-{step}")
        rotate_checkpoints(run_dir, self.args.save_total_limit, final,
                           keep=(self.state.best_model_checkpoint,))

    def _save_trainer_state(self, folder: Path) -> None:
        """trainer_state.json, with the state of stateful callbacks (as Trainer does)."""
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name, value = callback.__class__.__name__, callback.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(value)
                else:
                    self.state.stateful_callbacks[name] = value
        self.state.save_to_json(str(folder / "trainer_state.json"))


class LoraLabTrainer(LoraLabMixin, Trainer):
    """transformers' Trainer with crash-safe checkpoints and the non-finite guard."""


# ----------------------------------------------------------------------------- test hooks
