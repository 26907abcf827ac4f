"""The shape of a decoder-only transformer, as the planners count it: sizes, parameter counts and
each layer's linear layers, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..architecture import (
    cache_widths,
    decoder_linear_shapes,
    dense_mlp_beside_experts,
    expert_shape,
    layer_types,
    linear_attention_widths,
    linear_shapes,
    parameter_count,
)
from ..registry import family_of
from .tuners import adapter_params


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    linear_params: int
    other_params: int
    lora_params_per_rank: int
    tied: bool = False
    linears: list = field(default_factory=list)
    """(in_features, out_features) of each linear of a layer, the MLP's output one last."""
    fused_loss: bool = True
    """The family has liger's fused linear cross-entropy (no [tokens x vocab] logits on a GPU)."""
    liger_experts: bool = False
    """The family's experts run through liger's fused MoE (registry.Family.liger_experts)."""
    linear_attention_layers: int = 0
    """Gated DeltaNet layers (Qwen3.5): each carries a recurrent state and a causal conv."""
    linear_attention: tuple = ()
    """(key width, value width, value heads, key head dim, value head dim) of those layers."""
    layer_experts: int = 0
    """Mixture of experts: the fused expert weights of one layer (in linear_params, so held in 4
    bits by QLoRA, models/moe.py; not adapted by LoRA)."""
    routed: int = 0
    """Mixture of experts: the experts each token goes to (intermediate is their widths' sum)."""
    expert_lora_per_rank: int = 0
    """Mixture of experts, lora.experts: LoRA parameters on every fused expert tensor per unit of
    rank (peft target_parameters: gate/up h -> 2w and down w -> h, per expert and layer)."""
    cache: tuple = (0, 0, 0, 0)
    """What generation caches (architecture.cache_widths): values a token keeps in full and in
    sliding-window attention layers, the window, bytes a sequence keeps in recurrent states."""

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    def trained_params(self, tuner: str, lora_rank: int) -> int:
        """What the optimizer updates: every parameter (full) or the adapter (planning/tuners.py:
        LoRA's matrices, DoRA's with its magnitudes, IA3's vectors)."""
        if tuner == "full":
            return self.params
        if tuner == "lora" or not self.linears:
            return self.lora_params_per_rank * lora_rank
        return adapter_params(tuner, self.linears, self.layers, lora_rank)

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """The shape of a decoder-only transformer from its config.json (registry.linear_shapes
        and parameter_count say what differs by family)."""
        h, n = config["hidden_size"], config["num_hidden_layers"]
        experts, routed, width = expert_shape(config)
        i = routed * width if experts else config["intermediate_size"]
        if experts and dense_mlp_beside_experts(config):
            i += config["intermediate_size"]
        layer_experts = experts * 3 * h * width
        linears = linear_shapes(config)
        every_layer = decoder_linear_shapes(config)  # by each layer's kind (hybrid models)
        linear_params = sum(a * b for layer in every_layer for a, b in layer) + n * layer_experts
        return cls(
            hidden=h,
            intermediate=i,
            layers=n,
            vocab=config["vocab_size"],
            linear_params=linear_params,
            other_params=parameter_count(config) - linear_params,
            lora_params_per_rank=sum(a + b for layer in every_layer for a, b in layer),
            tied=bool(config.get("tie_word_embeddings")),
            linears=linears,
            fused_loss=family_of(config.get("model_type")).liger is not None,
            liger_experts=family_of(config.get("model_type")).liger_experts,
            layer_experts=layer_experts,
            routed=routed if experts else 0,
            expert_lora_per_rank=n * experts * (2 * h + 3 * width) if experts else 0,
            cache=cache_widths(config),
            **_linear_attention_of(config),
        )


def _linear_attention_of(config: dict) -> dict:
    kinds = layer_types(config)
    if "linear_attention" not in kinds:
        return {}
    key, value, heads = linear_attention_widths(config)
    dims = (config["linear_key_head_dim"], config["linear_value_head_dim"])
    return {"linear_attention_layers": kinds.count("linear_attention"), "linear_attention": (key, value, heads, *dims)}


CHUNK_TOKENS = 64
"""The chunk of the gated delta rule (transformers' torch path and fla's kernels): one recurrent
state is kept per chunk for the backward pass."""


FIT_LINEAR_ATTENTION_BYTES_PER_TOKEN_PER_VALUE = 75.0
"""What the recomputed Gated DeltaNet layer holds beyond the counted tensors below, per token and
value channel: transformers' torch chunked delta rule (the path a GPU runs where fla's backward
is refused) keeps fp32 copies of q/k/v with the key heads repeated to the value heads, and its
chunk matrices, for the backward. Fitted on Qwen3.5 cells (`python bench/run.py families`;
docs/memory-planner.md); fla's kernels hold less, so there the plan errs on the safe side."""


def expert_working_bytes(shape: ModelShape, tokens: int, quantized: bool, fused: bool = False) -> int:
    """What the recomputed mixture-of-experts layer holds beside a dense layer's terms, counted:
    each token's `routed` copies through the experts (its hidden state, gate and up, their
    product, the down projection and its weighted copy, bf16: transformers' grouped_mm path); with
    4-bit experts that layer's experts de-quantized to bf16 (models/moe.py); and through liger's
    fused MoE (`fused`: registry.Family.liger_experts with the liger kernels) one more bf16 copy:
    the weight gradient it computes for frozen experts, or with lora.experts the weights with
    their delta (docs/memory-planner.md says what this is checked on)."""
    if not shape.routed:
        return 0
    width = shape.intermediate // shape.routed
    routed = tokens * shape.routed * (3 * shape.hidden + 3 * width) * 2
    return routed + bf16_expert_copies(quantized, fused) * 2 * shape.layer_experts


def bf16_expert_copies(quantized: bool, fused: bool) -> int:
    """The bf16 copies of one layer's experts expert_working_bytes counts."""
    return int(quantized) + int(fused)


def linear_attention_bytes(shape: ModelShape, tokens: int) -> int:
    """The recomputed Gated DeltaNet layer's own tensors in the backward pass: counted, q/k/v
    before and after the conv, the output gate, the rule's output and its norm (bf16), and one
    fp32 recurrent state (value heads x key dim x value dim) per chunk of tokens; fitted, the
    torch delta rule's fp32 working copies (FIT_LINEAR_ATTENTION_BYTES_PER_TOKEN_PER_VALUE)."""
    if not shape.linear_attention_layers:
        return 0
    key, value, heads, key_dim, value_dim = shape.linear_attention
    per_token = 2 * (2 * (2 * key + value) + 3 * value) + FIT_LINEAR_ATTENTION_BYTES_PER_TOKEN_PER_VALUE * value
    chunks = -(-tokens // CHUNK_TOKENS)
    return int(tokens * per_token) + chunks * heads * key_dim * value_dim * 4


def layer_kind_parts(shape: ModelShape, tokens: int, quantized: bool, fused: bool = False) -> dict[str, int]:
    """The plan's parts (bytes) of a hybrid or mixture-of-experts model's own layers; `fused`:
    its experts run through liger's fused MoE."""
    parts = {}
    if shape.linear_attention_layers:
        parts["linear attention state and conv (counted + fitted)"] = linear_attention_bytes(shape, tokens)
    if shape.routed:
        copies = bf16_expert_copies(quantized, fused)
        held = f"one layer's experts in bf16{' x2' if copies == 2 else ''}" if copies else ""
        name = f"routed tokens{' + ' + held if held else ''} (counted)"
        parts[name] = expert_working_bytes(shape, tokens, quantized, fused)
    return parts
