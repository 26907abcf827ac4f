"""Load the base model and tokenizer (hub id, local folder or GGUF), pick precision, add LoRA."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from .config import LoraArgs, ModelArgs, resolve_model_spec
from .errors import ModelError

log = logging.getLogger("lora_lab")


def cache_dir() -> Path:
    return Path(os.environ.get("LORA_LAB_CACHE", Path.home() / ".cache" / "lora-lab"))


def locate_model(spec: str) -> str:
    """What from_pretrained should load: a hub id or a folder (GGUF files are converted once)."""
    kind, value = resolve_model_spec(spec)
    if kind == "gguf":
        return str(convert_gguf(Path(value)))
    return value


def _hub_error(name: str, exc: Exception) -> ModelError:
    return ModelError(f"--model {name}: could not load it ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200]}). If this machine cannot reach the "
                      f"Hugging Face hub, download the model elsewhere and pass its folder.")


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = locate_model(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _hub_error(spec, exc) from None
    if tokenizer.chat_template is None:
        raise ModelError(f"--model {spec}: the tokenizer has no chat template; lora-lab trains "
                         f"chat models. Use an Instruct model or a folder with a chat template.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_remote_code(path: str, trust_remote_code: bool) -> None:
    """A model whose config asks for its own Python code loads only with --trust-remote-code."""
    config_file = Path(path) / "config.json"
    if trust_remote_code or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    if "auto_map" in config:
        raise ModelError(f"--model {path}: this model ships its own Python code (auto_map in "
                         f"config.json). lora-lab does not run it unless you pass "
                         f"--trust-remote-code after reading that code.")


def check_quantized_folder(path: str) -> None:
    """A w4a16 export (compressed-tensors) loads only where its library is installed."""
    import importlib.util

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return
    method = (json.loads(config_file.read_text()).get("quantization_config") or {}).get(
        "quant_method")
    if method == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is None:
        raise ModelError(f"--model {path}: this folder holds compressed-tensors weights (a "
                         f"`lora-lab export --quantize w4a16` folder); loading it needs "
                         f"`pip install compressed-tensors` (or `pip install 'lora-lab[export]'`).")


@dataclass
class Precision:
    """How weights are stored and how the Trainer computes."""
    name: str  # bf16 | fp16 | fp32
    bf16: bool = False
    fp16: bool = False

    @property
    def torch_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.name]


def choose_precision(requested: str) -> Precision:
    """--dtype auto: bf16 where the GPU has it, fp16 on older GPUs, fp32 on CPU."""
    import torch

    on_gpu = torch.cuda.is_available()
    name = requested
    if requested == "auto":
        if not on_gpu:
            name = "fp32"
        else:
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if name == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
        raise ModelError("--dtype bf16: this GPU has no bf16 support. Use --dtype fp16 "
                         "(or --dtype auto).")
    if name in ("bf16", "fp16") and not on_gpu:
        raise ModelError(f"--dtype {name}: mixed precision training needs a GPU; on CPU use "
                         f"--dtype fp32 (or --dtype auto).")
    if name == "fp16":
        warnings.warn("Training in fp16: Qwen2.5 activations can overflow fp16; LoRA weights are "
                      "kept in fp32 with dynamic loss scaling. Prefer bf16 where the GPU has it.")
    return Precision(name=name, bf16=name == "bf16", fp16=name == "fp16")


def load_base_model(args: ModelArgs, precision: Precision, for_training: bool = True,
                    fp32_master_weights: bool = False, sharded: bool = False,
                    packed_attention: str | None = None):
    """The base model on the right device, in the chosen precision (or 4-bit nf4 for QLoRA).

    With several processes each loads onto its own GPU (LOCAL_RANK). fp32_master_weights (full
    fine-tuning): load fp32 weights whatever the precision; the Trainer computes in bf16 under
    autocast (DeepSpeed keeps its own bf16 copy and fp32 master). sharded (ZeRO-3, FSDP): no
    device_map; the engine places (and ZeRO-3 partitions while loading) the weights.
    packed_attention: segments or varlen: packed rows attend per sample from their lengths
    (lora_lab.activations); None or mask: the model's own attention (with the collator's mask)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = locate_model(args.name)
    check_remote_code(path, args.trust_remote_code)
    check_quantized_folder(path)
    dtype = torch.float32 if fp32_master_weights else precision.torch_dtype
    kwargs = {"dtype": dtype, "trust_remote_code": args.trust_remote_code,
              "attn_implementation": args.attn_implementation}
    if packed_attention in ("segments", "varlen") and args.attn_implementation == "sdpa":
        from .activations import register_packed_attention

        kwargs["attn_implementation"] = register_packed_attention(packed_attention)
    if args.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(precision)
    if torch.cuda.is_available() and not sharded:
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    elif args.quantization == "nf4":
        kwargs["device_map"] = "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise ModelError(f"--model {args.name}: needs its own Python code; pass "
                             f"--trust-remote-code if you trust it.") from None
        raise _hub_error(args.name, exc) from None
    if for_training:
        model.config.use_cache = False
        apply_kernels(model, args.kernels)
    return model


