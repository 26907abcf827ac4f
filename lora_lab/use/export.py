"""Merged model (or run) -> 4-bit folder for serving, checked before it is kept, with a vLLM plan.

Three formats, all 4-bit weight-only, each written by its own library (no quantization code here):

  nf4    bitsandbytes 4-bit NormalFloat with double quantization: `save_pretrained` of the model
         loaded with BitsAndBytesConfig. Needs no calibration data; loads with
         AutoModelForCausalLM on a GPU or a CPU; vLLM serves it with --quantization bitsandbytes.
  w4a16  GPTQ int4 weights (symmetric, groups of 128), compressed-tensors "pack-quantized" format,
         made by llm-compressor (`pip install lora-lab[export]`) from a few hundred samples of
         the run's own training data. vLLM serves it natively (Marlin kernels); transformers
         loads it de-quantized to 16 bits.
  awq    AWQ (activation-aware scaling of each layer's input channels, searched on the same
         calibration samples), then int4 weights of the same scheme and format as w4a16, both by
         llm-compressor: vLLM and transformers load it exactly as they load w4a16.

A run folder is first merged onto its 16-bit base (use/merge.py; never into
4-bit weights), then quantized. The folder is written to `<output>.partial` and renamed only
after the quantized model, read back from disk, gives finite logits on the check prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import DataArgs
from ..device import inference_device_map, release_memory
from ..errors import DataError, LoraLabError, ModelError
from ..log import get_logger
from ..models.load import Precision, nf4_config
from ..paths import human_bytes, installed_versions
from ..planning.memory import TIERS_GIB
from ..planning.serving import plan_vllm_serving, vllm_command
from ..run_folder import RunFolder, load_saved_config
from ..run_folder.names import CONFIG_FILE
from .checks import CHECK_PROMPTS, MIN_TOP1_AGREEMENT, check_exported_folder, check_prompt_batch, reference_logits
from .export_common import DEFAULT_CALIB_SAMPLES, Exporter, ExportLines, problems_error, run_export, weights_bytes
from .gguf_export import GGUF_TYPES

log = get_logger()


@dataclass(frozen=True)
class QuantFormat:
    name: str
    description: str
    library: str
    """The pip package that writes the format; its absence is reported with the install hint."""
    needs_calibration: bool
    vllm_quantization: str | None
    """vLLM's --quantization value, or None where vLLM reads it from config.json by itself."""
    method: str = ""
    """The calibrated algorithm, as the stage lines name it (GPTQ, AWQ)."""
    recipe: Callable[[], list] | None = None
    """llm-compressor's modifiers for a calibrated format (run by oneshot, saved compressed)."""


# Both calibrated formats quantize every Linear but lm_head to int4, symmetric, groups of 128
# input columns: the scheme vLLM's Marlin kernels serve and transformers reads back (transformers
# builds the zero points of an asymmetric scheme unpacked and refuses the packed ones saved).
LLMCOMPRESSOR_SCHEME = "W4A16"


def gptq_recipe() -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(targets="Linear", scheme=LLMCOMPRESSOR_SCHEME, ignore=["lm_head"])]


