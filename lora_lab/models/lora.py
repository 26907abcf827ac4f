"""What trains: LoRA adapters on a frozen base (QLoRA: on 4-bit weights), or every weight."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import LoraArgs
from ..errors import ModelError
from .load import Precision

if TYPE_CHECKING:
    from .fast_lora import FastLoraOptions


def prepare_quantized_for_training(model):
    """QLoRA set-up without peft's fp32 upcast of embedding and lm_head (about 2 GiB on 7B)."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def check_full_finetuning_precision(precision: Precision) -> None:
    """--tuner full never trains in fp16 (--dtype auto picks fp16 on GPUs without bf16)."""
    if precision.name == "fp16":
        raise ModelError(
            "--tuner full: this GPU has no bf16, and full fine-tuning in fp16 is "
            "refused (Qwen2.5's activations overflow fp16 and whole-model updates "
            "diverge). Use a GPU with bf16 (Ampere or newer), --dtype fp32, or "
            "--tuner lora."
        )


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant), by the name this
    transformers version has for it (activation_checkpointing_enable from 5.2x on)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_full_finetuning(model, gradient_checkpointing: bool):
    """Every weight trains (full fine-tuning); activations are recomputed if asked."""
    if gradient_checkpointing:
        enable_checkpointing(model)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def template_token_ids(tokenizer) -> list[int]:
    """The special tokens the chat template writes (role markers, turn ends, think tags), from
    a two-turn conversation rendered by the tokenizer itself."""
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
    except Exception:
        ids = tokenizer.apply_chat_template(messages[1:], tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    return sorted({i for i in ids if i in special} | ({tokenizer.eos_token_id} - {None}))


def trainable_token_modules(model, token_ids: list[int]) -> dict:
    """peft's trainable_token_indices for these tokens: the input embedding's rows and, for an
    output head of its own, the head's rows; not an embedding kept in CPU memory (frozen)."""
    from .memory_means import CpuEmbedding

    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    found = {}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, CpuEmbedding):
        found[names[id(embedding)]] = list(token_ids)
    if head is not None and not model.config.tie_word_embeddings:
        found[names[id(head)]] = list(token_ids)
    return found


@dataclass(frozen=True)
class LoraOptions:
    """How apply_lora builds the adapters, beside the lora section."""

    gradient_checkpointing: bool = False
    means: Any = None
    """The long-sequence means to put in place (planning.memory.MemoryMeans), or None."""
    fast: FastLoraOptions | None = None
    """Route the LoRA layers through models/fast_lora/ with these options; None: peft's forward."""
    offload_copy_stream: bool = False
    """Offloaded checkpoints copy on a side stream (models/fast_offload.py)."""
    trainable_tokens: tuple[int, ...] | None = None
    """Token ids whose embedding and output-head rows train too (trainable_token_modules)."""
    tuner: str = "lora"
    """--tuner lora, dora or ia3."""
    adapter_dir: Path | None = None
    """Continue this saved adapter (trainable) instead of a new one; `args` are then its own."""


def apply_lora(model, args: LoraArgs, options: LoraOptions = LoraOptions()):
    """Wrap the model with peft adapters (--tuner lora, dora or ia3); only the adapters train."""
    from peft import get_peft_model

    from .memory_means import apply_memory_means, move_embedding_to_cpu

    means, tokens = options.means, list(options.trainable_tokens) if options.trainable_tokens else None
    if means is not None and means.embedding_on_cpu:
        move_embedding_to_cpu(model)  # before the input-grad hook below is attached to it
    if options.gradient_checkpointing:
        enable_checkpointing(model)
        model.enable_input_require_grads()
    config = adapter_config(model, args, options.tuner, tokens)
    try:
        if options.adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(options.adapter_dir), is_trainable=True)
        else:
            model = get_peft_model(model, config)
    except ValueError as exc:
        raise ModelError(f"lora.target_modules {args.target_modules}: {exc}") from None
    if options.fast is not None:  # before the MLP chunks, which wrap the MLPs' forward
        from .fast_lora import apply_fast_lora

        apply_fast_lora(model, options.fast)
    if means is not None:
        apply_memory_means(model, means)
        if options.offload_copy_stream and means.offload_checkpoints:
            from .fast_offload import stream_layer_checkpoints

            stream_layer_checkpoints(model)
    return model


