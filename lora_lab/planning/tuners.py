"""What each adapter tuner adds to the memory plan, counted from peft's layers (no torch).

A layer's linears are given as (in_features, out_features), in ModelShape.linears order; the
MLP's output projection (down_proj) is the last one.

  lora  A (r x in) and B (out x r) per linear
  dora  LoRA plus one magnitude per output channel (peft DoraLinearLayer.weight); its forward
        keeps two more output-sized tensors a token for the backward pass (the base output and
        the scaled LoRA output, which the magnitude's gradient needs) and builds the dense
        LoRA weight of each linear from an identity matrix (get_lora_weight), once per pass
  ia3   one scale per output channel, per input channel of down_proj (peft IA3
        feedforward_modules; models/lora.py IA3_INPUT_SCALED)
The DoRA terms are counted from peft's code; two more were fitted to 7B runs under the 24gb and
16gb caps (docs/benchmarks.md, DoRA and preference tasks): the allocator's blocks that DoRA's
large transients leave behind, and the 4-bit weight peft dequantizes for the weight norm.
"""

from __future__ import annotations

ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "ia3": "IA3"}
LORA_FP32_BYTES = 4
"""peft keeps adapter weights in fp32 (autocast_adapter_dtype), the identity matrix too."""


def adapter_params(tuner: str, linears: list, layers: int, rank: int) -> int:
    """Trained parameters of --tuner lora, dora or ia3 on every linear of every layer."""
    lora = layers * sum(i + o for i, o in linears) * rank
    if tuner == "lora":
        return lora
    if tuner == "dora":
        return lora + dora_magnitudes(linears, layers)
    if tuner == "ia3":
        *scaled_out, (down_in, _) = linears
        return layers * (sum(o for _, o in scaled_out) + down_in)
    raise ValueError(f"no adapter for tuner {tuner!r}")


def adapter_state_part(tuner: str) -> str:
    """The memory plan's line for the trained adapter's state (16 bytes a parameter)."""
    return {
        "dora": "DoRA A, B, magnitudes + grads + Adam (fp32)",
        "ia3": "IA3 vectors + gradients + Adam state (fp32)",
    }.get(tuner, "LoRA weights + gradients + Adam state (fp32)")


def dora_magnitudes(linears: list, layers: int) -> int:
    """DoRA's magnitude vectors: one value per output channel of every adapted linear."""
    return layers * sum(o for _, o in linears)


def dora_saved_bytes_per_token(linears: list, activation_bytes: int) -> int:
    """Per token and layer: the base output and the scaled LoRA output of every linear, kept
    for the magnitude's gradient (result = (m/|W'| - 1) base + m/|W'| scaling lora)."""
    return 2 * sum(o for _, o in linears) * activation_bytes


def dora_weight_bytes(linears: list, activation_bytes: int) -> int:
    """The transient of the widest linear's forward: the fp32 identity (in x in), the dense
    LoRA weight in fp32 and in the activation dtype, and W + scaling x (B A) with its product
    (get_weight_norm): freed before the next linear."""
    return max(i * i * LORA_FP32_BYTES + i * o * (LORA_FP32_BYTES + 3 * activation_bytes) for i, o in linears)


DORA_FRAGMENTATION_PER_IDENTITY_BYTE = 0.9
"""Reserved minus allocated at the peak, over the bytes of the widest fp32 identity (Qwen2.5-7B's
down_proj: 18944^2 x 4 = 1.34 GiB); fitted on the 7B DoRA runs (docs/tuners.md)."""
DORA_NF4_DEQUANT_BYTES_PER_WEIGHT = 16
"""Allocated beyond the counted terms with a 4-bit base, per element of the widest linear: the
dequantized weight in 16 bits and its fp32 copies for the norm (fitted on the 7B QDoRA run)."""


def dora_parts(
    linears: list, layers: int, tokens: int, checkpointing: bool, activation_bytes: int, quantized: bool = False
) -> dict:
    """The planner parts DoRA adds besides its trained state (adapter_params counts the
    magnitudes), in bytes: with gradient checkpointing only the layer being recomputed holds its
    saved tensors; without it every layer does."""
    saved = tokens * dora_saved_bytes_per_token(linears, activation_bytes)
    widest_in = max(i for i, _ in linears)
    parts = {
        "DoRA outputs kept for backward (counted)": saved if checkpointing else saved * layers,
        "DoRA dense weight, widest linear (counted)": dora_weight_bytes(linears, activation_bytes),
        "DoRA allocator blocks (fitted)": int(DORA_FRAGMENTATION_PER_IDENTITY_BYTE * widest_in**2 * LORA_FP32_BYTES),
    }
    if quantized:
        parts["DoRA's dequantized 4-bit weight (fitted)"] = DORA_NF4_DEQUANT_BYTES_PER_WEIGHT * max(
            i * o for i, o in linears
        )
    return parts
