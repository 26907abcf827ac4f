"""The machine a process runs on: CUDA present, GPU memory and its cap, the process group."""

from __future__ import annotations

import contextlib
import os


def use_cpu(precision) -> bool:
    """Train on the CPU: fp32 and no CUDA GPU."""
    return precision.name == "fp32" and not cuda_available()


def in_launched_worker() -> bool:
    """True inside a process started by accelerate launch / torchrun."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_state(precision):
    """accelerate's process state, set up as the Trainer will (gloo on CPU, NCCL on GPUs)."""
    from accelerate import PartialState

    return PartialState(cpu=use_cpu(precision))


MEMORY_CAP_ENV = "LORA_LAB_GPU_MEMORY_GIB"


def cap_gpu_memory() -> float | None:
    """LORA_LAB_GPU_MEMORY_GIB=N: let this process use at most N GiB of its GPU, to act like a
    smaller card (how the benchmarks measure the presets under each tier's cap)."""
    import torch

    value = os.environ.get(MEMORY_CAP_ENV)
    if not value or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(value) * 2**30 / total), device)
    return float(value)


ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_ENVS = (ALLOCATOR_ENV, "PYTORCH_ALLOC_CONF")
"""Where PyTorch reads its allocator settings: the CUDA name, and the unified one (torch 2.9+)."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_chosen(environ=None) -> bool:
    """The user set PyTorch's allocator settings (lora-lab then sets none of its own)."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in ALLOCATOR_ENVS)


def _windows_or_wsl() -> bool:
    """Windows, or Linux under WSL (Docker on WSL 2 included: its kernel names Microsoft), where
    CUDA's virtual memory calls behind expandable segments fail (docs/training.md)."""
    if os.name == "nt" or os.environ.get("WSL_DISTRO_NAME") or os.environ.get("WSL_INTEROP"):
        return True
    return "microsoft" in os.uname().release.lower()


def use_expandable_segments(enabled: bool) -> bool:
    """train.expandable_segments: let PyTorch's caching allocator grow its segments in place, so
    that the memory it holds stays near what is allocated (without them, blocks of one size
    freed between layers stay reserved beside blocks of another). Applied before the first
    allocation of this process; not where the user set the allocator's settings. Returns
    whether it is on."""
    import torch

    if not enabled or allocator_chosen() or not cuda_available() or _windows_or_wsl():
        return False
    torch.cuda.memory._set_allocator_settings(EXPANDABLE_SEGMENTS)
    return True


def gpu_memory_gib() -> float | None:
    """The GPU memory this process may use, in GiB: LORA_LAB_GPU_MEMORY_GIB when set (a smaller
    card), else the first GPU's; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    cap = os.environ.get(MEMORY_CAP_ENV)
    return min(total, float(cap)) if cap else total


def host_memory_gib() -> float:
    """This machine's physical RAM in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def use_cudnn_attention(setting: str | bool) -> None:
    """model.cudnn_attention: let sdpa pick its cuDNN backend in this (training) process only
    when true; auto and false leave the choice to flash and memory-efficient kernels."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(setting is True)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def release_memory() -> None:
    """Give freed GPU memory back (after an out-of-memory error, between export stages)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_memory_per_gpu(timer) -> list:
    """Every process's memory figures (StepTimer.memory), in rank order (all ranks call)."""
    import torch

    figures = timer.memory()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [figures]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, figures)
    return gathered


def inference_device_map(quantized_bnb: bool = False):
    """bitsandbytes weights go whole onto GPU 0; 16-bit models spread over GPU and CPU memory."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return {"": 0} if quantized_bnb else "auto"


# ----------------------------------------------------------------------------- a run's settings


@contextlib.contextmanager
def run_device_settings(expandable_segments: bool, cudnn_attention: str | bool):
    """The process-wide device settings of a training run, put back on exit: the allocator's
    expandable segments (use_expandable_segments), the memory cap (cap_gpu_memory) and sdpa's
    cuDNN backend (use_cudnn_attention)."""
    import torch

    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    on_cuda = torch.cuda.is_available()
    fraction_before = torch.cuda.get_per_process_memory_fraction() if on_cuda else None
    expanded = use_expandable_segments(expandable_segments)
    try:
        cap_gpu_memory()
        use_cudnn_attention(cudnn_attention)
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
        if fraction_before is not None:
            torch.cuda.set_per_process_memory_fraction(fraction_before)
        if expanded:
            torch.cuda.memory._set_allocator_settings(EXPANDABLE_SEGMENTS.replace("True", "False"))
