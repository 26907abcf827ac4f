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
from ..run_folder.names import LOGS_FOLDER, STEP_LOG

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
    """The time of every optimizer step and the memory figures of run_summary.json.

    On a GPU a step is timed by CUDA events (from one step's end to the next on the GPU's
    timeline), so timing adds no host wait: the host may queue the next step before this one
    has run, as it does untimed.

    GPU figures are torch.cuda's, in GiB: the reserved peak (what the planner predicts) overall,
    before training (model and engine set up) and up to the end of training; for the first
    optimizer step the allocated peak of its forward and backward passes, what stays allocated
    when they are done (weights, gradients, optimizer state) and the allocated peak of the
    optimizer's update (DeepSpeed updates inside its backward pass: there the forward and
    backward figure includes it). cpu_peak_rss_gib: this process's resident CPU memory peak
    (what the offload engines are planned with)."""

    def __init__(self):
        self._spans, self._last = [], None  # (start, end) marks of every step
        self.phases = {}

    def _once(self, **figures):
        for key, name in figures.items():
            self.phases.setdefault(key, cuda_memory_gib(name))

    def on_train_begin(self, args, state, control, **kwargs):
        """The peak so far: loading the model and setting up the engine."""
        self._once(peak_reserved_gib_before_training="max_memory_reserved")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._once(
            peak_allocated_gib_forward_backward="max_memory_allocated", allocated_gib_before_update="memory_allocated"
        )

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._once(peak_allocated_gib_update="max_memory_allocated")

    def on_train_end(self, args, state, control, **kwargs):
        """The peak up to the end of training: before the final evaluation and save (a ZeRO-3
        or FSDP save gathers the whole model)."""
        self._once(peak_reserved_gib_training="max_memory_reserved")

    def memory(self) -> dict:
        import resource

        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        figures = {
            "peak_reserved_gib": cuda_memory_gib("max_memory_reserved"),
            **self.phases,
            "cpu_peak_rss_gib": rss_kib / 2**20,
        }
        return {k: None if v is None else round(v, 4) for k, v in figures.items()}

    @staticmethod
    def _mark():
        """A point in time that costs the GPU no wait: a CUDA event recorded on the current
        stream (read after training), or the host's clock without a GPU. A step's time is from
        one step's end to the next on the GPU's timeline, the idle stretches included."""
        import torch

        if not torch.cuda.is_available():
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_step_begin(self, args, state, control, **kwargs):
        if self._last is None:
            self._last = self._mark()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._mark()
        self._spans.append((self._last, now))
        self._last = now

    @property
    def step_seconds(self) -> list[float]:
        if self._spans and not isinstance(self._spans[-1][1], float):
            self._spans[-1][1].synchronize()
        return [
            end - start if isinstance(end, float) else start.elapsed_time(end) / 1000 for start, end in self._spans
        ]

    def summary(self, warmup: int = 2) -> dict:
        seconds = self.step_seconds
        timed = seconds[warmup:] or seconds
        return {
            "median_step_seconds": statistics.median(timed) if timed else None,
            "timed_steps": len(timed),
            "first_step_seconds": [round(s, 3) for s in seconds[:warmup]],
        }


def nonfinite_tensors(model) -> list[str]:
    """Names of trainable parameters holding a NaN or inf."""
    import torch

    return [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and not bool(torch.isfinite(param).all())
    ]


def ensure_finite(model, what: str) -> None:
    bad = nonfinite_tensors(model)
    if bad:
        raise TrainingError(
            f"not writing {what}: {len(bad)} trainable tensors hold NaN or inf "
            f"(first: {bad[0]}). Resume from the last checkpoint."
        )


def nonfinite_message(step: int, what: str, precision: str, run_dir: Path) -> str:
    if precision == "fp16":
        cause = (
            "fp16 overflow: Qwen2.5's activations exceed fp16's range. Train in bf16 "
            "(--dtype bf16) on a GPU that has it, or fp32"
        )
    else:
        cause = (
            "a learning rate too high for this data (try a lower --lr or more warm-up), "
            "or a sample that breaks the loss"
        )
    return (
        f"step {step}: {what}. The update was not applied and the run stopped. Likely cause: "
        f"{cause}. The checkpoints in {run_dir} hold only finite weights; fix the cause and "
        f"continue with --resume auto, or pass --on-nonfinite skip to skip such updates."
    )


