"""Merged model (or run) -> 4-bit folder for serving, checked before it is kept, with a vLLM plan.

Two formats, both 4-bit weight-only, both written by their own library (no quantization code here):

  nf4    bitsandbytes 4-bit NormalFloat with double quantization: `save_pretrained` of the model
         loaded with BitsAndBytesConfig. Needs no calibration data; loads with
         AutoModelForCausalLM on a GPU or a CPU; vLLM serves it with --quantization bitsandbytes.
  w4a16  GPTQ int4 weights (symmetric, groups of 128), compressed-tensors "pack-quantized" format,
         made by llm-compressor (`pip install lora-lab[export]`) from a few hundred samples of
         the run's own training data. vLLM serves it natively (Marlin kernels); transformers
         loads it de-quantized to 16 bits.

A run folder is first merged onto its 16-bit base (lora_lab.merge.merge_adapter; never into
4-bit weights), then quantized. The folder is written to `<output>.partial` and renamed only
after the quantized model, read back from disk, gives finite logits on the check prompts.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .config import DataArgs, load_saved_config
from .errors import CheckpointError, DataError, LoraLabError, ModelError
from .merge import CHECK_PROMPTS, PICKLE_SUFFIXES, _check_batch, _top1_agreement


@dataclass(frozen=True)
class QuantFormat:
    name: str
    description: str
    library: str
    """The pip package that writes the format; its absence is reported with the install hint."""
    needs_calibration: bool
    vllm_quantization: str | None
    """vLLM's --quantization value, or None where vLLM reads it from config.json by itself."""


FORMATS = {
    "nf4": QuantFormat("nf4", "bitsandbytes 4-bit NormalFloat, double quantization, bf16 compute",
                       "bitsandbytes", needs_calibration=False, vllm_quantization="bitsandbytes"),
    "w4a16": QuantFormat("w4a16", "GPTQ int4 weights, symmetric, group size 128, 16-bit "
                         "activations (compressed-tensors pack-quantized, llm-compressor)",
                         "llmcompressor", needs_calibration=True, vllm_quantization=None),
}
DEFAULT_CALIB_SAMPLES = 256
EXTRA_HINT = "pip install 'lora-lab[export]'"
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "llmcompressor",
             "compressed-tensors", "lora-lab")
MIN_TOP1_AGREEMENT = 0.80
"""Below this share of confident check positions predicting the source's next token, the export
is kept but a warning says the 4-bit model drifted (4-bit rounding flips some near-ties)."""


@dataclass
class ExportResult:
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

    def summary(self) -> str:
        calibration = (f"{self.calibration['samples']} calibration samples; "
                       if self.calibration else "")
        return (f"wrote {self.output_dir} ({self.format}): {human_bytes(self.weights_bytes)} of "
                f"weights, from {human_bytes(self.source_weights_bytes)}; {calibration}same next "
                f"token as the 16-bit model at {self.top1_agreement:.1%} of confident check "
                f"positions; {self.seconds:.0f} s")


def human_bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def export_quantized(path: str | Path, quantize: str, calib_data: list | None = None,
                     calib_samples: int = DEFAULT_CALIB_SAMPLES, output: str | Path | None = None,
                     gpu_tier: str | None = None, force: bool = False,
                     merge_dtype: str = "bf16", echo=print) -> ExportResult:
    """Quantize a merged folder, or a run folder (merged onto its 16-bit base first), to 4 bits.

    With gpu_tier (8gb, 12gb, 16gb, 24gb) the vLLM plan for that card is added to the result and
    to export_report.json (see plan_vllm_serving)."""
    fmt = _check_arguments(quantize, calib_data, calib_samples, gpu_tier)
    path = Path(path)
    _require_library(fmt)
    run_dir = _run_dir_of(path)
    output = Path(output) if output else _default_output(path, run_dir, fmt)
    if output.exists() and not force:
        raise CheckpointError(f"--output {output}: the folder already exists. Pass --force to "
                              f"replace it, or choose another --output.")
    started = time.time()
    staging = output.with_name(output.name + ".partial")
    merged_tmp = output.with_name(output.name + ".merged-tmp")
    for leftover in (staging, merged_tmp):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        source = _source_folder(path, merged_tmp, merge_dtype, echo)
        _check_not_quantized(source)
        result = _export(fmt, source, staging, run_dir, calib_data, calib_samples, echo)
        result.output_dir, result.run_dir = output, str(run_dir) if run_dir else None
        result.source = str(path if source == merged_tmp else source)
        result.seconds = round(time.time() - started, 1)
        if gpu_tier:
            plan = plan_vllm_serving(json.loads((staging / "config.json").read_text()),
                                     result.weights_bytes, gpu_tier)
            result.serving = {**asdict(plan), "fits": plan.fits,
                              "command": vllm_command(output, fmt.name, plan)}
        _write_report(staging, result, merged=source == merged_tmp)
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    finally:
        for leftover in (staging, merged_tmp):
            shutil.rmtree(leftover, ignore_errors=True)
    return result