IA3_INPUT_SCALED = ("down_proj",)
"""IA3 scales the input of the MLP's output projection (the intermediate activation, as in the
IA3 paper: peft feedforward_modules) and the output of every other targeted layer."""


def adapter_config(model, args: LoraArgs, tuner: str, trainable_tokens: list[int] | None = None):
    """The peft config of --tuner lora (LoraConfig), dora (LoraConfig use_dora) or ia3
    (IA3Config), from the lora section."""
    from peft import IA3Config, LoraConfig

    targets = args.target_modules
    if targets == ["all-linear"]:
        targets = linear_module_names(model)
    if tuner == "ia3":
        return IA3Config(
            target_modules=list(targets),
            task_type="CAUSAL_LM",
            feedforward_modules=[t for t in targets if t in IA3_INPUT_SCALED],
        )
    extra: dict[str, Any] = {}
    if args.experts:
        extra["target_parameters"] = expert_parameter_names(model)
    if trainable_tokens:
        extra["trainable_token_indices"] = trainable_token_modules(model, trainable_tokens)
    return LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,  # type: ignore[arg-type]  # peft annotates int; its scale alpha / r takes a float
        lora_dropout=args.dropout,
        target_modules=list(targets),
        task_type="CAUSAL_LM",
        bias="none",
        use_dora=tuner == "dora",
        use_rslora=args.use_rslora,
        # lora.init is one of LORA_INITS or pissa_niter_N, checked when the config is read
        init_lora_weights=True if args.init == "default" else args.init,  # type: ignore[arg-type]
        **extra,
    )


def save_initial_adapter(model, folder) -> None:
    """The adapter as lora.init pissa / olora made it, before any step: peft converts the trained
    adapter against it (save_converted_adapter). Saved with init_lora_weights=True, so that
    loading it back does not decompose the already residual base again (peft's PiSSA docs)."""
    config = model.peft_config["default"]
    init, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(str(folder))
    finally:
        config.init_lora_weights = init


def save_converted_adapter(model, folder, initial_folder) -> None:
    """The trained PiSSA / OLoRA adapter as a plain LoRA adapter of twice the rank that applies to
    the original base weights (peft path_initial_model_for_weight_conversion): what merge,
    inference and vLLM load. Overwrites the adapter files in `folder`."""
    model.save_pretrained(str(folder), path_initial_model_for_weight_conversion=str(initial_folder))


def linear_module_names(model) -> list[str]:
    """Short names of every linear layer but the output head (q_proj ... down_proj).

    Short names, not peft's resolved full paths, keep adapter_config.json readable by vLLM.
    """
    import torch

    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not set(name.split(".")) & set(ROUTERS)
    }
    return sorted(names - {"lm_head"})


ROUTERS = ("gate", "router", "shared_expert_gate")
"""The linear layers that route tokens to experts in mixture-of-experts models (a router that is
a Linear, or a Linear inside a module named so: Gemma 4's router.proj; Qwen3.5-MoE's gate of its
shared expert): frozen, not in all-linear. The fused experts
(models/moe.py) are no linear layers either: all-linear adapts attention and shared experts."""


def expert_parameter_names(model) -> list[str]:
    """lora.experts: peft target_parameters for the model's fused expert weights (MODULE.PARAMETER,
    e.g. experts.gate_up_proj, experts.down_proj); a model without any is refused."""
    import torch

    from .moe import EXPERT_WEIGHTS, expert_modules

    names = sorted(
        {
            f"{name.rsplit('.', 1)[-1]}.{key}"
            for name, module in expert_modules(model)
            for key in EXPERT_WEIGHTS
            if isinstance(module._parameters.get(key), torch.nn.Parameter)
        }
    )
    if not names:
        raise ModelError(
            "lora.experts: this model has no fused expert weights in 16 bits to adapt (not a mixture of "
            "experts, or its experts are held in 4 bits); drop lora.experts."
        )
    return names
