"""Fault injection for lora-lab's own tests, put into LoraLabMixin from outside the package.

install() wraps five LoraLabMixin methods; the hooks do nothing unless these are set:

    LORA_LAB_TEST_KILL=step:S:M  SIGKILL the process before micro-batch M of optimizer step S
    LORA_LAB_TEST_KILL=save:S    SIGKILL it while saving checkpoint-S (files staged, no manifest)
    LORA_LAB_TEST_KILL=final     SIGKILL it while saving the final adapter/ (files staged)
    LORA_LAB_TEST_KILL=term:P    send it SIGTERM at point P (one of the above) instead
    LORA_LAB_TEST_KILL=after:T   SIGKILL it T seconds after its trainer is built, wherever it is
                                 (inside a step, a file write, a rename ...)
    LORA_LAB_TEST_NAN_STEP=S     multiply the loss of step S by NaN (its gradients follow)
    LORA_LAB_TEST_TRACE=FILE     append one JSON line per micro-batch: step, micro-batch, a hash
                                 of its input_ids and of the CPU RNG state, the exact loss
    LORA_LAB_TEST_WEIGHTS=FILE   at the end of training, every process appends one JSON line:
                                 its rank and a sha256 of its trainable weights (exact bytes)

pytest installs them in its own process for tests/e2e (tests/e2e/conftest.py); processes started by tests get
them through sitecustomize.py beside this file (tests/support is on their PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

from transformers import TrainerCallback


class FaultHooks(TrainerCallback):
    """The hooks, read from the LORA_LAB_TEST_* variables when a trainer is built."""

    def __init__(self, kill: str | None, nan_step: int | None, trace: str | None, weights: str | None = None):
        self.kill, self.nan_step, self.trace, self.weights = kill, nan_step, trace, weights
        self.step, self.micro_batch = 0, 0
        if kill and kill.startswith("after:"):
            import threading

            timer = threading.Timer(float(kill.split(":", 1)[1]), lambda: os.kill(os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()

    @classmethod
    def from_env(cls) -> FaultHooks:
        nan_step = os.environ.get("LORA_LAB_TEST_NAN_STEP")
        return cls(
            os.environ.get("LORA_LAB_TEST_KILL"),
            int(nan_step) if nan_step else None,
            os.environ.get("LORA_LAB_TEST_TRACE"),
            os.environ.get("LORA_LAB_TEST_WEIGHTS"),
        )

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
        line = (
            json.dumps({"rank": args.process_index, "world_size": args.world_size, "sha256": digest.hexdigest()})
            + "\n"
        )
        with open(self.weights, "a") as handle:
            handle.write(line)

    def kill_point(self, name: str) -> None:
        if self.kill == name:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kill == f"term:{name}":
            os.kill(os.getpid(), signal.SIGTERM)

    def before_micro_batch(self, step: int, inputs) -> None:
        self.step, self.micro_batch = step, self.micro_batch + 1
        self.kill_point(f"step:{step}:{self.micro_batch}")
        if self.trace:
            import torch

            self._record = {
                "step": step,
                "micro_batch": self.micro_batch,
                "inputs": _digest(inputs["input_ids"].cpu().numpy().tobytes()),
                "rng": _digest(torch.get_rng_state().numpy().tobytes()),
            }

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


def install() -> None:
    """Wrap the micro-batch, loss and checkpoint-commit steps of LoraLabMixin (so of
    LoraLabTrainer and the preference trainers) with FaultHooks."""
    from lora_lab.training.trainer import LoraLabMixin

    if getattr(LoraLabMixin, "_fault_hooks_installed", False):
        return
    init = LoraLabMixin.__init__
    training_step, commit = LoraLabMixin.training_step, LoraLabMixin._commit_checkpoint

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.hooks = FaultHooks.from_env()
        self.add_callback(self.hooks)

    def hooked_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the trainer class's own loss (Trainer's, TRL's), after the mixin in the MRO
        result = super(LoraLabMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training:
            return result
        return self.hooks.maybe_poison(result, self.state.global_step + 1)

    def hooked_step(self, model, inputs, num_items_in_batch=None):
        self.hooks.before_micro_batch(self.state.global_step + 1, inputs)
        loss = training_step(self, model, inputs, num_items_in_batch)
        self.hooks.after_micro_batch(loss)
        return loss

    def hooked_commit(self, staging, run_dir, step):
        self.hooks.kill_point(f"save:{step}")
        commit(self, staging, run_dir, step)

    def hooked_save(self, output_dir=None, _internal_call=False):
        super(LoraLabMixin, self).save_model(output_dir, _internal_call)
        if not _internal_call and str(output_dir).endswith(".partial"):  # the final weights
            self.hooks.kill_point("final")

    LoraLabMixin.save_model = hooked_save
    LoraLabMixin.__init__, LoraLabMixin.compute_loss = __init__, hooked_loss
    LoraLabMixin.training_step, LoraLabMixin._commit_checkpoint = hooked_step, hooked_commit
    LoraLabMixin._fault_hooks_installed = True
