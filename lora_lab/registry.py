"""The models lora-lab knows: what differs per family (keyed by config.json's model_type), the
aliases and the real config.json of the models it can plan without downloading, and how a
--model value is classified (hub id, folder or .gguf)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .architecture import expert_count, parameter_count
from .errors import LoraLabError, ModelError
from .paths import model_configs_dir

QWEN25_SIZES = ("0.5b", "1.5b", "3b", "7b")


_SIZE_SPELLING = {"0.5b": "0.5B", "1.5b": "1.5B", "3b": "3B", "7b": "7B"}


def _model_aliases() -> dict[str, str]:
    aliases = {}
    for size, spelled in _SIZE_SPELLING.items():
        aliases[f"qwen2.5-{size}"] = f"Qwen/Qwen2.5-{spelled}-Instruct"
        aliases[f"qwen2.5-{size}-instruct"] = f"Qwen/Qwen2.5-{spelled}-Instruct"
        aliases[f"qwen2.5-{size}-base"] = f"Qwen/Qwen2.5-{spelled}"
    return aliases


# alias -> (hub id, shipped config file in lora_lab/model_configs, without .json)
OTHER_MODELS = {
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
    "qwen3-0.6b-base": ("Qwen/Qwen3-0.6B-Base", "qwen3-0.6b"),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "qwen3-1.7b"),
    "qwen3-1.7b-base": ("Qwen/Qwen3-1.7B-Base", "qwen3-1.7b"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "qwen3-4b"),
    "qwen3-4b-base": ("Qwen/Qwen3-4B-Base", "qwen3-4b"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "qwen3-8b"),
    "qwen3-8b-base": ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    "llama-3.2-1b-base": ("meta-llama/Llama-3.2-1B", "llama-3.2-1b"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", "llama-3.2-3b"),
    "llama-3.2-3b-base": ("meta-llama/Llama-3.2-3B", "llama-3.2-3b"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    "llama-3.1-8b-base": ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    "gemma-3-270m": ("google/gemma-3-270m-it", "gemma-3-270m"),
    "gemma-3-270m-base": ("google/gemma-3-270m", "gemma-3-270m"),
    "gemma-3-1b": ("google/gemma-3-1b-it", "gemma-3-1b"),
    "gemma-3-1b-base": ("google/gemma-3-1b-pt", "gemma-3-1b"),
    "gemma-3-4b": ("google/gemma-3-4b-it", "gemma-3-4b"),
    "gemma-3-4b-base": ("google/gemma-3-4b-pt", "gemma-3-4b"),
    "phi-4-mini": ("microsoft/Phi-4-mini-instruct", "phi-4-mini"),
    "mistral-7b": ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
    "mistral-7b-base": ("mistralai/Mistral-7B-v0.3", "mistral-7b"),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    "qwen3.5-0.8b": ("Qwen/Qwen3.5-0.8B", "qwen3.5-0.8b"),
    "qwen3.5-0.8b-base": ("Qwen/Qwen3.5-0.8B-Base", "qwen3.5-0.8b"),
    "qwen3.5-2b": ("Qwen/Qwen3.5-2B", "qwen3.5-2b"),
    "qwen3.5-2b-base": ("Qwen/Qwen3.5-2B-Base", "qwen3.5-2b"),
    "qwen3.5-4b": ("Qwen/Qwen3.5-4B", "qwen3.5-4b"),
    "qwen3.5-4b-base": ("Qwen/Qwen3.5-4B-Base", "qwen3.5-4b"),
    "qwen3.5-9b": ("Qwen/Qwen3.5-9B", "qwen3.5-9b"),
    "qwen3.5-9b-base": ("Qwen/Qwen3.5-9B-Base", "qwen3.5-9b"),
    "qwen3.5-27b": ("Qwen/Qwen3.5-27B", "qwen3.5-27b"),
    "qwen3.6-27b": ("Qwen/Qwen3.6-27B", "qwen3.6-27b"),
    "smollm3-3b": ("HuggingFaceTB/SmolLM3-3B", "smollm3-3b"),
    "smollm3-3b-base": ("HuggingFaceTB/SmolLM3-3B-Base", "smollm3-3b"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    "qwen3-30b-a3b-base": ("Qwen/Qwen3-30B-A3B-Base", "qwen3-30b-a3b"),
    "qwen3.5-35b-a3b": ("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
    "qwen3.5-35b-a3b-base": ("Qwen/Qwen3.5-35B-A3B-Base", "qwen3.5-35b-a3b"),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "gpt-oss-20b"),
    "gemma-4-e2b": ("google/gemma-4-E2B-it", "gemma-4-e2b"),
    "gemma-4-e2b-base": ("google/gemma-4-E2B", "gemma-4-e2b"),
    "gemma-4-e4b": ("google/gemma-4-E4B-it", "gemma-4-e4b"),
    "gemma-4-e4b-base": ("google/gemma-4-E4B", "gemma-4-e4b"),
    "gemma-4-26b-a4b": ("google/gemma-4-26B-A4B-it", "gemma-4-26b-a4b"),
    "gemma-4-26b-a4b-base": ("google/gemma-4-26B-A4B", "gemma-4-26b-a4b"),
    "gemma-4-31b": ("google/gemma-4-31B-it", "gemma-4-31b"),
    "gemma-4-31b-base": ("google/gemma-4-31B", "gemma-4-31b"),
}
"""Models of other families lora-lab can plan without a download (their real architecture
values ship in lora_lab/model_configs; model_configs/SOURCE.md says where each came from)."""

MODEL_ALIASES = {**_model_aliases(), **{alias: hub for alias, (hub, _) in OTHER_MODELS.items()}}
_CONFIG_OF_HUB_ID = {hub.lower(): name for hub, name in OTHER_MODELS.values()}
_BASE_HUB_IDS = {MODEL_ALIASES[a].lower() for a in MODEL_ALIASES if a.endswith("-base")}
"""The hub ids of the -base aliases (base, not instruction-tuned, checkpoints)."""


@dataclass(frozen=True)
class Family:
    """What lora-lab does differently for one model_type."""

    name: str
    liger: str | None = None
    """liger_kernel.transformers function that patches this family (None: no fused kernels)."""
    vllm_lora_modules: frozenset | None = None
    """The modules vLLM's LoRA support accepts for this family (None: not known here)."""
    liger_without: frozenset = frozenset()
    """The kernels that function refuses for this family (Qwen3.5: rope)."""
    attention: str | None = None
    """The attention implementation the family needs on a GPU where sdpa cannot run it (gpt-oss:
    flex_attention, which has its attention sinks where sdpa has none; eager on the CPU, where
    flex_attention has no sinks); None: sdpa."""
    liger_experts: bool = False
    """liger's function replaces the fused experts with its own (LigerExperts: one fused MoE
    kernel), which also computes the experts' weight gradient when they are frozen; the planner
    counts that bf16 copy of a layer's experts (planning/shape.expert_working_bytes)."""
    masks_without_positions: bool = False
    """The family's decoder builds its attention masks without the position ids, so a packed row
    attended by its own attention would attend across samples (gpt-oss): lora-lab builds them
    (models/attention.masks_from_positions)."""