def awq_recipe() -> list:
    """AWQ's scaling of each block's input channels (llm-compressor's mappings for the model
    type), then round-to-nearest int4 of the scaled weights, as llm-compressor's AWQ examples do."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    return [AWQModifier(), QuantizationModifier(targets="Linear", scheme=LLMCOMPRESSOR_SCHEME, ignore=["lm_head"])]


FORMATS = {
    "nf4": QuantFormat(
        "nf4",
        "bitsandbytes 4-bit NormalFloat, double quantization, bf16 compute",
        "bitsandbytes",
        needs_calibration=False,
        vllm_quantization="bitsandbytes",
    ),
    "w4a16": QuantFormat(
        "w4a16",
        "GPTQ int4 weights, symmetric, group size 128, 16-bit "
        "activations (compressed-tensors pack-quantized, llm-compressor)",
        "llmcompressor",
        needs_calibration=True,
        vllm_quantization=None,
        method="GPTQ",
        recipe=gptq_recipe,
    ),
    "awq": QuantFormat(
        "awq",
        "AWQ-scaled int4 weights, symmetric, group size 128, 16-bit "
        "activations (compressed-tensors pack-quantized, llm-compressor)",
        "llmcompressor",
        needs_calibration=True,
        vllm_quantization=None,
        method="AWQ",
        recipe=awq_recipe,
    ),
}
EXTRA_HINT = "pip install 'lora-lab[export]'"
LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "llmcompressor",
    "compressed-tensors",
    "lora-lab",
)


@dataclass
class ExportResult(ExportLines):
    output_dir: Path
    format: str
    source: str
    """What was quantized: the merged 16-bit folder (a temporary one for a run folder)."""
    run_dir: str | None
    weights_bytes: int
    """Bytes of the *.safetensors files written (what vLLM loads)."""
    source_weights_bytes: int
    calibration: dict | None
    top1_agreement: float
    """Share of the check positions where the 16-bit source is confident (top-1 >= 0.5) at which
    the exported model, read back from disk, predicts the same next token."""
    max_abs_logit_diff: float
    seconds: float
    versions: dict
    warnings: list = field(default_factory=list)
    serving: dict | None = None
    """The vLLM plan for --gpu TIER (plan_vllm_serving), with its command."""
    vllm_problems: list | None = None
    """What vLLM's loader rules (use/vllm_rules) refuse in the compressed-tensors config.json:
    [] where vLLM loads it as WNA16; None for a format they do not cover (nf4)."""

    def summary(self) -> str:
        calibration = f"{self.calibration['samples']} calibration samples; " if self.calibration else ""
        return (
            f"wrote {self.output_dir} ({self.format}): {human_bytes(self.weights_bytes)} of "
            f"weights, from {human_bytes(self.source_weights_bytes)}; {calibration}same next "
            f"token as the 16-bit model at {self.top1_agreement:.1%} of confident check "
            f"positions; {self.seconds:.0f} s"
        )

    def serving_lines(self) -> list[str]:
        return serving_handoff(self, self.serving["tier"] if self.serving else None)


class QuantizedExporter(Exporter):
    """The 4-bit safetensors formats (FORMATS) for run_export."""

    def __init__(self, fmt: QuantFormat, calib_data: list | None, calib_samples: int, gpu_tier: str | None):
        self.fmt, self.name = fmt, fmt.name
        self.calib_data, self.calib_samples, self.gpu_tier = calib_data, calib_samples, gpu_tier

    def write(self, source: Path, staging: Path, scratch: Path, run_dir: Path | None) -> ExportResult:
        return _export(self.fmt, source, staging, run_dir, self.calib_data, self.calib_samples)

    def finish(self, staging: Path, result, source: Path, run_dir: Path | None) -> None:
        config = json.loads((staging / "config.json").read_text())
        if self.fmt.recipe is not None:  # compressed-tensors, which vLLM reads from config.json
            from .vllm_rules import vllm_wna16_problems

            result.vllm_problems = vllm_wna16_problems(config)
            result.warnings.extend(f"vLLM would not load it: {problem}" for problem in result.vllm_problems)
        if self.gpu_tier:
            plan = plan_vllm_serving(config, result.weights_bytes, self.gpu_tier)
            command = vllm_command(result.output_dir, self.fmt.vllm_quantization, plan)
            result.serving = {**asdict(plan), "fits": plan.fits, "command": command}

    def report_extra(self, result) -> dict:
        return {"format_description": self.fmt.description}


def export_quantized(
    path: str | Path,
    *,
    quantize: str,
    calib_data: list | None = None,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    output: str | Path | None = None,
    gpu_tier: str | None = None,
    force: bool = False,
    merge_dtype: str = "bf16",
) -> ExportResult:
    """Quantize a merged folder, or a run folder (merged onto its 16-bit base first), to 4 bits.

    With gpu_tier (8gb, 12gb, 16gb, 24gb) the vLLM plan for that card is added to the result and
    to export_report.json (see plan_vllm_serving)."""
    fmt = _check_arguments(quantize, calib_data, calib_samples, gpu_tier)
    _require_library(fmt)
    return run_export(path, output, force, merge_dtype, QuantizedExporter(fmt, calib_data, calib_samples, gpu_tier))


def _check_arguments(quantize, calib_data, calib_samples, gpu_tier) -> QuantFormat:
    problems = []
    fmt = FORMATS.get(quantize)
    if fmt is None and quantize in GGUF_TYPES:
        problems.append(
            f"--quantize {quantize}: a GGUF type; add --format gguf (the safetensors types are {', '.join(FORMATS)})."
        )
    elif fmt is None:
        problems.append(
            f"--quantize {quantize or '(none)'}: choose one of "
            f"{', '.join(FORMATS)} (or --format gguf with {', '.join(GGUF_TYPES)})."
        )
    elif calib_data and not fmt.needs_calibration:
        problems.append(
            f"--calib-data: {quantize} quantizes every block from its own weights "
            f"and uses no calibration data; drop --calib-data, or use --quantize "
            f"w4a16 or awq (calibrated)."
        )
    if calib_samples < 1:
        problems.append(f"--calib-samples {calib_samples}: must be at least 1.")
    if gpu_tier is not None and gpu_tier not in TIERS_GIB:
        problems.append(f"--gpu {gpu_tier}: unknown tier; choose one of {', '.join(TIERS_GIB)}.")
    if problems:
        raise problems_error(problems)
    assert fmt is not None  # an unknown --quantize is one of the problems above
    return fmt


def _require_library(fmt: QuantFormat) -> None:
    import importlib.util

    if importlib.util.find_spec(fmt.library) is None:
        raise LoraLabError(
            f"--quantize {fmt.name} needs the {fmt.library} package, which is not "
            f"installed: {EXTRA_HINT} (or pip install {fmt.library})."
        )


def _export(
    fmt: QuantFormat, source: Path, staging: Path, run_dir: Path | None, calib_data, calib_samples: int
) -> ExportResult:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = check_prompt_batch(tokenizer, "cpu")
    calibration = None
    if fmt.name == "nf4":
        reference = reference_logits(source, batch)
        log.info(f"export 1/2: quantizing {source} to nf4 (bitsandbytes) and saving it")
        _quantize_nf4(source, staging)
    else:
        _check_group_size(source, fmt)
        samples, calibration = calibration_samples(tokenizer, run_dir, calib_data, calib_samples, str(source))
        reference = reference_logits(source, batch)
        log.info(
            f"export 1/3: quantizing {source} to {fmt.name} ({fmt.method}, llm-compressor), "
            f"calibrating on {calibration['samples']} samples ({calibration['tokens']} "
            f"tokens) of {' '.join(calibration['data'])}, one decoder layer at a time"
        )
        _quantize_compressed(fmt, source, staging, samples)
    _copy_side_files(source, staging)
    stage = "2/2" if fmt.name == "nf4" else "3/3"
    log.info(
        f"export {stage}: checking: the written folder loaded back, its logits on "
        f"{len(CHECK_PROMPTS)} check prompts against the 16-bit model's"
    )
    diff, agreement = check_exported_folder(staging, batch, reference)
    warnings = []
    if agreement < MIN_TOP1_AGREEMENT:
        warnings.append(
            f"the {fmt.name} model predicts the 16-bit model's next token at only "
            f"{agreement:.0%} of the confident check positions; check its answers "
            f"(lora-lab chat --model OUTPUT) before serving it."
        )
    return ExportResult(
        output_dir=staging,
        format=fmt.name,
        source=str(source),
        run_dir=None,
        weights_bytes=weights_bytes(staging),
        source_weights_bytes=weights_bytes(source),
        calibration=calibration,
        top1_agreement=agreement,
        max_abs_logit_diff=diff,
        seconds=0.0,
        versions=library_versions(),
        warnings=warnings,
    )


def _quantize_nf4(source: Path, staging: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = nf4_config(Precision(name="bf16", bf16=True))
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, quantization_config=config, device_map=inference_device_map(quantized_bnb=True)
    )
    model.save_pretrained(staging, safe_serialization=True, max_shard_size="2GB")
    del model
    release_memory()


def _quantize_compressed(fmt: QuantFormat, source: Path, staging: Path, samples: list) -> None:
    """The format's recipe through llm-compressor's oneshot, saved compressed (pack-quantized)."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "WARNING")
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    # The model is loaded into CPU memory; with a GPU, llm-compressor moves one layer at a time
    # onto it. On a CPU the calibration passes run in fp32 (CPUs compute bf16 slowly); the
    # non-quantized weights and the scales are cast to bf16 before saving.
    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16 if on_gpu else torch.float32).eval()
    dataset = Dataset.from_dict({"input_ids": list(samples), "attention_mask": [[1] * len(s) for s in samples]})
    assert fmt.recipe is not None  # the compressed-tensors formats all have one
    recipe = fmt.recipe()
    with quantized_layers_said(model.config.num_hidden_layers), no_pinning_without_accelerator():
        oneshot(
            model=model,
            dataset=dataset,
            recipe=recipe,
            num_calibration_samples=len(samples),
            max_seq_length=max(len(s) for s in samples),
            shuffle_calibration_samples=False,
        )
    log.info(f"export 2/3: saving the compressed (pack-quantized) weights into {staging}")
    model.to(torch.bfloat16)
    model.save_pretrained(staging, save_compressed=True, max_shard_size="2GB")
    del model
    release_memory()