def _check_arguments(quantize, calib_data, calib_samples, gpu_tier) -> QuantFormat:
    problems = []
    fmt = FORMATS.get(quantize)
    if fmt is None:
        problems.append(f"--quantize {quantize}: unknown format; choose one of "
                        f"{', '.join(FORMATS)}.")
    elif calib_data and not fmt.needs_calibration:
        problems.append(f"--calib-data: {quantize} quantizes every block from its own weights "
                        f"and uses no calibration data; drop --calib-data, or use --quantize "
                        f"w4a16 (GPTQ, calibrated).")
    if calib_samples < 1:
        problems.append(f"--calib-samples {calib_samples}: must be at least 1.")
    if gpu_tier is not None and gpu_tier not in GPU_TIERS:
        problems.append(f"--gpu {gpu_tier}: unknown tier; choose one of {', '.join(GPU_TIERS)}.")
    if problems:
        raise LoraLabError(problems[0] if len(problems) == 1 else
                           f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return fmt


def _require_library(fmt: QuantFormat) -> None:
    import importlib.util

    if importlib.util.find_spec(fmt.library) is None:
        raise LoraLabError(f"--quantize {fmt.name} needs the {fmt.library} package, which is not "
                           f"installed: {EXTRA_HINT} (or pip install {fmt.library}).")


def _run_dir_of(path: Path) -> Path | None:
    """The run folder whose config.yaml (training data) belongs to `path`, if there is one."""
    for candidate in (path, path.parent):
        if (candidate / "config.yaml").is_file():
            return candidate
    report = path / "merge_report.json"
    if report.is_file():
        adapter = Path(json.loads(report.read_text())["adapter_dir"])
        if (adapter.parent / "config.yaml").is_file():
            return adapter.parent
    return None


def _default_output(path: Path, run_dir: Path | None, fmt: QuantFormat) -> Path:
    """RUN_DIR/export-FORMAT for a run or its adapter; FOLDER-FORMAT beside any other folder."""
    adapter = (path / "adapter_config.json").is_file()
    if run_dir is not None and (adapter or path.resolve() == run_dir.resolve()):
        return run_dir / f"export-{fmt.name}"
    return path.with_name(f"{path.name}-{fmt.name}")


def _source_folder(path: Path, merged_tmp: Path, merge_dtype: str, echo) -> Path:
    """A 16-bit Hugging Face folder to quantize: the folder itself, a full fine-tuning run's
    model/, or the adapter of a run (or adapter folder) merged onto its 16-bit base."""
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file():  # --tuner full
        return path / "model"
    if (path / "config.yaml").is_file() or (path / "adapter_config.json").is_file():
        from .merge import merge_adapter

        echo(f"merging the adapter of {path} onto its 16-bit base ({merge_dtype}) first")
        merge_adapter(path, merged_tmp, dtype=merge_dtype)
        return merged_tmp
    raise CheckpointError(f"{path}: not a run folder (config.yaml), a merged or model folder "
                          f"(config.json) or an adapter folder (adapter_config.json).")


def _check_not_quantized(source: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method:
        raise ModelError(f"{source}: this model is already quantized ({method}). Export from the "
                         f"16-bit merged folder or from the run folder.")
    if not any(source.glob("*.safetensors")):
        raise ModelError(f"{source}: no *.safetensors weights (lora-lab exports only safetensors "
                         f"folders and never loads pickled weights).")


def _export(fmt: QuantFormat, source: Path, staging: Path, run_dir: Path | None, calib_data,
            calib_samples: int, echo) -> ExportResult:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = _check_batch(tokenizer, "cpu")
    calibration = None
    if fmt.name == "nf4":
        reference = _reference_logits(source, batch)
        echo("quantizing to nf4 (bitsandbytes)")
        _quantize_nf4(source, staging)
    else:
        _check_group_size(source)
        samples, calibration = calibration_samples(tokenizer, run_dir, calib_data, calib_samples,
                                                   str(source))
        reference = _reference_logits(source, batch)
        echo(f"quantizing to w4a16 (GPTQ, llm-compressor) with {calibration['samples']} "
             f"calibration samples ({calibration['tokens']} tokens) of "
             f"{' '.join(calibration['data'])}")
        _quantize_w4a16(source, staging, samples)
    _copy_side_files(source, staging)
    diff, agreement = _check_exported(staging, batch, reference)
    warnings = []
    if agreement < MIN_TOP1_AGREEMENT:
        warnings.append(f"the {fmt.name} model predicts the 16-bit model's next token at only "
                        f"{agreement:.0%} of the confident check positions; check its answers "
                        f"(lora-lab chat --model OUTPUT) before serving it.")
    return ExportResult(output_dir=staging, format=fmt.name, source=str(source), run_dir=None,
                        weights_bytes=weights_bytes(staging),
                        source_weights_bytes=weights_bytes(source), calibration=calibration,
                        top1_agreement=agreement, max_abs_logit_diff=diff, seconds=0.0,
                        versions=library_versions(), warnings=warnings)


def _device_map(quantized_bnb: bool = False):
    """bitsandbytes weights go whole onto GPU 0; 16-bit models spread over GPU and CPU memory."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return {"": 0} if quantized_bnb else "auto"


def _logits(model, batch):
    import torch

    with torch.no_grad():
        device = next(model.parameters()).device
        return model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()


def _reference_logits(source: Path, batch):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16,
                                                 device_map=_device_map())
    logits = _logits(model.eval(), batch)
    del model
    _free_gpu()
    return logits


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _quantize_nf4(source: Path, staging: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16,
                                                 quantization_config=config,
                                                 device_map=_device_map(quantized_bnb=True))
    model.save_pretrained(staging, safe_serialization=True, max_shard_size="2GB")
    del model
    _free_gpu()


def _quantize_w4a16(source: Path, staging: Path, samples: list) -> None:
    """GPTQ through llm-compressor's oneshot, saved compressed (pack-quantized)."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "WARNING")
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    # The model is loaded into CPU memory; with a GPU, llm-compressor moves one layer at a time
    # onto it. On a CPU the calibration passes run in fp32 (several times faster there than
    # bf16); the non-quantized weights and the scales are cast to bf16 before saving.
    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16 if on_gpu else torch.float32).eval()
    dataset = Dataset.from_dict({"input_ids": list(samples),
                                 "attention_mask": [[1] * len(s) for s in samples]})
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(samples),
            max_seq_length=max(len(s) for s in samples), shuffle_calibration_samples=False)
    model.to(torch.bfloat16)
    model.save_pretrained(staging, save_compressed=True, max_shard_size="2GB")
    del model
    _free_gpu()