def skippable_on_device(optimizer):
    """The torch optimizer under `optimizer` when it can skip an update on its own device: fused
    Adam or AdamW (AdamW's subclass) over parameters on one device take a `found_inf` flag, as
    GradScaler hands them, and a nonzero flag leaves parameters, moments and step counts as they
    were. None for any other optimizer."""
    import torch

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # under accelerate's AcceleratedOptimizer
    if not isinstance(optimizer, torch.optim.Adam):
        return None
    groups = optimizer.param_groups
    devices = {param.device for group in groups for param in group["params"]}
    return optimizer if len(devices) == 1 and all(g.get("fused") for g in groups) else None


def _describe(figures, losses: int) -> str | None:
    """What is not finite among a step's figures: its `losses` micro-batch losses, then (where
    there is one) its gradient norm. figures: a 1-D tensor in host memory."""
    import torch

    finite = torch.isfinite(figures)
    if bool(finite.all()):
        return None
    if not bool(finite[:losses].all()):
        return f"the loss is {figures[:losses][~finite[:losses]][0].item()}"
    return f"the gradient norm is {figures[losses].item()}"


class NonFiniteGuard(TrainerCallback):
    """Never applies a NaN or inf loss or gradient: stops the run, or skips the update.

    With fused torch Adam / AdamW (the Trainer's default) in one process, not in fp16, the check
    makes the host wait for nothing: the step's losses and gradient norm are tested on the GPU,
    the verdict goes to the optimizer as its found_inf (skippable_on_device), and the host reads
    it, from pinned memory, at the next step, or before this step's log, save, evaluation or
    end of training: a stop then comes at the latest one step later, from weights the bad
    update never touched, and no checkpoint is written after it. Otherwise (fp16, where the loss
    scaler skips overflowing steps; several processes; other optimizers) the host reads the
    verdict before the update."""

    def __init__(self, policy: str, precision: str, run_dir: Path):
        self.policy, self.precision, self.run_dir = policy, precision, run_dir
        self.skipped_steps: list[int] = []
        self._losses: list = []  # this step's micro-batch losses
        self._pending = None  # (step, figures in host memory, their CUDA event, loss count)
        self.clipped_norm = None
        """The gradient norm the Trainer's clipping computed for this step (a tensor), set by
        LoraLabMixin._clip_grad_norm; the guard then reads it instead of computing its own."""

    def note_loss(self, loss) -> None:
        self._losses.append(loss.detach().reshape(-1).float())

    def _figures(self, model, fp16: bool):
        """This step's losses and (not with fp16) gradient norm as one 1-D float tensor on the
        device, and how many losses lead it; (None, 0) when there is nothing to check."""
        import torch

        parts, self._losses = self._losses, []
        losses = sum(part.numel() for part in parts)
        norm, self.clipped_norm = self.clipped_norm, None
        if not fp16 and not isinstance(norm, torch.Tensor):
            grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
            if grads:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if not fp16 and isinstance(norm, torch.Tensor):
            parts.append(norm.detach().float().reshape(1).to(parts[0].device if parts else norm.device))
        return (torch.cat(parts), losses) if parts else (None, 0)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch

        step = state.global_step + 1
        on_device = None if args.fp16 or getattr(args, "world_size", 1) > 1 else skippable_on_device(optimizer)
        self.settle()
        figures, losses = self._figures(model, args.fp16)
        if on_device is None or figures is None:
            found = None if figures is None else _describe(figures.cpu(), losses)
            if found is not None:
                if not args.fp16:  # (with fp16 the scaler sees the NaN in the gradients)
                    optimizer.zero_grad(set_to_none=True)  # no gradient: no update
                self._act(step, found)
            if on_device is not None:
                on_device.found_inf = None
            return
        device = next(p.device for g in on_device.param_groups for p in g["params"])
        on_device.found_inf = (~torch.isfinite(figures).all()).float().to(device)
        event = None
        if figures.is_cuda:
            host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
            figures = host.copy_(figures, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (step, figures, event, losses)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_log or control.should_save or control.should_evaluate or control.should_training_stop:
            self.settle()

    def on_train_end(self, args, state, control, **kwargs):
        self.settle()

    def settle(self) -> None:
        """Act on the verdict of the step whose figures are still unread (the host waits, if at
        all, only until they were computed)."""
        if self._pending is None:
            return
        (step, figures, event, losses), self._pending = self._pending, None
        if event is not None:
            event.synchronize()
        found = _describe(figures, losses)
        if found is not None:
            self._act(step, found)

    def _act(self, step: int, found: str) -> None:
        """A non-finite step whose update was not applied: stop, or count it and go on."""
        if self.policy == "stop":
            raise TrainingError(nonfinite_message(step, found, self.precision, self.run_dir))
        self.skipped_steps.append(step)
        log.warning(f"warning: step {step}: {found}; update skipped ({len(self.skipped_steps)} skipped so far)")


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
