"""The Trainer lora-lab trains with: crash-safe checkpoints, and no NaN or inf update applied.

LoraLabTrainer changes three things in transformers' Trainer:
  - a checkpoint is staged, fsynced, given a manifest and only then renamed to checkpoint-N
    (training/checkpoint.py); rotation runs after that, so nothing is deleted before the new one
    is complete. Training arguments are saved as JSON, never pickled.
  - NonFiniteGuard looks at the loss of every micro-batch and at the gradients before every
    optimizer step: a NaN or inf is never applied. The run stops (--on-nonfinite stop) or the
    update is skipped and counted (--on-nonfinite skip).
  - no checkpoint or adapter is written while a trainable tensor is not finite.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from transformers import Trainer
from transformers.trainer_callback import ExportableState

from .callbacks import NonFiniteGuard, ensure_finite
from .checkpoint import commit_checkpoint, rotate_checkpoints, staging_dir, write_manifest


class LoraLabTrainer(Trainer):
    """transformers' Trainer with crash-safe checkpoints and the non-finite guard."""

    def __init__(self, *args, guard: NonFiniteGuard, train_data: dict | None = None,
                 memory_means: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.guard, self.train_data = guard, train_data
        self.memory_means = memory_means  # planning.memory.MemoryMeans.describe(), for the summary
        self.add_callback(guard)

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


# ----------------------------------------------------------------------------- test hooks
