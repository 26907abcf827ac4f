"""A mixture of experts' QLoRA training load without its 16-bit experts in memory.

from_pretrained would read every expert into CPU memory in 16 bits and fuse them there (2 bytes
a parameter of the experts) before QLoRA could take them to the GPU in 4 bits. Where the checkpoint
holds one tensor per expert (`...layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, the
layout Qwen3-MoE and Qwen3.5-MoE are published in, and the one transformers saves them in):

- from_pretrained reads everything but the experts: their checkpoint keys are renamed out of the
  model's way (key_mapping, so transformers never reads them), and the experts modules are built
  zero-wide (the config's moe_intermediate_size at 0 while loading), so nothing is allocated or
  initialised for them;
- each experts module then gets stand-ins of its tensors' real shapes that take no memory (one
  element, expanded), to which peft attaches the experts' LoRA (lora.experts) as to real ones;
- models/moe.py adapted_experts_to reads each module's experts from the checkpoint files into a
  fused tensor in place (gate rows, then up rows, as transformers fuses them), and quantizes it:
  one layer's 16-bit experts exist at a time, on the GPU where there is one.

Other checkpoints (fused expert tensors, gpt-oss's MXFP4 blocks) and a vision-language
checkpoint's language model load as before (models/load.py).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
"""A checkpoint key of one expert's projection: (layer, expert, projection)."""
SKIPPED_EXPERTS = {r"mlp\.experts\.(\d+)\.": r"mlp.streamed_experts.\1."}
"""from_pretrained's key_mapping: one expert's checkpoint keys renamed to no parameter."""
WIDTH = "moe_intermediate_size"
"""The config field the experts modules alone read their width from."""
SOURCE = "lora_lab_expert_source"
"""Where an experts module keeps its checkpoint keys (in its own __dict__) until streamed."""


def checkpoint_keys(path: str) -> dict[str, str]:
    """Every tensor key of the safetensors checkpoint in folder `path` -> its file."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: str(folder / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    keys: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys.update(dict.fromkeys(handle.keys(), str(file)))
    return keys


@dataclass(frozen=True)
class ExpertStream:
    """What streaming_load found: from_pretrained's extra arguments, the experts' real width and
    each layer's expert keys ((expert, projection) -> (key, file))."""

    load_kwargs: dict
    width: int
    by_layer: dict[int, dict]


def streaming_load(path: str, trust_remote_code: bool = False) -> ExpertStream | None:
    """How to load the checkpoint in folder `path` without its experts (the module docstring),
    or None where its experts are not one tensor each."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    width = getattr(config, WIDTH, None)
    by_layer: dict[int, dict] = {}
    for key, file in checkpoint_keys(path).items():
        found = EXPERT_KEY.search(key)
        if found:
            by_layer.setdefault(int(found[1]), {})[(int(found[2]), found[3])] = (key, file)
    if not width or not by_layer:
        return None
    setattr(config, WIDTH, 0)
    return ExpertStream({"key_mapping": SKIPPED_EXPERTS, "config": config}, width, by_layer)


@contextmanager
def report_checked(path: str):
    """Around a streaming_load's from_pretrained(..., output_loading_info=True): its load report
    (the experts missing, their checkpoint keys unexpected) is not printed but checked; the
    `check` it yields takes (model, info) and returns the model, or raises a ModelError naming
    what else was missing, left over or of another shape."""
    from transformers.utils import logging as hf_logging

    def check(loaded):
        model, info = loaded
        missing = [k for k in info["missing_keys"] if not re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", k)]
        unread = [k for k in info["unexpected_keys"] if ".mlp.streamed_experts." not in k]
        if missing or unread or info["mismatched_keys"]:
            found = (sorted(missing) or sorted(unread) or [str(k) for k in info["mismatched_keys"]])[0]
            raise ModelError(
                f"--model {path}: {found} is missing, left over or of another shape; the checkpoint does "
                f"not match its config.json. Copy or download the model again."
            )
        return model

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield check
    finally:
        hf_logging.set_verbosity(verbosity)


def stand_in_experts(model, path: str, stream: ExpertStream, device) -> int:
    """After a streaming_load: the config's expert width back, and each experts module's tensors
    as stand-ins of their real shapes (no memory) on `device`, with the checkpoint keys that
    fill them. Returns how many modules wait for their experts."""
    import torch

    from .moe import EXPERT_WEIGHTS, expert_modules

    width, by_layer = stream.width, stream.by_layer
    setattr(model.config, WIDTH, width)
    modules = expert_modules(model)
    for name, module in modules:
        layer = int(re.search(r"layers\.(\d+)\.", name)[1])  # type: ignore[index]
        if layer not in by_layer:
            raise ModelError(f"--model {path}: no expert weights of layer {layer} in its checkpoint files")
        experts, hidden = module.num_experts, model.config.hidden_size
        shapes = {"gate_up_proj": (experts, 2 * width, hidden), "down_proj": (experts, hidden, width)}
        for key in EXPERT_WEIGHTS:
            dtype = module._parameters[key].dtype
            empty = torch.zeros((), dtype=dtype, device=device).expand(shapes[key])
            module._parameters[key] = torch.nn.Parameter(empty, requires_grad=False)
        module.intermediate_dim = width
        module.__dict__[SOURCE] = by_layer[layer]
    return len(modules)


def waits_for_experts(module) -> bool:
    """Whether an experts module holds stand_in_experts' stand-ins."""
    return SOURCE in module.__dict__


def read_experts(module, key: str, device):
    """Expert tensor `key` (gate_up_proj or down_proj) of a stand-in module, read from its
    checkpoint files into one new tensor on `device`, one expert matrix at a time."""
    import torch
    from safetensors import safe_open

    stand_in = module._parameters[key]
    fused = torch.empty(stand_in.shape, dtype=stand_in.dtype, device=device or stand_in.device)
    width = fused.shape[1] // 2 if key == "gate_up_proj" else fused.shape[2]
    parts = ("gate_proj", "up_proj") if key == "gate_up_proj" else ("down_proj",)
    source = module.__dict__[SOURCE]
    handles: dict[str, object] = {}
    try:
        for expert in range(fused.shape[0]):
            for i, part in enumerate(parts):
                if (expert, part) not in source:
                    raise ModelError(_missing_expert(source, expert, part))
                name, file = source[(expert, part)]
                handle = handles.get(file) or handles.setdefault(file, safe_open(file, framework="pt"))
                rows = fused[expert, i * width : (i + 1) * width] if key == "gate_up_proj" else fused[expert]
                rows.copy_(handle.get_tensor(name))  # type: ignore[attr-defined]
    finally:
        handles.clear()
    return fused


def _missing_expert(source: dict, expert: int, part: str) -> str:
    """The stop for a layer's checkpoint keys (`source`) without expert `expert`'s `part`."""
    name, file = next(iter(source.values()))
    layer = EXPERT_KEY.search(name)[1]  # type: ignore[index]
    return (
        f"--model {os.path.dirname(file)}: layer {layer}'s expert {expert} has no {part} weight in its "
        f"checkpoint files; copy or download the model again"
    )
