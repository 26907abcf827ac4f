"""The memory planner: predicted peak GPU memory of a lora-lab run, broken down. Imports no torch.

peak = weights + LoRA (fp32 weights, gradients, Adam moments: 16 bytes a parameter)
     + activation checkpoints (one bf16 hidden state per layer per token)
     + per-token working memory of the layer being recomputed, plus the fused loss's chunks
     + a constant (allocator and kernel workspaces)
The last two terms are an empirical fit to the peaks measured on an H200 (bench/results/,
`python bench/fit_planner.py` refits them); the others are counted from the model's config.
"Peak" is torch.cuda.max_memory_reserved: the CUDA context (about 0.3-0.5 GiB) comes on top, which
is why a card of G GiB is planned with G - 0.5 GiB.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import RunConfig, guess_model_size, known_model_config

GIB = 2**30
CONTEXT_GIB = 0.5
# Fitted (weighted least squares, 2026-11-30) on every successful lora-lab cell in bench/results.
FIT_CONSTANT_GIB = 0.1025
FIT_BYTES_PER_TOKEN_PER_HIDDEN = 86.79
FIT_BYTES_PER_TOKEN_PER_INTERMEDIATE = 0.888
FIT_16BIT_BYTES_PER_TOKEN_PER_HIDDEN = 37.84  # extra per token when the base is 16-bit
NF4_BYTES_PER_WEIGHT = 0.5156  # 4 bits + double-quantized absmax per 64-weight block
UNFUSED_LOSS_BYTES_PER_LOGIT = 10  # bf16 logits, their fp32 copy and its gradient (estimate)
TIERS_GIB = {"24gb": 24, "16gb": 16, "12gb": 12, "8gb": 8}


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    linear_params: int
    other_params: int
    lora_params_per_rank: int

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        vocab = config["vocab_size"]
        kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
        linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
        head = 0 if config.get("tie_word_embeddings") else vocab * h
        return cls(hidden=h, intermediate=i, layers=n, vocab=vocab,
                   linear_params=n * sum(a * b for a, b in linears),
                   other_params=vocab * h + head + n * (h + 2 * kv + 2 * h) + h,
                   lora_params_per_rank=n * sum(a + b for a, b in linears))


@dataclass
class MemoryPlan:
    model: str
    quantization: str
    tokens_per_micro_batch: int
    parts_gib: dict = field(default_factory=dict)
    budget_gib: float | None = None
    longest_max_length: int | None = None
    """The longest max_length (micro-batch 1) that fits the budget with these settings."""
    fixes: list = field(default_factory=list)
    """The knobs that would make it fit, as flags."""

    @property
    def total_gib(self) -> float:
        return sum(self.parts_gib.values())

    @property
    def fits(self) -> bool | None:
        return None if self.budget_gib is None else self.total_gib <= self.budget_gib

    def report(self) -> str:
        lines = [f"{self.model}, {self.quantization}, {self.tokens_per_micro_batch} tokens per "
                 f"micro-batch"]
        lines += [f"  {name:<44} {gib:6.2f} GiB" for name, gib in self.parts_gib.items()]
        lines.append(f"  {'predicted peak (torch max_memory_reserved)':<44} {self.total_gib:6.2f} GiB")
        if self.budget_gib is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {self.budget_gib:.1f} GiB (GPU memory - "
                         f"{CONTEXT_GIB} GiB for the CUDA context)")
        if self.longest_max_length:
            lines.append(f"  longest --max-length that fits: {self.longest_max_length}")
        if self.fits is False:
            lines.append(f"  to fit: {' or '.join(self.fixes) or 'a smaller model'}")
        return "\n".join(lines)


def plan_memory(config: RunConfig, gpu_memory_gib: float | None = None,
                longest_sample_tokens: int | None = None) -> MemoryPlan:
    """Predicted peak of `config` on a GPU; tokens from the data's longest sample when known."""
    size = guess_model_size(config.model.name)
    if size is None:
        raise ValueError(f"unknown model shape: {config.model.name}")
    shape = ModelShape.from_config(known_model_config(size))
    length = min(config.data.max_length, longest_sample_tokens or config.data.max_length)
    tokens = length * config.train.micro_batch_size
    plan = MemoryPlan(model=f"Qwen2.5-{size.upper()}", quantization=(
        "QLoRA nf4" if config.model.quantization == "nf4" else "16-bit LoRA"),
        tokens_per_micro_batch=tokens, parts_gib=_parts(shape, config, tokens))
    if gpu_memory_gib:
        plan.budget_gib = gpu_memory_gib - CONTEXT_GIB
        plan.longest_max_length = _longest(shape, config, plan.budget_gib)
        if plan.longest_max_length:
            plan.fixes.append(f"--max-length {plan.longest_max_length}")
        if config.model.quantization == "none":
            plan.fixes.append("--quantization nf4 (QLoRA)")
        if config.train.micro_batch_size > 1:
            plan.fixes.append("--micro-batch-size 1 with a larger --grad-accum")
    return plan


