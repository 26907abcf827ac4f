"""--task grpo's generation as the memory planner counts it (planning/memory.py adds it to a
grpo run's plan). Imports no torch.

Every optimizer step, TRL's GRPOTrainer samples the step's completions in one generation batch:
train.micro_batch_size x train.grad_accum sequences on each GPU (its steps_per_generation is the
accumulation), through transformers' generate, without gradients and after the previous step's
activations are freed. What generation holds: the cache of every sequence up to prompt +
completion tokens (keys and values of the attention layers, a sliding layer's window at most, the
recurrent states of linear-attention layers), the prompts' prefill one layer at a time, and the
sampled position's logits. The step's peak is the larger of the two phases, so the plan adds what
generation needs beyond the training step's activations. Counted, not fitted.
"""

from __future__ import annotations

from .shape import ModelShape, expert_working_bytes

CACHE_BYTES = 2
"""A cached key or value (bf16)."""
SAMPLING_LOGIT_COPIES = 5
"""The sampled position's logits over the vocabulary (fp32): the logits, the warped copy, and
training/sampling.py's noise, noisy scores and the drawn token's scores."""


def generation_sequences(micro_batch_size: int, grad_accum: int) -> int:
    """Sequences generated at once on each GPU: the whole step's completions."""
    return micro_batch_size * grad_accum


def cache_bytes(shape: ModelShape, sequences: int, tokens: int) -> int:
    """The generation cache of `sequences` sequences of `tokens` tokens."""
    full, sliding, window, state = shape.cache
    kept = min(tokens, window) if window else tokens
    return sequences * ((full * tokens + sliding * kept) * CACHE_BYTES + state)


def prefill_bytes(shape: ModelShape, sequences: int, prompt_tokens: int, quantized: bool) -> int:
    """The prompts' forward without gradients: one layer's tensors live at a time (about 4
    hidden-sized and 2 intermediate-sized bf16 tensors a token; a mixture of experts' routed copies
    beside them), and the last position's logits."""
    tokens = sequences * prompt_tokens
    layer = tokens * 2 * (4 * shape.hidden + 2 * shape.intermediate)
    layer += expert_working_bytes(shape, tokens, quantized)
    return layer + sequences * shape.vocab * 4 * SAMPLING_LOGIT_COPIES


def generation_bytes(
    shape: ModelShape, sequences: int, prompt_tokens: int, completion_tokens: int, quantized: bool
) -> dict[str, int]:
    """What generation holds at its peak, by part (bytes)."""
    return {
        "cache": cache_bytes(shape, sequences, prompt_tokens + completion_tokens),
        "prefill": prefill_bytes(shape, sequences, prompt_tokens, quantized),
    }


def generation_part(shape: ModelShape, config, row_tokens: int, step_gib: float) -> dict[str, float]:
    """The plan's part (GiB) for a grpo run's generation beyond its training step's activations
    (step_gib; row_tokens: a sequence's prompt + completion); none where the step needs more."""
    completion = config.grpo.max_completion_length
    sequences = generation_sequences(config.train.micro_batch_size, config.train.grad_accum)
    held = generation_bytes(
        shape, sequences, max(1, row_tokens - completion), completion, config.model.quantization != "none"
    )
    beyond = sum(held.values()) / 2**30 - step_gib
    if beyond <= 0:
        return {}
    return {f"generation of {sequences} sequences: cache + prefill beyond the step (counted)": beyond}
