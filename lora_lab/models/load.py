"""Load the base model and tokenizer (hub id, local folder or GGUF): where it is, the checks of
its files, the precision, the nf4 config. The fused kernels are models/kernels.py's."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..architecture import expert_count, is_mxfp4, streams_experts
from ..config import ModelArgs
from ..errors import ModelError
from ..log import get_logger
from ..paths import safetensors_problem, shipped_tokenizer_dir
from ..registry import attention_for, family_of, model_config_of, resolve_model_spec, uses_shipped_tokenizer
from .gguf import convert_gguf
from .hub import announce_download, cached_snapshot, hub_problem, locate_hub_model
from .kernels import apply_kernels

log = get_logger()


def locate_model(spec: str) -> str:
    """What from_pretrained should load: a hub id or a folder (GGUF files are converted once; a
    hub id is asked for once, so a missing repo or an unreachable hub stops here at once)."""
    kind, value = resolve_model_spec(spec)
    if kind == "gguf":
        return str(convert_gguf(Path(value)))
    if kind == "hub":
        return locate_hub_model(spec, value)
    return value


def locate_tokenizer(spec: str) -> tuple[str, str]:
    """Where a tokenizer for counting tokens comes from, and a line that says so. A Qwen2.5
    Instruct model that is not in the local hub cache uses the identical tokenizer shipped with
    lora-lab, so that the data commands need neither a download nor the hub. Any other model's
    counts come from its own tokenizer or not at all: another family's tokenizer splits text
    differently and its chat template adds other tokens (peers count with the model's own)."""
    kind, value = resolve_model_spec(spec)
    if kind == "hub":
        cached = cached_snapshot(value, "tokenizer_config.json")
        if cached:
            return cached, f"tokenizer: {value} (local hub cache)"
        if uses_shipped_tokenizer(value):
            return (
                str(shipped_tokenizer_dir()),
                f"tokenizer: the Qwen2.5 Instruct tokenizer "
                f"shipped with lora-lab (the one {value} uses; not in the local hub cache)",
            )
        return _hub_tokenizer(spec, value)
    path = locate_model(spec)
    return path, f"tokenizer: {path}"


def _hub_tokenizer(spec: str, repo_id: str) -> tuple[str, str]:
    """A hub model's own tokenizer, from the hub; where the hub cannot be asked, one message
    naming the ways to have the tokenizer here (never counts with another one)."""
    from huggingface_hub import constants

    problem = ("unreachable", "") if constants.HF_HUB_OFFLINE else hub_problem(spec, repo_id)
    if problem is None:
        return repo_id, f"tokenizer: {repo_id} (from the hub)"
    kind, message = problem
    if kind == "missing":
        raise ModelError(message)
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"the hub ({constants.ENDPOINT}) cannot be reached"
    model_type = (model_config_of(spec) or {}).get("model_type")
    if model_type == "qwen2":
        shipped = (
            "The Qwen2.5 Instruct tokenizer shipped with lora-lab was not checked "
            "against this model's tokenizer and chat template."
        )
    else:
        family = f"a {family_of(model_type).name} model" if model_type else "this model"
        shipped = (
            f"The tokenizer shipped with lora-lab is Qwen2.5 Instruct's; {family} has "
            f"its own vocabulary and chat template, and counts with Qwen2.5's would be "
            f"wrong."
        )
    raise ModelError(
        f"--model {spec}: counting tokens needs {repo_id}'s own tokenizer; it is not in the "
        f"local hub cache ({constants.HF_HUB_CACHE}) and {why}. {shipped} Pass a local folder "
        f"with the model's tokenizer (--model /path/to/folder), or download it where the hub "
        f"is reachable (`hf download {repo_id} --include '*.json' '*.jinja' 'tokenizer*'`), "
        f"copy the hub cache here and run with HF_HUB_OFFLINE=1."
    )


def _hub_error(name: str, exc: Exception) -> ModelError:
    return ModelError(
        f"--model {name}: could not load it ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:200]}). If this machine cannot reach the "
        f"Hugging Face hub, download the model elsewhere and pass its folder."
    )


def load_tokenizer(spec: str, trust_remote_code: bool = False, path: str | None = None):
    """The model's tokenizer, with its chat template; path: locate_model(spec), if known."""
    from transformers import AutoTokenizer

    path = path or locate_model(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _hub_error(spec, exc) from None
    if tokenizer.chat_template is None:
        hint = (
            f" A base model's GGUF often has none: put its family's template into {path} as "
            f"chat_template.jinja and pass that folder."
            if str(spec).endswith(".gguf")
            else ""
        )
        raise ModelError(
            f"--model {spec}: the tokenizer has no chat template; lora-lab trains "
            f"chat models. Use an Instruct model or a folder with a chat template."
            f"{hint}"
        )
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
        raise ModelError(
            f"--model {path}: this model ships its own Python code (auto_map in "
            f"config.json). lora-lab does not run it unless you pass "
            f"--trust-remote-code after reading that code."
        )


def check_model_files(path: str) -> None:
    """Every *.safetensors file of a local model folder is whole (a copy cut short fails here,
    by name, instead of deep inside from_pretrained)."""
    folder = Path(path)
    if not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"--model {path}: this folder has no config.json, so it is not a model "
            f"folder. Pass the folder that holds config.json and the weights, a "
            f".gguf file or a hub id."
        )
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ModelError(f"--model {path}: {problem}. Copy or download the model again.")


def pickled_weights(path: str) -> list[str]:
    """The pickled weight files (*.bin, *.pt, *.pth) of a model folder, by name."""
    folder = Path(path)
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if folder.is_dir() else []


def check_quantized_folder(path: str) -> None:
    """A w4a16 or awq export (compressed-tensors) loads only where its library is installed."""
    import importlib.util

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return
    method = (json.loads(config_file.read_text()).get("quantization_config") or {}).get("quant_method")
    if method == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is None:
        raise ModelError(
            f"--model {path}: this folder holds compressed-tensors weights (a "
            f"`lora-lab export --quantize w4a16` or `awq` folder); loading it needs "
            f"`pip install compressed-tensors` (or `pip install 'lora-lab[export]'`)."
        )


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
        raise ModelError("--dtype bf16: this GPU has no bf16 support. Use --dtype fp16 (or --dtype auto).")
    if name in ("bf16", "fp16") and not on_gpu:
        raise ModelError(
            f"--dtype {name}: mixed precision training needs a GPU; on CPU use --dtype fp32 (or --dtype auto)."
        )
    if name == "fp16":
        warnings.warn(
            "Training in fp16: Qwen2.5 activations can overflow fp16; LoRA weights are "
            "kept in fp32 with dynamic loss scaling. Prefer bf16 where the GPU has it.",
            stacklevel=2,
        )
    return Precision(name=name, bf16=name == "bf16", fp16=name == "fp16")


@dataclass(frozen=True)
class LoadOptions:
    """How load_base_model loads, beside the model section and the precision."""

    for_training: bool = True
    """Training: no KV cache, and model.kernels applied; False for merge, inference, export."""
    fp32_master_weights: bool = False
    """Full fine-tuning: fp32 weights whatever the precision; the Trainer computes in bf16 under
    autocast (DeepSpeed keeps its own bf16 copy and fp32 master)."""
    sharded: bool = False
    """ZeRO-3, FSDP: no device_map; the engine places (and ZeRO-3 partitions while loading) the
    weights."""
    packed_attention: str | None = None
    """segments or varlen: packed rows attend per sample from their lengths
    (models/attention.py); None or mask: the model's own attention (with the collator's mask)."""
    path: str | None = None
    """locate_model(args.name) when the caller has it (and has checked its remote code and
    files)."""
    fused_loss: bool = True
    """liger's fused linear cross-entropy (kernels liger); off where rows of the head train."""
    kernels: str = "none"
    """The kernels a training load applies: the run plan's settled model.kernels (liger or none)."""
    liger_experts: bool = True
    """With liger's kernels, a family's experts run through its fused MoE (planning/policies.py
    resolve_liger_experts settles model.liger_experts)."""
    longest_row: int = 0
    """Tokens of the longest training row (data.max_length unpacked): rows of LONG_ROW_TOKENS or
    more attend through models/attention.sdpa_long_rows."""


def _attention_function(attention: str, packed: str | None, args: ModelArgs, options: LoadOptions) -> str:
    """The attention implementation from_pretrained gets: packed rows attend per sample
    (models/attention.py); with model.cudnn_attention true, unpacked training rows on CUDA that
    may be long take sdpa with a long row on cuDNN's kernel; else the family's own."""
    import torch

    from .attention import LONG_ROW_TOKENS, register_long_rows_attention, register_packed_attention

    if packed:
        return register_packed_attention(packed, args.cudnn_attention is not False)
    cudnn = args.cudnn_attention is True and torch.cuda.is_available()
    if attention == "sdpa" and options.for_training and cudnn and options.longest_row >= LONG_ROW_TOKENS:
        return register_long_rows_attention()
    return attention


def load_base_model(args: ModelArgs, precision: Precision, options: LoadOptions = LoadOptions()):
    """The base model on the right device, in the chosen precision (or 4-bit nf4 for QLoRA).
    With several processes each loads onto its own GPU (LOCAL_RANK)."""
    import torch

    path = options.path
    if path is None:
        path = locate_model(args.name)
        check_remote_code(path, args.trust_remote_code)
        check_model_files(path)
    if not Path(path).exists():  # a hub id the hub has: from_pretrained downloads what is missing
        announce_download(path)
    check_quantized_folder(path)
    dtype = torch.float32 if options.fp32_master_weights else precision.torch_dtype
    model_config = model_config_of(path) or {}
    attention = attention_for(model_config.get("model_type"), args.attn_implementation, torch.cuda.is_available())
    packed = options.packed_attention if options.packed_attention in ("segments", "varlen") else None
    packed = packed if attention == "sdpa" else None
    kwargs = {
        "dtype": dtype,
        "trust_remote_code": args.trust_remote_code,
        "attn_implementation": _attention_function(attention, packed, args, options),
    }
    gpu = None if options.sharded else process_gpu()
    kwargs.update(_placement(args, precision, model_config, gpu))
    streamed = _streamed_experts(args, model_config, path, options)
    if streamed is not None:  # models/expert_loading.py: the experts wait in the files
        from .expert_loading import report_checked, stand_in_experts

        kwargs.update(streamed.load_kwargs, device_map={"": gpu} if gpu else "cpu", output_loading_info=True)
        with report_checked(path) as check:
            model = check(_from_pretrained(args.name, path, kwargs))
        stand_in_experts(model, path, streamed, gpu)
    else:
        model = _from_pretrained(args.name, path, kwargs)
    if streamed is None and args.quantization == "nf4":
        _hold_in_4_bits(model, model_config, gpu, options.for_training)
    if packed:
        from .attention import skip_masks_of_packed_rows

        skip_masks_of_packed_rows(model)
    elif options.packed_attention == "positions" and family_of(model_config.get("model_type")).masks_without_positions:
        from .attention import masks_from_positions

        masks_from_positions(model)
    if options.for_training and hasattr(model, "router_aux_loss_coef"):
        _weigh_load_balancing(model, args.router_aux_loss_coef)
    if options.for_training:
        from .linear_attention import keep_samples_apart

        model.config.use_cache = False
        keep_samples_apart(model)  # packed rows restart linear attention's state at each sample
        apply_kernels(model, options.kernels, options.fused_loss, args.native_rms_norm, options.liger_experts)
    return model


def _placement(args: ModelArgs, precision: Precision, model_config: dict, gpu: str | None) -> dict:
    """from_pretrained's quantization_config and device_map. An MXFP4 checkpoint is read
    de-quantized (MXFP4 does not train, and transformers will not trade its config for
    bitsandbytes'): QLoRA then holds it in 4 bits after loading (_hold_in_4_bits). A mixture of
    experts' QLoRA loads into CPU memory: its 16-bit experts, which bitsandbytes leaves as they
    are, go to the GPU a tensor at a time in 4 bits (models/moe.py)."""
    kwargs: dict = {}
    if is_mxfp4(model_config):
        from transformers.utils.quantization_config import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    elif args.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(precision)
    on_cpu = args.quantization == "nf4" and (expert_count(model_config) > 0 or gpu is None)
    if gpu or on_cpu:
        kwargs["device_map"] = "cpu" if on_cpu else {"": gpu}
    return kwargs


def _streamed_experts(args: ModelArgs, model_config: dict, path: str, options: LoadOptions):
    """A mixture of experts' QLoRA training load whose experts are read from the checkpoint files
    only when quantized (models/expert_loading.py): what streaming_load found, or None where it
    loads them with the rest."""
    from .expert_loading import streaming_load
    from .multimodal import TEXT_MODELS

    if args.quantization != "nf4" or not options.for_training or options.sharded or not streams_experts(model_config):
        return None
    if model_config.get("model_type") in TEXT_MODELS or not Path(path).is_dir():
        return None
    return streaming_load(path, args.trust_remote_code)


def _hold_in_4_bits(model, model_config: dict, gpu: str | None, for_training: bool) -> None:
    """QLoRA's 4-bit weights beyond what bitsandbytes' config quantized at load: an MXFP4
    checkpoint's linear layers (all but the head), and a mixture of experts' experts, which a
    training run quantizes only once its adapter is attached (models/moe.py adapted_experts_to)."""
    from .moe import keep_experts_on_cpu_moving, quantize_experts, quantize_linear_layers

    if is_mxfp4(model_config):
        quantize_linear_layers(model, gpu)
    if expert_count(model_config) == 0:
        return
    if for_training and gpu:
        keep_experts_on_cpu_moving(model, gpu)
    elif not for_training:
        quantize_experts(model, gpu)
        if gpu:
            model.to(gpu)


def _from_pretrained(name: str, path: str, kwargs: dict):
    """from_pretrained, with what a user can hand in (a pickle, a folder that does not load, a hub
    id that is not there) said in one line."""
    from transformers import AutoModelForCausalLM

    from .multimodal import language_model_of_checkpoint

    try:
        text_model = language_model_of_checkpoint(path, kwargs)  # a vision-language checkpoint's
        return text_model if text_model is not None else AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except pickle.UnpicklingError:
        raise ModelError(
            f"--model {name}: a weights file ({', '.join(pickled_weights(path)) or '*.bin'}) holds a "
            f"pickle that is not plain tensors, so it was not loaded (it could run code). Use the model's "
            f"*.safetensors files, or convert a copy you trust to safetensors."
        ) from None
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise ModelError(
                f"--model {name}: needs its own Python code; pass --trust-remote-code if you trust it."
            ) from None
        raise _hub_error(name, exc) from None
    except (EOFError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        if not Path(path).is_dir():
            raise
        raise ModelError(
            f"--model {name}: its files do not load as a model ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no detail'}); a file is cut short or its "
            f"config.json does not match its weights. Copy or download the model again."
        ) from None


def process_gpu() -> str | None:
    """This process's GPU (LOCAL_RANK's with several processes), None without CUDA."""
    import torch

    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else None


def _weigh_load_balancing(model, weight: float) -> None:
    """A mixture of experts computes its routers' load-balancing loss (logged as aux_loss) and
    adds it to the loss with `weight` (model.router_aux_loss_coef)."""
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = weight
    model.router_aux_loss_coef = weight  # read by the model's forward


def nf4_config(precision: Precision):
    """4-bit NormalFloat with double quantization; compute in the training precision."""
    import torch
    from transformers import BitsAndBytesConfig

    compute = precision.torch_dtype if precision.name != "fp32" else torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
    )