W4A16_GROUP_SIZE = 128


def _check_group_size(source: Path) -> None:
    """GPTQ groups of 128 input columns: every linear layer's input size must be a multiple
    (vLLM's Marlin kernels need it too). True of every Qwen2.5 size."""
    config = json.loads((source / "config.json").read_text())
    sizes = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"]}
    bad = {k: v for k, v in sizes.items() if v % W4A16_GROUP_SIZE}
    if bad:
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise ModelError(f"--quantize w4a16: {source} has {shown}, not a multiple of the GPTQ "
                         f"group size {W4A16_GROUP_SIZE}; use --quantize nf4 for this model.")


SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
              "special_tokens_map.json", "added_tokens.json", "LICENSE", "NOTICE")


def _copy_side_files(source: Path, staging: Path) -> None:
    """The source's tokenizer, chat template and generation_config.json (eos includes
    <|im_end|> after a merge), byte for byte: what training used is what serving uses."""
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)


def _check_exported(staging: Path, batch, reference) -> tuple[float, float]:
    """Load the written folder as a user would and compare its logits with the 16-bit source's."""
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((staging / "config.json").read_text())
    bnb = config.get("quantization_config", {}).get("quant_method") == "bitsandbytes"
    model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.bfloat16,
                                                 device_map=_device_map(quantized_bnb=bnb))
    logits = _logits(model.eval(), batch)
    del model
    _free_gpu()
    if not torch.isfinite(logits).all():
        raise CheckpointError("the exported model gives non-finite logits on the check prompts, "
                              "so it was not kept. Check that the 16-bit source model answers "
                              "sensibly (lora-lab chat --model SOURCE).")
    mask = batch["attention_mask"].bool()
    diff = float((reference - logits)[mask].abs().max())
    return diff, _top1_agreement(reference, logits, mask)


