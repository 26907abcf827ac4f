"""Adapter -> merged Hugging Face folder for serving (transformers, vLLM), checked before it is kept.

The adapter is always merged onto the 16-bit (or fp32) base, never into 4-bit weights, also when
it was trained with QLoRA. The merge runs in the run's own training precision unless told
otherwise, so that a CPU (fp32) run is merged and checked in fp32. The merged folder is written
to a staging folder and renamed only after the checks pass: merged weights finite, no LoRA layer left, and the merged model's logits equal
the base+adapter model's on a few prompts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ModelArgs
from ..errors import CheckpointError, LoraLabError
from ..log import quiet_library_progress
from ..models.load import LoadOptions, Precision, load_base_model, load_tokenizer
from ..paths import pickled_files, staged_folder
from ..run_folder import RunFolder, base_model_of, find_adapter, training_precision
from ..run_folder.names import ADAPTER_CONFIG, MERGE_REPORT
from .checks import CHECK_PROMPTS, check_prompt_batch, top1_agreement


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
    lora_rank: int | None
    target_modules: list
    trained_with_quantization: str
    dtype_source: str = "--dtype"
    """Why the merge ran in `dtype`: --dtype, the run's training precision, or the default."""
    adapter_kind: str = "lora"
    """lora, dora, experts or ia3, from adapter_config.json (adapter_kind_of): what vLLM can serve."""

    def summary(self) -> str:
        """What was merged, and the check with the rule that applied in this precision."""
        return (
            f"merged {self.adapter_dir} onto {self.base_model} ({self.dtype}: "
            f"{self.dtype_source})\ncheck ({check_rule(self.dtype)}): passed; max |logit "
            f"difference| base+adapter vs merged = {self.max_abs_logit_diff:.3g}; same next "
            f"token at {self.top1_agreement:.1%} of confident positions\nwrote "
            f"{self.output_dir}"
        )

    def lines(self, served_name: str = "finetuned") -> list[str]:
        """What `lora-lab merge` and the page print: the summary, a QLoRA note, the `vllm serve`
        commands (served as `served_name`) and a `warning:` line for each thing vLLM cannot load."""
        from ..planning.serving import vllm_commands

        note = (
            [
                f"note: trained with {self.trained_with_quantization} QLoRA; merged onto "
                f"the 16-bit base, not into 4-bit weights."
            ]
            if self.trained_with_quantization != "none"
            else []
        )
        serving = vllm_commands(self, served_name)
        commands = [f"  {kind + ':':<9}{command}" for kind, command in serving["commands"].items()]
        return [
            self.summary(),
            *note,
            "",
            "serve with vLLM:",
            *commands,
            *(f"warning: {w}" for w in serving["warnings"]),
        ]