_LINEAR7 = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
_QWEN3_5 = Family(
    "Qwen3.5, Qwen3.6 (dense; hybrid linear attention)",
    "apply_liger_kernel_to_qwen3_5",
    liger_without=frozenset({"rope"}),
)
"""Three Gated DeltaNet (linear attention) layers to one full attention."""
_QWEN3_5_MOE = Family(
    "Qwen3.5, Qwen3.6 mixture of experts (hybrid linear attention)",
    "apply_liger_kernel_to_qwen3_5_moe",
    liger_without=frozenset({"rope"}),
    liger_experts=True,
)
_GEMMA4 = Family("Gemma 4 (text; dense and mixture of experts)", "apply_liger_kernel_to_gemma4_text")
"""Sliding and full attention (wider heads), per-layer inputs and shared keys and values in E2B
and E4B, a dense MLP beside the experts in 26B-A4B."""
FAMILIES = {
    "qwen2": Family(
        "Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills of Qwen2.5)", "apply_liger_kernel_to_qwen2", _LINEAR7
    ),
    "qwen3": Family("Qwen3", "apply_liger_kernel_to_qwen3", _LINEAR7),
    "llama": Family("Llama 3.x, SmolLM2, TinyLlama", "apply_liger_kernel_to_llama", _LINEAR7),
    "mistral": Family("Mistral", "apply_liger_kernel_to_mistral", _LINEAR7),
    "gemma3_text": Family("Gemma 3 (text)", "apply_liger_kernel_to_gemma3_text", _LINEAR7),
    "phi3": Family(
        "Phi-3, Phi-4-mini",
        "apply_liger_kernel_to_phi3",
        frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
    ),
    "starcoder2": Family("StarCoder2", None, frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"})),
    # Qwen3.5 / 3.6 dense: its text model, and the vision-language checkpoint around it
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5": _QWEN3_5,
    "smollm3": Family("SmolLM3", "apply_liger_kernel_to_smollm3"),
    # mixture of experts: fused expert tensors (models/moe.py holds them in 4 bits for QLoRA)
    "qwen3_moe": Family("Qwen3-MoE (Qwen3-30B-A3B)", "apply_liger_kernel_to_qwen3_moe", liger_experts=True),
    "qwen3_5_moe_text": _QWEN3_5_MOE,
    "qwen3_5_moe": _QWEN3_5_MOE,
    "gpt_oss": Family(
        "gpt-oss", "apply_liger_kernel_to_gpt_oss", attention="flex_attention", masks_without_positions=True
    ),
    # Gemma 4: its text model, and the vision-language checkpoint around it
    "gemma4_text": _GEMMA4,
    "gemma4": _GEMMA4,
}
LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""The linear layers of a Gated DeltaNet layer (Qwen3.5): q/k/v together, the output gate z,
the update gate b, the decay a and the output; "all linear layers" includes them."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
"""The tokens chat templates close a turn with (ChatML and Qwen, Qwen, Gemma, Llama 3, Phi-3):
generation stops at those a vocabulary has, and a trained reply ends at the one that closes it."""
GENERIC = Family("other causal language models")
"""An unknown model_type trains on the generic path: peft's LoRA on its linear layers, no fused
kernels."""


def family_of(model_type: str | None) -> Family:
    return FAMILIES.get(model_type or "", GENERIC)


def attention_for(model_type: str | None, requested: str, cuda: bool) -> str:
    """The attention implementation a model runs: `requested`, except sdpa for a family that
    sdpa cannot run (Family.attention on a GPU, eager on the CPU)."""
    needed = family_of(model_type).attention
    if needed is None or requested != "sdpa":
        return requested
    return needed if cuda else "eager"


def missing_fast_paths(family: Family) -> list[str]:
    """What an unknown or partly known family trains without (said once at the start)."""
    missing = [] if family.liger else ["liger-kernel's fused kernels"]
    if family.vllm_lora_modules is None:
        missing.append("a known list of vLLM's LoRA modules (serving is not checked)")
    return missing


_MARKED_INSTRUCT_REPOS = (
    "qwen/qwen2.5-",
    "meta-llama/",
    "google/gemma-",
    "mistralai/",
    "microsoft/phi-",
    "huggingfacetb/smollm-",
    "huggingfacetb/smollm2-",
)
"""Hub repositories whose instruction-tuned models say so in their name (-Instruct, -it, -chat):
one without it is a base checkpoint. Qwen3's, Qwen3.5's and SmolLM3's post-trained models carry
no such mark (their base checkpoints end in -Base)."""


def is_base_model(spec: str) -> bool:
    """Whether --model names a base (pretrained, not instruction-tuned) checkpoint: a -base
    alias, a hub id ending in -Base, or one of _MARKED_INSTRUCT_REPOS without its instruct mark.
    A folder or .gguf file cannot say: lora.trainable_tokens=true marks one."""
    text = str(spec).strip().lower()
    hub = MODEL_ALIASES.get(text, text).lower()
    name = hub.rsplit("/", 1)[-1]
    marked = hub.startswith(_MARKED_INSTRUCT_REPOS) and not any(mark in name for mark in ("instruct", "-it", "chat"))
    return hub in _BASE_HUB_IDS or name.endswith("-base") or marked


def wants_trainable_tokens(setting, tuner: str, model_name: str) -> bool:
    """lora.trainable_tokens: auto is on for LoRA and DoRA on a base checkpoint (peft's IA3 has
    no trainable token rows)."""
    if tuner not in ("lora", "dora") or setting is False:
        return False
    return setting is True or is_base_model(model_name)


_SHIPPED_TOKENIZER_MODELS = {f"qwen/qwen2.5-{spelled.lower()}-instruct" for spelled in _SIZE_SPELLING.values()}


def uses_shipped_tokenizer(repo_id: str) -> bool:
    """Every Qwen2.5 Instruct size has the tokenizer shipped in lora_lab/qwen25_tokenizer, byte
    for byte; base models are not covered (their files were not checked against it)."""
    return repo_id.lower() in _SHIPPED_TOKENIZER_MODELS


_NO_SUCH_SIZE = re.compile(r"qwen2\.5-(\d+(?:\.\d+)?)b", re.IGNORECASE)


def resolve_model_spec(spec: str) -> tuple[str, str]:
    """Classify --model: returns (kind, value) with kind in {"hub", "folder", "gguf"}."""
    text = str(spec).strip()
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"--model {text}: GGUF file not found. Check the path.")
        return "gguf", str(path.resolve())
    if path.is_dir():
        return "folder", str(path.resolve())
    match = _NO_SUCH_SIZE.search(text)
    if match and match.group(1).lower() + "b" not in QWEN25_SIZES:
        size = match.group(1)
        hint = " (1.8B is a Qwen1.5 size)" if size == "1.8" else ""
        raise ModelError(
            f"--model {text}: Qwen2.5 has no {size}B size{hint}. Qwen2.5 comes in "
            f"0.5B, 1.5B, 3B and 7B; try --model qwen2.5-1.5b."
        )
    if text.lower() in MODEL_ALIASES:
        return "hub", MODEL_ALIASES[text.lower()]
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1
    if looks_like_path:
        raise ModelError(
            f"--model {text}: no such folder. Pass an existing model folder, "
            f"a .gguf file or a hub id such as Qwen/Qwen2.5-7B-Instruct."
        )
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return "hub", text
    raise ModelError(
        f"--model {text}: not a folder, .gguf file, hub id or known alias. "
        f"Aliases: {', '.join(sorted(MODEL_ALIASES)[:4])} ... (see "
        f"docs/training.md)."
    )


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
"""The config.json keys lora-lab's arithmetic reads: each a positive whole number (a mixture of
experts may give its experts' width as moe_intermediate_size instead of intermediate_size)."""


