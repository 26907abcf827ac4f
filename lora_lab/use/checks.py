"""Checks of a written model against the one it came from: the same check prompts through both,
the largest logit difference and how often they predict the same next token."""

from __future__ import annotations

import json
from pathlib import Path

from ..device import inference_device_map, release_memory
from ..errors import CheckpointError

CHECK_PROMPTS = ["Who are you?", "Write a haiku about autumn.", "2+2=?"]


def check_prompt_batch(tokenizer, device) -> dict:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in CHECK_PROMPTS
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in batch.items()}


def top1_agreement(reference, logits, mask) -> float:
    confident = mask & (reference.softmax(-1).max(-1).values >= 0.5)
    if not bool(confident.any()):
        return 1.0
    return float((reference.argmax(-1) == logits.argmax(-1))[confident].float().mean())


MIN_TOP1_AGREEMENT = 0.80
"""Below this share of confident check positions predicting the source's next token, the export
is kept but a warning says the 4-bit model drifted (4-bit rounding flips some near-ties)."""


def model_logits(model, batch):
    import torch

    with torch.no_grad():
        device = next(model.parameters()).device
        return model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()


def reference_logits(source: Path, batch, dtype: str = "bfloat16"):
    """The source's logits on the batch, loaded in `dtype` ("auto": the dtype it was saved in)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=inference_device_map())
    logits = model_logits(model.eval(), batch)
    del model
    release_memory()
    return logits


def check_exported_folder(staging: Path, batch, reference) -> tuple[float, float]:
    """Load the written folder as a user would and compare its logits with the 16-bit source's."""
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((staging / "config.json").read_text())
    bnb = config.get("quantization_config", {}).get("quant_method") == "bitsandbytes"
    model = AutoModelForCausalLM.from_pretrained(
        staging, dtype=torch.bfloat16, device_map=inference_device_map(quantized_bnb=bnb)
    )
    logits = model_logits(model.eval(), batch)
    del model
    release_memory()
    if not torch.isfinite(logits).all():
        raise CheckpointError(
            "the exported model gives non-finite logits on the check prompts, "
            "so it was not kept. Check that the 16-bit source model answers "
            "sensibly (lora-lab chat --model SOURCE)."
        )
    mask = batch["attention_mask"].bool()
    diff = float((reference - logits)[mask].abs().max())
    return diff, top1_agreement(reference, logits, mask)
