"""The shape of a decoder-only transformer, as the planners count it: sizes, parameter counts and
each layer's linear layers, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..registry import linear_shapes, parameter_count
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
        h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        linears = linear_shapes(config)
        linear_params = n * sum(a * b for a, b in linears)
        return cls(
            hidden=h,
            intermediate=i,
            layers=n,
            vocab=config["vocab_size"],
            linear_params=linear_params,
            other_params=parameter_count(config) - linear_params,
            lora_params_per_rank=n * sum(a + b for a, b in linears),
            tied=bool(config.get("tie_word_embeddings")),
            linears=linears,
        )