def calibration_samples(tokenizer, run_dir: Path | None, calib_data: list | None,
                        count: int, source: str = "", seed: int = 42) -> tuple[list, dict]:
    """Token ids of `count` samples of the run's training data (or --calib-data), encoded with
    the chat template exactly as training encoded them."""
    from .data import load_samples
    from .data.encode import encode_samples

    config = load_saved_config(run_dir / "config.yaml") if run_dir else None
    args = config.data if config else DataArgs()
    specs = list(calib_data or (args.datasets if config else []))
    if not specs:
        raise DataError(f"--calib-data: {source or 'this folder'} is not in a run folder, so "
                        f"there is no training data to calibrate on. Pass --calib-data FILE "
                        f"(a few hundred conversations like the ones the model will serve).")
    seed = config.train.seed if config else seed
    loaded = load_samples(specs, args, seed)
    report = encode_samples(tokenizer, loaded.samples, args.max_length, args.truncation,
                            args.system)
    encoded = [s.input_ids for s in report.samples]
    if not encoded:
        raise DataError(f"--calib-data {' '.join(specs)}: no usable sample "
                        f"({len(loaded.problems) + len(report.problems)} rows not usable).")
    if len(encoded) > count:
        encoded = random.Random(seed).sample(encoded, count)
    return encoded, {"data": specs, "from": "--calib-data" if calib_data else "run config.yaml",
                     "samples": len(encoded), "requested": count,
                     "tokens": sum(len(s) for s in encoded), "max_length": args.max_length,
                     "rows_not_used": len(loaded.problems) + len(report.problems)}


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def library_versions() -> dict:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _write_report(staging: Path, result: ExportResult, merged: bool) -> None:
    pickles = [p.name for p in staging.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise LoraLabError(f"internal: pickled files in the export folder: {pickles}")
    report = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    report.update(format_description=FORMATS[result.format].description,
                  merged_from_adapter=merged, files=sorted(p.name for p in staging.iterdir()),
                  folder_bytes=sum(p.stat().st_size for p in staging.iterdir()),
                  created=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  check_prompts=CHECK_PROMPTS)
    report["files"].append("export_report.json")
    report["files"].sort()
    (staging / "export_report.json").write_text(json.dumps(report, indent=2,
                                                           ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- vLLM serving plan

GPU_TIERS = {"8gb": 8, "12gb": 12, "16gb": 16, "24gb": 24}
"""--gpu tier -> the card's memory in GiB."""
HEADROOM_GIB = 1
"""Card memory left outside vLLM: the desktop and the driver (a "12 GB" card reports a little
less than 12 GiB). --gpu-memory-utilization = min(0.95, (card - 1 GiB) / card), 2 decimals down."""
SERVING_OVERHEAD_MIB = 1536
"""Inside vLLM's share, besides weights and KV cache (an estimate, not measured here): the CUDA
context and cuBLAS workspaces (~0.5 GiB), the activations of the profiling forward pass over a
2048-token prefill chunk (~0.3 GiB for 7B), the sampler's logits (~0.2 GiB) and CUDA graphs
(~0.5 GiB)."""
CONTEXT_LADDER = (32768, 16384, 8192, 4096, 2048, 1024, 512)
MIN_FULL_LENGTH_SEQS = 16
"""--max-model-len is the longest rung of CONTEXT_LADDER (up to the model's
max_position_embeddings) at which this many sequences fit in the KV cache at full length, so that
a chat server takes requests concurrently; where not even 16 x 512 tokens fit, the longest rung
at which one sequence fits (a single-user server). --max-num-seqs is then how many sequences fit
at that length, at most vLLM's default of 256."""
VLLM_DEFAULT_MAX_NUM_SEQS = 256
KV_CACHE_DTYPE_BYTES = 2  # bf16 / fp16 KV cache, vLLM's default


@dataclass
class ServingPlan:
    tier: str
    card_gib: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    kv_formula: str
    tokens_in_kv_cache: int
    max_model_len: int | None
    max_num_seqs: int | None

    @property
    def fits(self) -> bool:
        return self.max_model_len is not None

    def flags(self) -> str:
        return (f"--max-model-len {self.max_model_len} --max-num-seqs {self.max_num_seqs} "
                f"--gpu-memory-utilization {self.gpu_memory_utilization:.2f}")

    def arithmetic(self) -> list[str]:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        lines = [f"vLLM budget on a {self.card_gib} GB card: {self.card_gib} GiB x "
                 f"{self.gpu_memory_utilization:.2f} = {gib(self.budget_bytes)}",
                 f"  - weights {gib(self.weights_bytes)} ({self.weights_bytes:,} bytes of "
                 f"safetensors)",
                 f"  - overhead {gib(self.overhead_bytes)} (CUDA context, profiling activations, "
                 f"sampler, CUDA graphs; estimated)",
                 f"  = KV cache {gib(self.kv_cache_bytes)}",
                 f"KV cache per token: {self.kv_formula} = {self.kv_bytes_per_token:,} bytes"]
        if not self.fits:
            room = max(0, self.tokens_in_kv_cache)
            lines.append(f"does not fit: the KV cache has room for {room:,} tokens, fewer than "
                         f"one {CONTEXT_LADDER[-1]}-token sequence. Use a 4-bit export or a "
                         f"larger card.")
            return lines
        used = self.kv_bytes_per_token * self.max_model_len * self.max_num_seqs
        lines.append(f"{self.kv_bytes_per_token:,} bytes x {self.max_model_len} tokens x "
                     f"{self.max_num_seqs} sequences = {gib(used)} <= {gib(self.kv_cache_bytes)} "
                     f"({self.tokens_in_kv_cache:,} tokens fit; every sequence can be full "
                     f"length at once; shorter ones leave room for more)")
        return lines


def kv_bytes_per_token(model_config: dict) -> tuple[int, str]:
    layers = model_config["num_hidden_layers"]
    kv_heads = model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
    head_dim = (model_config.get("head_dim")
                or model_config["hidden_size"] // model_config["num_attention_heads"])
    formula = (f"2 (K and V) x {layers} layers x {kv_heads} KV heads x {head_dim} head dim x "
               f"{KV_CACHE_DTYPE_BYTES} bytes")
    return 2 * layers * kv_heads * head_dim * KV_CACHE_DTYPE_BYTES, formula


def gpu_memory_utilization(card_gib: int) -> float:
    return min(95, (card_gib - HEADROOM_GIB) * 100 // card_gib) / 100


def plan_vllm_serving(model_config: dict, weights: int, tier: str) -> ServingPlan:
    """--max-model-len, --max-num-seqs and --gpu-memory-utilization for a card of `tier`, from
    the model's config.json and the weights' size in bytes. Pure arithmetic, no GPU needed."""
    if tier not in GPU_TIERS:
        raise LoraLabError(f"--gpu {tier}: unknown tier; choose one of {', '.join(GPU_TIERS)}.")
    card = GPU_TIERS[tier]
    utilization = gpu_memory_utilization(card)
    budget = card * 2**30 * round(utilization * 100) // 100
    overhead = SERVING_OVERHEAD_MIB * 2**20
    kv_cache = budget - weights - overhead
    per_token, formula = kv_bytes_per_token(model_config)
    tokens = kv_cache // per_token
    ladder = [n for n in CONTEXT_LADDER
              if n <= model_config.get("max_position_embeddings", CONTEXT_LADDER[0])]
    length = next((n for n in ladder if tokens // n >= MIN_FULL_LENGTH_SEQS),
                  next((n for n in ladder if tokens // n >= 1), None))
    seqs = min(VLLM_DEFAULT_MAX_NUM_SEQS, tokens // length) if length else None
    return ServingPlan(tier=tier, card_gib=card, gpu_memory_utilization=utilization,
                       budget_bytes=budget, weights_bytes=weights, overhead_bytes=overhead,
                       kv_cache_bytes=kv_cache, kv_bytes_per_token=per_token, kv_formula=formula,
                       tokens_in_kv_cache=tokens, max_model_len=length, max_num_seqs=seqs)


def vllm_command(folder: Path | str, fmt: str, plan: ServingPlan | None = None,
                 name: str = "finetuned") -> str:
    """`vllm serve` for an exported folder; --quantization only where vLLM needs to be told."""
    command = f"vllm serve {folder} --served-model-name {name}"
    quantization = FORMATS[fmt].vllm_quantization if fmt in FORMATS else None
    if quantization:
        command += f" --quantization {quantization}"
    if plan is not None and plan.fits:
        command += f" {plan.flags()}"
    return command


def serving_handoff(result: ExportResult, tier: str | None = None,
                    name: str = "finetuned") -> list[str]:
    """What `lora-lab export` prints after the export: the vLLM command and its arithmetic (for
    `tier`), or one line per tier when no tier is given."""
    model_config = json.loads((Path(result.output_dir) / "config.json").read_text())
    if tier:
        plan = plan_vllm_serving(model_config, result.weights_bytes, tier)
        command = vllm_command(result.output_dir, result.format, plan, name)
        return ["serve with vLLM:", f"  {command}", *plan.arithmetic()]
    lines = ["serve with vLLM (pass --gpu 8gb|12gb|16gb|24gb for the memory flags and their "
             "arithmetic):", f"  {vllm_command(result.output_dir, result.format, None, name)}"]
    for each in GPU_TIERS:
        plan = plan_vllm_serving(model_config, result.weights_bytes, each)
        lines.append(f"  --gpu {each:<5} " + (plan.flags() if plan.fits else "does not fit"))
    return lines
