"""The `lora` section of the run configuration: the adapter's shape and what it adapts
(models/lora.py builds peft's config from it)."""

from __future__ import annotations

from dataclasses import dataclass

from .spec import spec_field as _f

MAX_LORA_RANK = 4096
"""Above any hidden size lora-lab trains: a larger rank adds parameters and no capacity."""


@dataclass(frozen=True)
class LoraArgs:
    rank: int = _f(8, "LoRA rank r.", minimum=1, maximum=MAX_LORA_RANK)
    alpha: float = _f(32, "LoRA alpha (scale = alpha / rank).", minimum=0)
    dropout: float = _f(0.05, "Dropout on the LoRA input.", minimum=0)
    target_modules: list = _f(["all-linear"], "Modules to adapt; all-linear = every linear layer except lm_head.")
    experts: bool = _f(
        False,
        "Mixture-of-experts models: LoRA on the fused experts too (each expert's gate/up and down "
        "projections, peft target_parameters), beside lora.target_modules; the routers stay "
        "frozen. 16-bit or 4-bit experts (QLoRA); --tuner lora and --lora-dropout 0 only.",
    )
    trainable_tokens: str | bool = _f(
        "auto",
        "Also train the input-embedding and output-head rows of the chat template's "
        "special tokens (<|im_start|>, <|im_end|> ...; peft trainable_token_indices): a "
        "base checkpoint never trained them, so LoRA alone does not teach it to stop. "
        "auto: on for base checkpoints (qwen2.5-7b-base, Qwen/Qwen3-8B-Base ...).",
        choices=("auto", True, False),
    )
    use_rslora: bool = _f(
        False,
        "rsLoRA: scale the adapter by alpha / sqrt(rank) instead of "
        "alpha / rank, so that a higher rank keeps learning as fast "
        "(peft use_rslora; --tuner lora and dora).",
    )
    init: str = _f(
        "default",
        "How the adapter starts (peft init_lora_weights): default (A "
        "Kaiming-uniform, B zero), gaussian (A normal with std 1/rank), "
        "pissa (A and B from the base weight's top singular vectors; the "
        "base keeps the residual), pissa_niter_N (the same by N "
        "iterations of fast randomised SVD, for 7B and larger) or olora "
        "(A and B from a QR decomposition). pissa and olora train the "
        "residual; the saved adapter/ is converted to a plain LoRA of "
        "twice the rank that applies to the original base "
        "(docs/tuners.md). --tuner lora and dora.",
    )