def _local_config(kind: str, value: str) -> dict | None:
    """A resolved model spec's own config.json, when it is a folder that has one; a file that
    is not a model's config (bad JSON, a shape key missing or not a positive number) is a
    ModelError naming it."""
    path = Path(value) / "config.json"
    if not (kind == "folder" and path.is_file()):
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc}); copy or download the model again.") from None
    text = config.get("text_config") if isinstance(config, dict) else None
    shape = {**config, **text} if isinstance(text, dict) else config
    if not isinstance(shape, dict):
        raise ModelError(f"{path}: holds no JSON object; a model's config.json is one. Copy the model again.")
    for key in SHAPE_KEYS:
        if key == "intermediate_size" and "intermediate_size" not in shape and expert_count(shape):
            key = "moe_intermediate_size"
        value_of = shape.get(key)
        if isinstance(value_of, bool) or not isinstance(value_of, int) or value_of <= 0:
            raise ModelError(
                f"{path}: {key} is {'missing' if key not in shape else repr(value_of)}, not a positive whole "
                f"number; this is not the config.json of a model lora-lab can train. Copy the model again, "
                f"or fix the file."
            )
    for key in ("head_dim", "num_key_value_heads"):
        if (
            key in shape
            and shape[key] is not None
            and (isinstance(shape[key], bool) or not isinstance(shape[key], int) or shape[key] <= 0)
        ):
            raise ModelError(f"{path}: {key} is {shape[key]!r}, not a positive whole number; fix the file.")
    return config