@contextlib.contextmanager
def quantized_layers_said(layers: int):
    """A line as GPTQ quantizes each decoder layer: llm-compressor logs "Quantizing N module(s):
    [names]" (loguru, INFO) per layer, read here by a sink of its own whatever the console's
    LLM_COMPRESSOR_LOG_LEVEL."""
    from loguru import logger

    said = set()

    def sink(message) -> None:
        found = LAYER_NAME.search(message.record["message"])
        if found and int(found.group(1)) not in said:
            said.add(int(found.group(1)))
            log.info(f"  GPTQ: quantizing decoder layer {int(found.group(1)) + 1}/{layers}")

    handler = logger.add(
        sink, level="INFO", format="{message}", filter=lambda record: record["message"].startswith("Quantizing ")
    )
    try:
        yield
    finally:
        logger.remove(handler)


LAYER_NAME = re.compile(r"\blayers\.(\d+)\.")


@contextlib.contextmanager
def no_pinning_without_accelerator():
    """Without a GPU, llm-compressor's cache of layer inputs is not pinned: pinning only speeds
    copies to a GPU, and llm-compressor's AWQ pins that cache unconditionally before each
    smoothing search, which raises "Cannot access accelerator device" on a machine without one."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    pin_memory = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin_memory


W4A16_GROUP_SIZE = 128


def _check_group_size(source: Path, fmt: QuantFormat = FORMATS["w4a16"]) -> None:
    """Int4 groups of 128 input columns: every linear layer's input size must be a multiple
    (vLLM's Marlin kernels need it too). True of every Qwen2.5 size."""
    config = json.loads((source / "config.json").read_text())
    sizes = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"]}
    bad = {k: v for k, v in sizes.items() if v % W4A16_GROUP_SIZE}
    if bad:
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise ModelError(
            f"--quantize {fmt.name}: {source} has {shown}, not a multiple of the "
            f"{fmt.method} group size {W4A16_GROUP_SIZE}; use --quantize nf4 for "
            f"this model."
        )


SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "LICENSE",
    "NOTICE",
)