def liger_available() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def resolve_kernels(kernels: str) -> str:
    """model.kernels -> what this machine will use: "liger" or "none"."""
    if kernels == "none" or (kernels == "auto" and not liger_available()):
        return "none"
    if not liger_available():
        raise ModelError("--set model.kernels=liger needs a CUDA GPU and the liger-kernel "
                         "package (pip install liger-kernel); use model.kernels=auto or none.")
    return "liger"


def apply_kernels(model, kernels: str) -> str:
    """Swap in liger-kernel's fused Triton kernels (GPU only); returns what was applied.

    The fused linear cross-entropy never builds the [tokens x 151936] logits tensor, which is
    the largest single activation of a Qwen2.5 training step.
    """
    if resolve_kernels(kernels) == "none":
        return "none"
    if model.config.model_type != "qwen2":
        log.info("liger kernels: only wired for Qwen2 models; not applied")
        return "none"
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)
    return "liger"


def nf4_config(precision: Precision):
    """4-bit NormalFloat with double quantization; compute in the training precision."""
    import torch
    from transformers import BitsAndBytesConfig

    compute = precision.torch_dtype if precision.name != "fp32" else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def check_full_finetuning_precision(precision: Precision) -> None:
    """--tuner full never trains in fp16 (--dtype auto picks fp16 on GPUs without bf16)."""
    if precision.name == "fp16":
        raise ModelError("--tuner full: this GPU has no bf16, and full fine-tuning in fp16 is "
                         "refused (Qwen2.5's activations overflow fp16 and whole-model updates "
                         "diverge). Use a GPU with bf16 (Ampere or newer), --dtype fp32, or "
                         "--tuner lora.")


def prepare_full_finetuning(model, gradient_checkpointing: bool):
    """Every weight trains (full fine-tuning); activations are recomputed if asked."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def apply_lora(model, args: LoraArgs, gradient_checkpointing: bool, means=None):
    """Wrap the model with PEFT LoRA adapters; only the adapters train.

    means (lora_lab.memory.MemoryMeans): the long-sequence means to put in place."""
    from peft import LoraConfig, get_peft_model

    from .activations import apply_memory_means, move_embedding_to_cpu

    if means is not None and means.embedding_on_cpu:
        move_embedding_to_cpu(model)  # before the input-grad hook below is attached to it
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    targets = args.target_modules
    if targets == ["all-linear"]:
        targets = linear_module_names(model)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout,
                        target_modules=list(targets), task_type="CAUSAL_LM", bias="none")
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise ModelError(f"lora.target_modules {args.target_modules}: {exc}") from None
    if means is not None:
        apply_memory_means(model, means)
    return model


def linear_module_names(model) -> list[str]:
    """Short names of every linear layer but the output head (q_proj ... down_proj).

    Short names, not peft's resolved full paths, keep adapter_config.json readable by vLLM.
    """
    import torch

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear)}
    return sorted(names - {"lm_head"})


# ----------------------------------------------------------------------------- GGUF

def convert_gguf(gguf: Path, out: Path | None = None) -> Path:
    """De-quantize a .gguf into a Hugging Face folder (bf16 safetensors), cached by file."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(out) if out else cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / ".complete").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder in %s (once)", gguf, out)
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise ModelError("--model *.gguf needs the `gguf` package: pip install gguf") from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    # The GGUF loader marks the model as quantized: copy the de-quantized weights into a plain one.
    plain = {k: v for k, v in loaded.config.to_dict().items()
             if k not in ("quantization_config", "_name_or_path")}
    config = AutoConfig.for_model(**plain)
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise ModelError(f"{gguf}: unexpected tensors in the GGUF file ({unexpected[:3]} "
                         f"{missing[:3]}).")
    if missing:
        model.tie_weights()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = [i for i in eos if i is not None]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)
    (out / ".complete").write_text(str(gguf) + "\n")
    return out