def guess_model_size(spec: str) -> str | None:
    """'7b' for any Qwen2.5-7B spelling or a local folder of that shape; None if unknown."""
    try:
        kind, value = resolve_model_spec(spec)
    except LoraLabError:
        return None
    local = _local_config(kind, value)
    if local is not None:
        shape = _shape_of(local)
        for size in QWEN25_SIZES:
            if shape == _shape_of(known_model_config(size)):
                return size
        return None
    name = Path(value).name.lower()
    match = re.search(r"qwen2\.5-(?:\w+-)?(\d+(?:\.\d+)?)b", name)
    found = match.group(1) + "b" if match else None
    return found if found in QWEN25_SIZES else None


def model_config_of(spec: str) -> dict | None:
    """The model's config.json: a local folder's own, else the shipped one of a known model
    (a Qwen2.5 size its name says, or one of OTHER_MODELS); None if neither is known. For a
    vision-language config the text model's values (text_config) are returned."""
    try:
        kind, value = resolve_model_spec(spec)
    except LoraLabError:
        return None
    config = _local_config(kind, value)
    if config is None and kind == "hub" and value.lower() in _CONFIG_OF_HUB_ID:
        config = _shipped_config(_CONFIG_OF_HUB_ID[value.lower()])
    if config is None:
        size = guess_model_size(spec)
        config = known_model_config(size) if size else None
    if config is not None and isinstance(config.get("text_config"), dict):
        config = {
            **config["text_config"],
            "tie_word_embeddings": config.get(
                "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", True)
            ),
        }
    return config


