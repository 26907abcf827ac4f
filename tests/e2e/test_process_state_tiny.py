"""No hidden global state: a lora_lab.train() call leaves the calling process as it found it
(the allocator's settings, torch's backend flags, liger-kernel's functions, torch.optim's global
step hooks, the progress bars), while inside the run the settings were in force."""

import contextlib
import os

import torch

import lora_lab
from lora_lab.training import process
from tests.support.tiny import write_jsonl


def process_state() -> dict:
    from huggingface_hub.utils import are_progress_bars_disabled
    from torch.optim import optimizer
    from transformers.utils import logging as transformers_logging

    state = {
        "allocator env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        "cudnn sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash sdp": torch.backends.cuda.flash_sdp_enabled(),
        "mem-efficient sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math sdp": torch.backends.cuda.math_sdp_enabled(),
        "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark),
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "optimizer step hooks": list(optimizer._global_optimizer_post_hooks.values()),
        "optimizer pre hooks": list(optimizer._global_optimizer_pre_hooks.values()),
        "progress bars": (are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled()),
    }
    try:
        from liger_kernel.ops import fused_linear_cross_entropy as flce

        state["liger loss backward"] = flce.fused_linear_cross_entropy_backward
    except ImportError:
        pass
    return state


def test_train_leaves_the_process_settings_as_it_found_them(tiny_model_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"query": f"Q{i}?", "response": f"A{i}."} for i in range(4)])
    config = lora_lab.resolve_config(
        "cpu",
        flags={
            "model.name": str(tiny_model_dir),
            "data.datasets": [str(data)],
            "train.max_steps": "2",
            "train.grad_accum": "1",
            "train.output_dir": str(tmp_path),
            "train.run_name": "state",
        },
        sets=["model.fast_lora=true", "lora.dropout=0", "model.cudnn_attention=false"],
    )
    inside = []
    real = process.quiet_library_progress

    @contextlib.contextmanager
    def quiet_and_look():  # entered inside the run's settings, before the model is built
        with real():
            inside.append(torch.backends.cuda.cudnn_sdp_enabled())
            yield

    monkeypatch.setattr(process, "quiet_library_progress", quiet_and_look)
    torch.backends.cuda.enable_cudnn_sdp(True)
    before = process_state()
    result = lora_lab.train(config)
    assert result.global_step == 2
    assert inside == [False]  # model.cudnn_attention=false was in force during the run
    assert process_state() == before