@quiet_library_progress()
def merge_adapter(
    path: str | Path, *, output: str | Path | None = None, dtype: str | None = None, force: bool = False
) -> MergeResult:
    """Merge a run's (or adapter folder's) LoRA weights into its base model and save the result.

    dtype None: the precision the run trained in (fp32 for a CPU run), bf16 where no run folder
    records one."""
    adapter_dir, run_dir = find_adapter(path)
    output = Path(output) if output else RunFolder(run_dir or adapter_dir.parent).merged
    if output.exists() and not force:  # said before torch is even imported
        raise CheckpointError(
            f"--output {output}: the folder already exists. Pass --force to replace it, or choose another --output."
        )
    dtype, dtype_source = choose_merge_dtype(dtype, run_dir)
    import torch
    from peft import PeftModel

    base_args = base_model_of(adapter_dir, run_dir)
    trained_quantization = base_args.quantization
    base = load_base_model(
        ModelArgs(name=base_args.name, trust_remote_code=base_args.trust_remote_code),
        Precision(name=dtype),
        LoadOptions(for_training=False),
    )
    tokenizer = load_tokenizer(str(adapter_dir))
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    batch = check_prompt_batch(tokenizer, model.device)
    with torch.no_grad():
        reference = model(**batch).logits.float()
        merged = model.merge_and_unload().eval()
        logits = merged(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    diff = float((reference - logits).abs().max())
    agreement = top1_agreement(reference, logits, mask)
    _check_merged(merged, diff, agreement, dtype)

    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    result = MergeResult(
        output_dir=output,
        base_model=base_args.name,
        adapter_dir=adapter_dir,
        dtype=dtype,
        max_abs_logit_diff=diff,
        top1_agreement=agreement,
        lora_rank=adapter_config.get("r"),
        target_modules=sorted(adapter_config["target_modules"]),
        trained_with_quantization=trained_quantization,
        dtype_source=dtype_source,
        adapter_kind=adapter_kind_of(adapter_config),
    )
    _save_merged(merged, tokenizer, result)
    return result


def _save_merged(merged, tokenizer, result: MergeResult) -> None:
    """The merged model, its tokenizer and merge_report.json, put in place in one step; the
    model stops where the trained one does: the template's end-of-turn token, the tokenizer's eos
    and generation_config's (modelfile.stop_ids)."""
    from .modelfile import stop_ids

    merged.generation_config.eos_token_id = stop_ids(tokenizer, merged)
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    with staged_folder(result.output_dir) as staging:
        merged.save_pretrained(staging, safe_serialization=True, max_shard_size="2GB")
        tokenizer.save_pretrained(staging)
        report = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
        report["checks"] = {
            "weights_finite": True,
            "lora_layers_left": 0,
            "rule": check_rule(result.dtype),
            "check_prompts": CHECK_PROMPTS,
        }
        (staging / MERGE_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if pickled_files(staging):
            raise LoraLabError(f"internal: pickled files in the merged folder: {pickled_files(staging)}")


# fp32: the merged model must compute what base+adapter computes, to rounding. In bf16/fp16
# both sides round differently (the unmerged 16-bit model is itself logits away from fp32, and
# near-ties flip), so there the check is that both predict the same next token wherever
# base+adapter is confident.
MAX_FP32_LOGIT_DIFF = 1e-3
MIN_16BIT_TOP1_AGREEMENT = 0.95


def adapter_kind_of(adapter_config: dict) -> str:
    """lora, dora (a LoRA config with use_dora), experts (a LoRA on fused expert tensors too:
    target_parameters) or ia3, from an adapter_config.json."""
    if adapter_config.get("peft_type") == "IA3":
        return "ia3"
    if adapter_config.get("use_dora"):
        return "dora"
    return "experts" if adapter_config.get("target_parameters") else "lora"


def choose_merge_dtype(requested: str | None, run_dir: Path | None) -> tuple[str, str]:
    """(dtype, why): --dtype when given, else the run's training precision, else bf16."""
    if requested:
        return requested, "--dtype"
    trained = training_precision(run_dir) if run_dir is not None else None
    if trained:
        return trained, "the run's training precision"
    why = (
        "the run folder does not record its training precision"
        if run_dir is not None
        else "no run folder records the training precision"
    )
    return "bf16", f"default: {why}; --dtype fp32 merges in full precision"


def check_rule(dtype: str) -> str:
    """The check a merge in `dtype` must pass, in words (printed and kept in merge_report.json)."""
    if dtype == "fp32":
        return f"fp32 rule: max |logit difference| <= {MAX_FP32_LOGIT_DIFF:g}"
    return (
        f"{dtype} rule: same next token at >= {MIN_16BIT_TOP1_AGREEMENT:.0%} of confident "
        f"positions; 16-bit logit differences are reported, not bounded"
    )


def _check_merged(model, diff: float, agreement: float, dtype: str) -> None:
    import torch

    left = [name for name, _ in model.named_modules() if "lora_" in name or "ia3_" in name]
    if left:
        raise LoraLabError(f"merge left LoRA layers behind: {left[:3]}")
    for name, param in model.state_dict().items():
        if not torch.isfinite(param).all():
            raise CheckpointError(
                f"merged weight {name} is not finite; the adapter is broken (was the run stopped by a NaN loss?)."
            )
    if dtype == "fp32" and diff > MAX_FP32_LOGIT_DIFF:
        raise CheckpointError(
            f"the merged model's logits differ from base+adapter by {diff:.3g} "
            f"(allowed {MAX_FP32_LOGIT_DIFF} in fp32)."
        )
    if dtype != "fp32" and agreement < MIN_16BIT_TOP1_AGREEMENT:
        raise CheckpointError(
            f"the merged model predicts a different next token than "
            f"base+adapter at {1 - agreement:.0%} of the positions where "
            f"base+adapter is confident; try "
            f"--dtype fp32."
        )
