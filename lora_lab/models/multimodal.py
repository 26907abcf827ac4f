"""Text fine-tuning of a vision-language checkpoint (Qwen3.5's Qwen3_5ForConditionalGeneration,
Gemma 4's Gemma4ForConditionalGeneration): lora-lab trains its language model only, and the
adapter loads back into the whole model.

`--model` naming such a folder loads its language model alone: transformers' causal-LM class of
the family reads the checkpoint's `model.language_model.*` weights and leaves the vision tower on
disk (never on the GPU, nothing of it trains or is planned). For Qwen3.5 AutoModelForCausalLM does
that itself; for Gemma 4 it would build the whole vision-language model, so
`language_model_of_checkpoint` loads Gemma4ForCausalLM with a key mapping instead (TEXT_MODELS).
The adapter is saved in the language model's names (model.layers.N...), which lora-lab's merge, inference and resume read; on the full
model the same layers are model.language_model.layers.N, so `load_full_model_with_adapter`
renames them with peft's key_mapping (peft would otherwise skip every key with a warning).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError

LANGUAGE_MODEL_KEYS = {
    "qwen3_5": {r"^model\.layers\.": "model.language_model.layers."},
    "qwen3_5_moe": {r"^model\.layers\.": "model.language_model.layers."},
    "gemma4": {r"^model\.": "model.language_model."},  # its per-layer input projections sit beside the layers
}
"""model_type of a vision-language checkpoint -> how its language model's adapter keys are named
in the full model (peft key_mapping: regex on the keys without peft's base_model.model. prefix)."""


TEXT_MODELS = {
    "gemma4": (
        "Gemma4ForCausalLM",
        {r"^model\.language_model\.": "model."},
        r"^model\.(vision_tower|embed_vision|audio_tower|embed_audio)\.",
    )
}
"""model_type of a vision-language checkpoint whose AutoModelForCausalLM class is the whole model
-> (its language model's causal-LM class, the key mapping that reads the checkpoint's language
model into it, the checkpoint's other parts, which stay on disk)."""


def language_model_of_checkpoint(path: str, kwargs: dict):
    """The language model alone of a TEXT_MODELS checkpoint in folder `path` (from_pretrained
    with `kwargs`); None for any other folder. Every language-model weight must be found, and
    nothing but the vision and audio parts left out: anything else is a ModelError."""
    import re

    import transformers
    from transformers.utils import logging as hf_logging

    model_type = _checkpoint_config(path).get("model_type")
    if model_type not in TEXT_MODELS:
        return None
    class_name, mapping, left_on_disk = TEXT_MODELS[model_type]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its report lists the tower's weights as unexpected: checked below
    try:
        model, info = getattr(transformers, class_name).from_pretrained(
            path, key_mapping=mapping, output_loading_info=True, **kwargs
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    unread = [k for k in info["unexpected_keys"] if not re.match(left_on_disk, k)]
    if info["missing_keys"] or unread or info["mismatched_keys"]:
        found = (sorted(info["missing_keys"]) or sorted(unread) or [str(k) for k in info["mismatched_keys"]])[0]
        raise ModelError(
            f"--model {path}: its language model does not load as {class_name} ({found} missing, left over or "
            f"of another shape); the checkpoint is not a {model_type} model as transformers "
            f"{transformers.__version__} lays it out. Copy or download the model again."
        )
    return model


def _checkpoint_config(folder) -> dict:
    """The folder's own config.json as written (a vision-language checkpoint's top level, not the
    text model's values registry.model_config_of gives); {} where it has none."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


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
    import transformers
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights

    config = _checkpoint_config(model_dir)
    mapping = adapter_key_mapping(config.get("model_type"))
    model_class = getattr(transformers, config["architectures"][0])
    model = model_class.from_pretrained(str(model_dir), **({"dtype": dtype} if dtype is not None else {}))
    adapter = language_model_targets(PeftConfig.from_pretrained(str(adapter_dir)))
    tuned = PeftModel.from_pretrained(model, str(adapter_dir), config=adapter, key_mapping=mapping)
    saved = load_peft_weights(str(adapter_dir), key_mapping=mapping)
    present = {n.replace(".default.", ".") for n, _ in tuned.named_parameters()}
    missing = sorted(set(saved) - present)
    if missing:
        raise ModelError(
            f"{adapter_dir}: {len(missing)} adapter weights have no place in {model_dir}'s model ({missing[0]})"
        )
    return tuned


def language_model_targets(config):
    """The adapter's config with its target modules (names, as lora-lab saves them) matched
    inside the full model's language model only: the vision tower has layers of the same names
    (Gemma 4's q_proj, of a class peft cannot wrap), which the adapter never trained."""
    import re

    if isinstance(config.target_modules, (list, set, tuple)):
        names = "|".join(re.escape(name) for name in sorted(config.target_modules))
        config.target_modules = rf"model\.language_model\.(.*\.)?({names})"
    return config
