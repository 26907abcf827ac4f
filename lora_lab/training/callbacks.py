"""Trainer callbacks: the step log, step timing and memory figures, the non-finite guard."""
from __future__ import annotations

import json
import signal
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from ..errors import TrainingError
from ..log import get_logger
from ..run_folder import LOGS_FOLDER, STEP_LOG

log = get_logger()

def run_callbacks(run_dir: Path, report_to: list) -> list:
    """TensorBoard events (report_to holds tensorboard), the JSON step log, the step timer and
    the signal stop of a run. The other --report-to backends are the Trainer's own callbacks
    (TrainingArguments.report_to)."""
    callbacks = [JsonlLog(run_dir / STEP_LOG), StepTimer(), StopOnSignal()]
    if "tensorboard" in report_to:
        from transformers.integrations import TensorBoardCallback

        tensorboard = TensorBoardCallback()
        tensorboard.logging_dir = str(run_dir / LOGS_FOLDER)  # also after train end (final eval)
        callbacks.insert(0, tensorboard)
    return callbacks


def cuda_memory_gib(name: str) -> float | None:
    """torch.cuda.<name>() (memory_reserved, max_memory_allocated ...) in GiB; None without CUDA."""
    import torch

    return getattr(torch.cuda, name)() / 2**30 if torch.cuda.is_available() else None


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

    def _once(self, **figures):
        for key, name in figures.items():
            self.phases.setdefault(key, cuda_memory_gib(name))

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
        figures = {"peak_reserved_gib": cuda_memory_gib("max_memory_reserved"), **self.phases,
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

    def __init__(self, policy: str, precision: str, run_dir: Path):
        self.policy, self.precision, self.run_dir = policy, precision, run_dir
        self.skipped_steps: list[int] = []
        self._losses = []  # this step's micro-batch losses, read on the host once per step
        self.clipped_norm = None
        """The gradient norm the Trainer's clipping computed for this step (a tensor), set by
        LoraLabMixin._clip_grad_norm; the guard then reads it instead of computing its own."""

    def note_loss(self, loss) -> None:
        self._losses.append(loss.detach().reshape(-1))

    def _bad_loss(self) -> str | None:
        import torch

        if not self._losses:
            return None
        losses, self._losses = torch.cat(self._losses), []
        finite = torch.isfinite(losses)
        if bool(finite.all()):
            return None
        return f"the loss is {losses[~finite][0].item()}"

    def _bad_gradient(self, model) -> str | None:
        import torch

        norm, self.clipped_norm = self.clipped_norm, None
        if not isinstance(norm, torch.Tensor):
            grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
            if not grads:
                return None
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                         for g in grads]))
        return None if bool(torch.isfinite(norm)) else f"the gradient norm is {norm.item()}"

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        # With fp16 the loss scaler skips steps whose (scaled) gradients overflow by design.
        found = self._bad_loss() or (None if args.fp16 else self._bad_gradient(model))
        if found is None:
            return
        step = state.global_step + 1
        if self.policy == "stop":
            raise TrainingError(nonfinite_message(step, found, self.precision, self.run_dir))
        if not args.fp16:  # (with fp16 the scaler sees the NaN in the gradients and skips)
            optimizer.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves it be
        self.skipped_steps.append(step)
        log.warning(f"warning: step {step}: {found}; update skipped "
                    f"({len(self.skipped_steps)} skipped so far)")


class StopOnSignal(TrainerCallback):
    """SIGTERM or SIGINT (a scheduler's or spot instance's notice, Ctrl-C): finish the optimizer
    step under way, save a complete checkpoint, stop. A second signal acts at once, as if lora-lab
    had not caught the first. With several processes they stop at the same step: the flag is
    combined across ranks at the end of every step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        self.received = signum
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # the next signal: the default behaviour

    def on_train_begin(self, args, state, control, **kwargs):
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = {n: signal.signal(n, self._handle) for n in self.SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_rank_received(args):
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _any_rank_received(self, args) -> bool:
        import torch

        if args.world_size <= 1 or not torch.distributed.is_initialized():
            return self.received is not None
        flag = torch.tensor([self.received or 0], device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self.received = int(flag.item()) or None
        return self.received is not None