SIZE_CLASS_BILLIONS = (("0.5b", 1.0), ("1.5b", 2.5), ("3b", 5.0), ("7b", 12.0), ("large", float("inf")))
"""A preset's `sizes` block for a model that is not a Qwen2.5 size: the first class whose bound
(billions of parameters) the model stays under (Qwen3-8B and Llama-3.1-8B take 7b's, Phi-4-mini
and Gemma-3-4B 3b's; the mixtures of experts and Gemma 4 26B and 31B take large's: QLoRA on
every card)."""


def size_class(spec: str) -> tuple[str | None, str]:
    """(the preset size block for --model spec, why): the Qwen2.5 size it is, else the class of
    its parameter count; (None, "") for a model of unknown shape."""
    size = guess_model_size(spec)
    if size is not None:
        return size, ""
    config = model_config_of(spec)
    if config is None:
        return None, ""
    billions = parameter_count(config) / 1e9
    size = next(name for name, bound in SIZE_CLASS_BILLIONS if billions < bound)
    return size, f"{billions:.1f}B parameters"


def _shipped_config(name: str) -> dict:
    return json.loads((model_configs_dir() / f"{name}.json").read_text())


def _shape_of(config: dict) -> tuple:
    return tuple(config.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size"))


def known_model_config(size: str) -> dict:
    """The real config.json of Qwen2.5 at `size` (shipped in lora_lab/model_configs)."""
    return _shipped_config(f"qwen2.5-{size}")


def model_display_name(spec: str) -> str:
    """A short name for plans and messages: Qwen2.5-7B for its aliases, else the hub id's or
    folder's last part."""
    size = guess_model_size(spec)
    if size is not None:
        return f"Qwen2.5-{_SIZE_SPELLING[size]}"
    try:
        _, value = resolve_model_spec(spec)
    except LoraLabError:
        value = str(spec)
    return Path(value).name or str(spec)
