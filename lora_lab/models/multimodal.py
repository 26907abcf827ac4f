"""Text fine-tuning of a vision-language checkpoint (Qwen3.5's Qwen3_5ForConditionalGeneration):
lora-lab trains its language model only, and the adapter loads back into the whole model.

`--model` naming such a folder loads its language model alone: transformers' causal-LM class of
the family reads the checkpoint's `model.language_model.*` weights and leaves the vision tower on
disk (never on the GPU, nothing of it trains or is planned). The adapter is saved in the language
model's names (model.layers.N...), which lora-lab's merge, inference and resume read; on the full
model the same layers are model.language_model.layers.N, so `load_full_model_with_adapter`
renames them with peft's key_mapping (peft would otherwise skip every key with a warning).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelError

LANGUAGE_MODEL_KEYS = {
    "qwen3_5": {r"^model\.layers\.": "model.language_model.layers."},
    "qwen3_5_moe": {r"^model\.layers\.": "model.language_model.layers."},
}
"""model_type of a vision-language checkpoint -> how its language model's adapter keys are named
in the full model (peft key_mapping: regex on the keys without peft's base_model.model. prefix)."""


def adapter_key_mapping(model_type: str) -> dict:
    """peft key_mapping that puts a language-model adapter onto the full model of `model_type`."""
    if model_type not in LANGUAGE_MODEL_KEYS:
        raise ModelError(
            f"model_type {model_type!r}: lora-lab does not know where this vision-language model keeps "
            f"its language model; load the adapter onto its causal-LM class instead."
        )
    return LANGUAGE_MODEL_KEYS[model_type]


def load_full_model_with_adapter(model_dir, adapter_dir, dtype=None):
    """The checkpoint's own (vision-language) class from `model_dir` with the adapter lora-lab
    trained on its language model, every adapter key in place (peft's missing keys are an error
    here, not a warning)."""
    import json

    import transformers
    from peft import PeftModel
    from peft.utils import load_peft_weights

    config = json.loads((Path(model_dir) / "config.json").read_text())
    mapping = adapter_key_mapping(config.get("model_type"))
    model_class = getattr(transformers, config["architectures"][0])
    model = model_class.from_pretrained(str(model_dir), **({"dtype": dtype} if dtype is not None else {}))
    tuned = PeftModel.from_pretrained(model, str(adapter_dir), key_mapping=mapping)
    saved = load_peft_weights(str(adapter_dir), key_mapping=mapping)
    present = {n.replace(".default.", ".") for n, _ in tuned.named_parameters()}
    missing = sorted(set(saved) - present)
    if missing:
        raise ModelError(
            f"{adapter_dir}: {len(missing)} adapter weights have no place in {model_dir}'s model ({missing[0]})"
        )
    return tuned
