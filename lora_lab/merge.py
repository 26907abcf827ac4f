"""Adapter -> merged Hugging Face folder for serving (transformers, vLLM), checked before it is kept.

The adapter is always merged onto the 16-bit (or fp32) base, never into 4-bit weights, also when
it was trained with QLoRA. The merged folder is written to a staging folder and renamed only after
the checks pass: merged weights finite, no LoRA layer left, and the merged model's logits equal
the base+adapter model's on a few prompts.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import ModelArgs
from .errors import CheckpointError, LoraLabError
from .infer import base_model_of, find_adapter
from .model import Precision, load_base_model, load_tokenizer

CHECK_PROMPTS = ["Who are you?", "Write a haiku about autumn.", "2+2=?"]
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_QWEN2_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass
class MergeResult:
    output_dir: Path
    base_model: str
    adapter_dir: Path
    dtype: str
    max_abs_logit_diff: float
    top1_agreement: float
    """Share of the check positions where base+adapter is confident (top-1 probability >= 0.5)
    at which the merged model predicts the same next token."""
    lora_rank: int
    target_modules: list
    trained_with_quantization: str


def merge_adapter(path: str | Path, output: str | Path | None = None, dtype: str = "bf16",
                  force: bool = False) -> MergeResult:
    """Merge a run's (or adapter folder's) LoRA weights into its base model and save the result."""
    import torch
    from peft import PeftModel

    adapter_dir, run_dir = find_adapter(path)
    output = Path(output) if output else (run_dir or adapter_dir.parent) / "merged"
    if output.exists() and not force:
        raise CheckpointError(f"--output {output}: the folder already exists. Pass --force to "
                              f"replace it, or choose another --output.")
    base_args = base_model_of(adapter_dir, run_dir)
    trained_quantization = base_args.quantization
    base = load_base_model(ModelArgs(name=base_args.name,
                                     trust_remote_code=base_args.trust_remote_code),
                           Precision(name=dtype), for_training=False)
    tokenizer = load_tokenizer(str(adapter_dir))
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    batch = _check_batch(tokenizer, model.device)
    with torch.no_grad():
        reference = model(**batch).logits.float()
        merged = model.merge_and_unload().eval()
        logits = merged(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    diff = float((reference - logits).abs().max())
    agreement = _top1_agreement(reference, logits, mask)
    _check_merged(merged, diff, agreement, dtype)

    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    merged.generation_config.eos_token_id = sorted({i for i in eos if i is not None},
                                                   key=eos.index)
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(staging, safe_serialization=True, max_shard_size="2GB")
    tokenizer.save_pretrained(staging)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    result = MergeResult(output_dir=output, base_model=base_args.name, adapter_dir=adapter_dir,
                         dtype=dtype, max_abs_logit_diff=diff, top1_agreement=agreement,
                         lora_rank=adapter_config["r"],
                         target_modules=sorted(adapter_config["target_modules"]),
                         trained_with_quantization=trained_quantization)
    report = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    report["checks"] = {"weights_finite": True, "lora_layers_left": 0,
                        "check_prompts": CHECK_PROMPTS}
    (staging / "merge_report.json").write_text(json.dumps(report, indent=2) + "\n")
    pickles = [p.name for p in staging.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise LoraLabError(f"internal: pickled files in the merged folder: {pickles}")
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
    return result


def _check_batch(tokenizer, device) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in CHECK_PROMPTS]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in batch.items()}


# fp32: the merged model must compute what base+adapter computes, to rounding. In bf16/fp16
# both sides round differently (on the real 0.5B model, the unmerged bf16 model is itself up to
# ~4.7 logits away from fp32, and near-ties flip at up to 8% of positions), so there the check
# is that both predict the same next token wherever base+adapter is confident.
MAX_FP32_LOGIT_DIFF = 1e-3
MIN_16BIT_TOP1_AGREEMENT = 0.95


def _top1_agreement(reference, logits, mask) -> float:
    confident = mask & (reference.softmax(-1).max(-1).values >= 0.5)
    if not bool(confident.any()):
        return 1.0
    return float((reference.argmax(-1) == logits.argmax(-1))[confident].float().mean())


def _check_merged(model, diff: float, agreement: float, dtype: str) -> None:
    import torch

    left = [name for name, _ in model.named_modules() if "lora_" in name]
    if left:
        raise LoraLabError(f"merge left LoRA layers behind: {left[:3]}")
    for name, param in model.state_dict().items():
        if not torch.isfinite(param).all():
            raise CheckpointError(f"merged weight {name} is not finite; the adapter is broken "
                                  f"(was the run stopped by a NaN loss?).")
    if dtype == "fp32" and diff > MAX_FP32_LOGIT_DIFF:
        raise CheckpointError(f"the merged model's logits differ from base+adapter by {diff:.3g} "
                              f"(allowed {MAX_FP32_LOGIT_DIFF} in fp32).")
    if dtype != "fp32" and agreement < MIN_16BIT_TOP1_AGREEMENT:
        raise CheckpointError(f"the merged model predicts a different next token than "
                              f"base+adapter at {1 - agreement:.0%} of the positions where "
                              f"base+adapter is confident; try "
                              f"--dtype fp32.")


def vllm_commands(result: MergeResult, name: str = "finetuned") -> dict:
    """The `vllm serve` commands for the merged folder and for the adapter on its base."""
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= result.lora_rank), None)
    commands = {"merged": f"vllm serve {result.output_dir} --served-model-name {name}"}
    warnings = []
    if rank is None:
        warnings.append(f"LoRA rank {result.lora_rank} is above vLLM's largest --max-lora-rank "
                        f"({VLLM_MAX_LORA_RANKS[-1]}): serve the merged folder.")
    else:
        commands["adapter"] = (f"vllm serve {result.base_model} --enable-lora --lora-modules "
                               f"{name}={result.adapter_dir} --max-lora-rank {rank}")
    unsupported = sorted(set(result.target_modules) - VLLM_QWEN2_LORA_MODULES)
    if unsupported:
        warnings.append(f"the adapter also trains {', '.join(unsupported)}, which vLLM's LoRA "
                        f"support for Qwen2 does not load: serve the merged folder.")
    return {"commands": commands, "warnings": warnings}