def _parts(shape: ModelShape, config: RunConfig, tokens: int) -> dict:
    weight_bytes = 2 if config.model.quantization == "none" else NF4_BYTES_PER_WEIGHT
    if config.model.dtype == "fp32":
        weight_bytes = 4
    lora = shape.lora_params_per_rank * config.lora.rank
    per_hidden = FIT_BYTES_PER_TOKEN_PER_HIDDEN + (
        FIT_16BIT_BYTES_PER_TOKEN_PER_HIDDEN if config.model.quantization == "none" else 0)
    working = tokens * (per_hidden * shape.hidden +
                        FIT_BYTES_PER_TOKEN_PER_INTERMEDIATE * shape.intermediate)
    parts = {
        "weights": (shape.linear_params * weight_bytes + shape.other_params * 2) / GIB,
        "LoRA weights + gradients + Adam state (fp32)": lora * 16 / GIB,
        "activation checkpoints": tokens * shape.layers * shape.hidden * 2 / GIB,
        "recomputed layer + fused loss (fitted)": working / GIB,
        "allocator and workspaces (fitted)": FIT_CONSTANT_GIB,
    }
    if config.model.kernels == "none":
        parts["full logits for the loss (estimate)"] = (
            tokens * shape.vocab * UNFUSED_LOSS_BYTES_PER_LOGIT / GIB)
    return parts


def _longest(shape: ModelShape, config: RunConfig, budget_gib: float) -> int | None:
    fixed = _parts(shape, config, 0)
    per_token = sum(_parts(shape, config, 1).values()) - sum(fixed.values())
    room = budget_gib - sum(fixed.values())
    if room <= 0 or per_token <= 0:
        return None
    return int(room / per_token / config.train.micro_batch_size) // 256 * 256 or None


def pick_preset(gpu_memory_gib: float) -> tuple[str, str]:
    """The largest tier that fits a GPU of this size, and why."""
    for name, tier_gib in sorted(TIERS_GIB.items(), key=lambda kv: -kv[1]):
        if gpu_memory_gib >= tier_gib - 0.6:
            return name, (f"the GPU has {gpu_memory_gib:.1f} GiB; {name} is the largest tier "
                          f"that fits it")
    return "8gb", (f"the GPU has {gpu_memory_gib:.1f} GiB, less than the smallest tier (8 GB): "
                   f"8gb with a short --max-length is the best chance")


def check_fits(config: RunConfig, gpu_memory_gib: float,
               longest_sample_tokens: int | None = None) -> MemoryPlan | None:
    """Refuse, before loading anything, a run the planner says will not fit; None if unknown."""
    from .errors import LoraLabError

    if guess_model_size(config.model.name) is None:
        return None
    plan = plan_memory(config, gpu_memory_gib, longest_sample_tokens)
    if plan.fits:
        return plan
    fixes = plan.fixes
    raise LoraLabError(
        f"--preset {config.preset} needs about {plan.total_gib:.1f} GiB for {plan.model} "
        f"({plan.quantization}) at --max-length {config.data.max_length}; this GPU has "
        f"{gpu_memory_gib:.1f} GiB ({plan.budget_gib:.1f} usable). Try "
        f"{' or '.join(fixes) or 'a smaller model'}; `lora-lab plan` shows the breakdown. "
        f"--no-memory-check runs it anyway.")
