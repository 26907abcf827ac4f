"""The Trainer lora-lab trains with: crash-safe checkpoints, and no NaN or inf update applied.

LoraLabTrainer changes three things in transformers' Trainer:
  - a checkpoint is staged, fsynced, given a manifest and only then renamed to checkpoint-N
    (lora_lab.checkpoint); rotation runs after that, so nothing is deleted before the new one
    is complete. Training arguments are saved as JSON, never pickled.
  - NonFiniteGuard looks at the loss of every micro-batch and at the gradients before every
    optimizer step: a NaN or inf is never applied. The run stops (--on-nonfinite stop) or the
    update is skipped and counted (--on-nonfinite skip).
  - no checkpoint or adapter is written while a trainable tensor is not finite.

FaultHooks, at the end, lets lora-lab's own tests kill the process or plant a NaN at a chosen
step. It does nothing unless LORA_LAB_TEST_* environment variables are set.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from .checkpoint import commit_checkpoint, rotate_checkpoints, staging_dir, write_manifest
from .errors import TrainingError


def nonfinite_tensors(model) -> list[str]:
    """Names of trainable parameters holding a NaN or inf."""
    import torch

    return [name for name, param in model.named_parameters()
            if param.requires_grad and not bool(torch.isfinite(param).all())]


def ensure_finite(model, what: str) -> None:
    bad = nonfinite_tensors(model)
    if bad:
        raise TrainingError(f"not writing {what}: {len(bad)} trainable tensors hold NaN or inf "
                            f"(first: {bad[0]}). Resume from the last checkpoint.")


def nonfinite_message(step: int, what: str, precision: str, run_dir: Path) -> str:
    if precision == "fp16":
        cause = ("fp16 overflow: Qwen2.5's activations exceed fp16's range. Train in bf16 "
                 "(--dtype bf16) on a GPU that has it, or fp32")
    else:
        cause = ("a learning rate too high for this data (try a lower --lr or more warm-up), "
                 "or a sample that breaks the loss")
    return (f"step {step}: {what}. The update was not applied and the run stopped. Likely cause: "
            f"{cause}. The checkpoints in {run_dir} hold only finite weights; fix the cause and "
            f"continue with --resume auto, or pass --on-nonfinite skip to skip such updates.")


class NonFiniteGuard(TrainerCallback):
    """Never applies a NaN or inf loss or gradient: stops the run, or skips the update."""

    def __init__(self, policy: str, precision: str, run_dir: Path, echo=print):
        self.policy, self.precision, self.run_dir, self.echo = policy, precision, run_dir, echo
        self.skipped_steps: list[int] = []
        self._bad_loss = None

    def note_loss(self, loss) -> None:
        import torch

        if self._bad_loss is None and not bool(torch.isfinite(loss).all()):
            self._bad_loss = f"the loss is {loss.item()}"

    def _bad_gradient(self, model) -> str | None:
        import torch

        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            return None
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                     for g in grads]))
        return None if bool(torch.isfinite(norm)) else f"the gradient norm is {norm.item()}"

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        # With fp16 the loss scaler skips steps whose (scaled) gradients overflow by design.
        found = self._bad_loss or (None if args.fp16 else self._bad_gradient(model))
        self._bad_loss = None
        if found is None:
            return
        step = state.global_step + 1
        if self.policy == "stop":
            raise TrainingError(nonfinite_message(step, found, self.precision, self.run_dir))
        if not args.fp16:  # (with fp16 the scaler sees the NaN in the gradients and skips)
            optimizer.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves it be
        self.skipped_steps.append(step)
        self.echo(f"warning: step {step}: {found}; update skipped "
                  f"({len(self.skipped_steps)} skipped so far)")


class LoraLabTrainer(Trainer):
    """transformers' Trainer with crash-safe checkpoints and the non-finite guard."""

    def __init__(self, *args, guard: NonFiniteGuard, train_data: dict | None = None,
                 memory_means: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.guard, self.train_data = guard, train_data
        self.memory_means = memory_means  # lora_lab.memory.MemoryMeans.describe(), for the summary
        self.hooks = FaultHooks.from_env()
        self.add_callback(guard)
        self.add_callback(self.hooks)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training:
            return result
        return self.hooks.maybe_poison(result, self.state.global_step + 1)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.hooks.before_micro_batch(self.state.global_step + 1, inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.guard.note_loss(loss)
        self.hooks.after_micro_batch(loss)
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
            self.hooks.kill_point(f"save:{step}")
            write_manifest(staging, step, self.train_data)
            final = commit_checkpoint(staging, run_dir / f"checkpoint-{step}")
            rotate_checkpoints(run_dir, self.args.save_total_limit, final,
                               keep=(self.state.best_model_checkpoint,))
        self.accelerator.wait_for_everyone()

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

class FaultHooks(TrainerCallback):
    """Fault injection for lora-lab's tests; inert unless these variables are set:

    LORA_LAB_TEST_KILL=step:S:M  SIGKILL this process before micro-batch M of optimizer step S
    LORA_LAB_TEST_KILL=save:S    SIGKILL it while saving checkpoint-S (files staged, no manifest)
    LORA_LAB_TEST_NAN_STEP=S     multiply the loss of step S by NaN (its gradients follow)
    LORA_LAB_TEST_TRACE=FILE     append one JSON line per micro-batch: step, micro-batch, a hash
                                 of its input_ids and of the CPU RNG state, the exact loss
    LORA_LAB_TEST_WEIGHTS=FILE   at the end of training, every process appends one JSON line:
                                 its rank and a sha256 of its trainable weights (exact bytes)
    """

    def __init__(self, kill: str | None, nan_step: int | None, trace: str | None,
                 weights: str | None = None):
        self.kill, self.nan_step, self.trace, self.weights = kill, nan_step, trace, weights
        self.step, self.micro_batch = 0, 0

    @classmethod
    def from_env(cls) -> FaultHooks:
        nan_step = os.environ.get("LORA_LAB_TEST_NAN_STEP")
        return cls(os.environ.get("LORA_LAB_TEST_KILL"), int(nan_step) if nan_step else None,
                   os.environ.get("LORA_LAB_TEST_TRACE"), os.environ.get("LORA_LAB_TEST_WEIGHTS"))

    def on_step_begin(self, args, state, control, **kwargs):
        self.micro_batch = 0

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.weights or model is None:
            return
        digest = hashlib.sha256()
        for name, param in sorted(model.named_parameters()):
            if param.requires_grad:
                digest.update(name.encode())
                digest.update(param.detach().float().cpu().numpy().tobytes())
        line = json.dumps({"rank": args.process_index, "world_size": args.world_size,
                           "sha256": digest.hexdigest()}) + "\n"
        with open(self.weights, "a") as handle:
            handle.write(line)

    def kill_point(self, name: str) -> None:
        if self.kill == name:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_micro_batch(self, step: int, inputs) -> None:
        self.step, self.micro_batch = step, self.micro_batch + 1
        self.kill_point(f"step:{step}:{self.micro_batch}")
        if self.trace:
            import torch

            self._record = {"step": step, "micro_batch": self.micro_batch,
                            "inputs": _digest(inputs["input_ids"].cpu().numpy().tobytes()),
                            "rng": _digest(torch.get_rng_state().numpy().tobytes())}

    def after_micro_batch(self, loss) -> None:
        if self.trace:
            with open(self.trace, "a") as handle:
                handle.write(json.dumps({**self._record, "loss": float(loss).hex()}) + "\n")

    def maybe_poison(self, result, step: int):
        if self.nan_step != step:
            return result
        if isinstance(result, tuple):
            return (result[0] * float("nan"),) + tuple(result[1:])
        return result * float("nan")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