def _copy_side_files(source: Path, staging: Path) -> None:
    """The source's tokenizer, chat template and generation_config.json (eos includes
    <|im_end|> after a merge), byte for byte: what training used is what serving uses."""
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)


def calibration_samples(
    tokenizer, run_dir: Path | None, calib_data: list | None, count: int, source: str = "", seed: int = 42
) -> tuple[list, dict]:
    """Token ids of `count` samples of the run's training data (or --calib-data), encoded with
    the chat template exactly as training encoded them."""
    from ..data import read_and_encode

    config = load_saved_config(RunFolder(run_dir).config) if run_dir else None
    args = config.data if config else DataArgs()
    specs = list(calib_data or (args.datasets if config else []))
    if not specs:
        raise DataError(
            f"--calib-data: {source or 'this folder'} is not in a run folder, so "
            f"there is no training data to calibrate on. Pass --calib-data FILE "
            f"(a few hundred conversations like the ones the model will serve)."
        )
    seed = config.train.seed if config else seed
    loaded, report = read_and_encode(specs, args, tokenizer, seed)
    encoded = [s.input_ids for s in report.samples]
    if not encoded:
        raise DataError(
            f"--calib-data {' '.join(specs)}: no usable sample "
            f"({len(loaded.problems) + len(report.problems)} rows not usable)."
        )
    if len(encoded) > count:
        encoded = random.Random(seed).sample(encoded, count)
    return encoded, {
        "data": specs,
        "from": "--calib-data" if calib_data else f"run {CONFIG_FILE}",
        "samples": len(encoded),
        "requested": count,
        "tokens": sum(len(s) for s in encoded),
        "max_length": args.max_length,
        "rows_not_used": len(loaded.problems) + len(report.problems),
    }


def library_versions(names=LIBRARIES) -> dict:
    """The installed version of each package (None where it is not installed)."""
    return installed_versions(names)


# ----------------------------------------------------------------------------- vLLM serving plan


def serving_handoff(result: ExportResult, tier: str | None = None, name: str = "finetuned") -> list[str]:
    """What `lora-lab export` prints after the export: the vLLM command and its arithmetic (for
    `tier`), or one line per tier when no tier is given."""
    model_config = json.loads((Path(result.output_dir) / "config.json").read_text())
    quantization = FORMATS[result.format].vllm_quantization
    if tier:
        plan = plan_vllm_serving(model_config, result.weights_bytes, tier)
        command = vllm_command(result.output_dir, quantization, plan, name)
        return ["serve with vLLM:", f"  {command}", *plan.arithmetic()]
    lines = [
        "serve with vLLM (pass --gpu 8gb|12gb|16gb|24gb for the memory flags and their arithmetic):",
        f"  {vllm_command(result.output_dir, quantization, None, name)}",
    ]
    for each in TIERS_GIB:
        plan = plan_vllm_serving(model_config, result.weights_bytes, each)
        lines.append(f"  --gpu {each:<5} " + (plan.flags() if plan.fits else "does not fit"))
    return lines
