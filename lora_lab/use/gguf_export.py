"""Merged model (or run) -> GGUF for llama.cpp and Ollama, with a Modelfile, checked by llama.cpp.

Nothing here writes GGUF itself: llama.cpp's own convert_hf_to_gguf.py (with its gguf-py) turns
the merged 16-bit folder into an f16 GGUF that carries the tokenizer, its chat template
(tokenizer.chat_template) and the eos token; llama.cpp's llama_model_quantize (through the
llama-cpp-python binding) makes q8_0 and q4_k_m from it. The converter is taken from the source
of the installed llama-cpp-python, so the llama.cpp that writes the file is the one that checks it.

The file is written into `<output>.partial`, loaded back by llama.cpp and kept only when its
tokenizer encodes the check prompts to the ids the source tokenizer gives, every end-of-turn token
ends generation there, and its logits are finite; the share of confident check positions where it
predicts the 16-bit model's next token is reported.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, LoraLabError, ModelError
from ..log import get_logger
from ..paths import cache_dir, human_bytes, staged_folder
from ..run_folder import RunFolder, load_saved_config
from .checks import CHECK_PROMPTS, MIN_TOP1_AGREEMENT, check_prompt_batch, reference_logits
from .export_common import (
    DEFAULT_CALIB_SAMPLES,
    Exporter,
    ExportLines,
    library_versions,
    problems_error,
    run_export,
    weights_bytes,
)
from .modelfile import end_of_turn_tokens, write_modelfile

log = get_logger()

GGUF_NAME = "model.gguf"
LLAMA_CPP_HINT = (
    "pip install 'lora-lab[gguf]' (builds llama.cpp from source, several minutes; "
    "`make llama-cpp` builds it once into ~/.cache/lora-lab/wheels)"
)
LLAMA_CPP_ENV = "LORA_LAB_LLAMA_CPP"
"""A llama.cpp source folder whose convert_hf_to_gguf.py to use instead of the one in the
installed llama-cpp-python's source."""
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
PINNED_SOURCES = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
"""sha256 of the llama-cpp-python source (sdist) whose converter lora-lab runs, by version (the
version setup.cfg's extra gguf pins). Nothing is downloaded at export time."""
GGUF_TYPES = {"f16": None, "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
"""--format gguf --quantize TYPE -> llama.cpp's file type (None: the converter's f16 as is)."""


@dataclass
class GgufExportResult(ExportLines):
    output_dir: Path
    gguf_file: Path
    quantize: str
    source: str
    run_dir: str | None
    gguf_bytes: int
    source_weights_bytes: int
    top1_agreement: float
    """Share of the check positions where the 16-bit source is confident (top-1 >= 0.5) at which
    llama.cpp, on the written file, predicts the same next token."""
    max_abs_logit_diff: float
    end_of_turn_tokens: list
    chat_template: bool
    seconds: float
    converter: str
    versions: dict
    format: str = "gguf"
    warnings: list = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"wrote {self.gguf_file} (GGUF {self.quantize}): {human_bytes(self.gguf_bytes)}, "
            f"from {human_bytes(self.source_weights_bytes)} of safetensors; llama.cpp predicts "
            f"the 16-bit model's next token at {self.top1_agreement:.1%} of confident check "
            f"positions; stops at {', '.join(self.end_of_turn_tokens)}; {self.seconds:.0f} s"
        )

    def serving_lines(self) -> list[str]:
        folder = Path(self.output_dir)
        return [
            "serve with llama.cpp or Ollama:",
            f"  llama-server -m {self.gguf_file} --jinja",
            f"  cd {folder} && ollama create finetuned -f Modelfile && ollama run finetuned",
        ]


def check_gguf_arguments(
    quantize: str | None, calib_data=(), calib_samples: int | None = None, gpu_tier: str | None = None
) -> str:
    """--quantize for --format gguf (None: f16), and the export flags that do not apply to it."""
    quantize = quantize or "f16"
    problems = []
    if quantize not in GGUF_TYPES:
        problems.append(
            f"--format gguf --quantize {quantize}: not a GGUF type; choose one of "
            f"{', '.join(GGUF_TYPES)} (nf4, w4a16 and awq are --format safetensors)."
        )
    if calib_data or calib_samples not in (None, DEFAULT_CALIB_SAMPLES):
        problems.append(
            "--calib-data/--calib-samples: llama.cpp quantizes GGUF types from the "
            "weights alone; drop them with --format gguf."
        )
    if gpu_tier:
        problems.append(f"--gpu {gpu_tier}: the vLLM plan is for --format safetensors; drop --gpu with --format gguf.")
    if problems:
        raise problems_error(problems)
    return quantize


class GgufExporter(Exporter):
    """A GGUF type (GGUF_TYPES) for run_export: the file, its Modelfile, llama.cpp's checks."""

    def __init__(self, quantize: str):
        self.quantize, self.name, self.converter = quantize, f"gguf-{quantize}", Path()

    def prepare(self) -> None:
        self.converter = locate_converter()

    def write(self, source: Path, staging: Path, scratch: Path, run_dir: Path | None) -> GgufExportResult:
        return _export(source, staging, scratch, self.converter, self.quantize)

    def finish(self, staging: Path, result, source: Path, run_dir: Path | None) -> None:
        result.gguf_file = result.output_dir / GGUF_NAME
        system = load_saved_config(RunFolder(run_dir).config).data.system if run_dir else None
        _write_side_files(staging, source, system)


def export_gguf(
    path: str | Path,
    *,
    quantize: str | None = "f16",
    output: str | Path | None = None,
    force: bool = False,
    merge_dtype: str | None = None,
) -> GgufExportResult:
    """A merged folder, or a run folder (merged onto its 16-bit base first, in the run's training
    precision unless merge_dtype says otherwise), as a GGUF with an Ollama Modelfile."""
    quantize = check_gguf_arguments(quantize)
    _require_llama_cpp()
    return run_export(path, output, force, merge_dtype, GgufExporter(quantize))


def _require_llama_cpp() -> None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise LoraLabError(
            f"--format gguf needs llama.cpp's Python binding (llama-cpp-python), "
            f"which is not installed: {LLAMA_CPP_HINT}."
        )


def _export(source: Path, staging: Path, scratch: Path, converter: Path, quantize: str) -> GgufExportResult:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    target = staging / GGUF_NAME
    f16 = target if quantize == "f16" else scratch.with_name(scratch.name + ".f16.gguf")
    stages = 2 if quantize == "f16" else 3
    try:
        log.info(f"GGUF 1/{stages}: converting {source} to f16 with llama.cpp's convert_hf_to_gguf.py")
        convert_to_gguf(converter, source, f16)
        if quantize != "f16":
            log.info(f"GGUF 2/{stages}: quantizing the f16 file to {quantize} (llama.cpp llama_model_quantize)")
            quantize_gguf(f16, target, quantize)
    finally:
        if f16 != target:
            f16.unlink(missing_ok=True)
    log.info(
        f"GGUF {stages}/{stages}: checking {GGUF_NAME} with llama.cpp: chat template, "
        f"end-of-turn tokens, and the tokens and logits of {len(CHECK_PROMPTS)} check "
        f"prompts against the 16-bit model"
    )
    eos_ids = _generation_eos_ids(source)
    stops = end_of_turn_tokens(tokenizer, eos_ids)
    metadata = check_gguf_metadata(target, tokenizer, stops)
    batch = check_prompt_batch(tokenizer, "cpu")
    reference = reference_logits(source, batch, dtype="auto")
    diff, agreement = check_gguf_logits(target, tokenizer, batch, reference)
    warnings = [caveat] if (caveat := rope_caveat(json.loads((source / "config.json").read_text()))) else []
    if agreement < MIN_TOP1_AGREEMENT:
        warnings.append(
            f"llama.cpp on the {quantize} file predicts the 16-bit model's next token "
            f"at only {agreement:.0%} of the confident check positions; check its "
            f"answers before serving it."
        )
    return GgufExportResult(
        output_dir=staging,
        gguf_file=target,
        quantize=quantize,
        source=str(source),
        run_dir=None,
        gguf_bytes=target.stat().st_size,
        source_weights_bytes=weights_bytes(source),
        top1_agreement=agreement,
        max_abs_logit_diff=diff,
        end_of_turn_tokens=stops,
        chat_template=metadata["chat_template"],
        seconds=0.0,
        converter=str(converter),
        versions=gguf_versions(),
        warnings=warnings,
    )


def rope_caveat(config: dict) -> str | None:
    """What llama.cpp's rope cannot follow in `config` (a config.json, or its text_config): YaRN
    whose correction range is not rounded to whole dimensions (rope_parameters.truncate false,
    gpt-oss's). llama.cpp always rounds it and a GGUF has no key that says otherwise, so the
    file's positions drift from transformers' rope, the more the longer the context."""
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    rope: dict = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn" and rope.get("truncate") is False:
        return (
            "this model's YaRN rope does not round its correction range (rope_parameters.truncate false); "
            "llama.cpp always rounds it, so the GGUF's logits drift from the 16-bit model's with the length "
            "of the context. Serve it with transformers or vLLM where long contexts matter."
        )
    return None


def _generation_eos_ids(source: Path) -> list[int]:
    path = source / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# ------------------------------------------------------------------ llama.cpp: convert, quantize


def locate_converter() -> Path:
    """convert_hf_to_gguf.py: from $LORA_LAB_LLAMA_CPP, else from the source (sdist) of the
    installed llama-cpp-python, checked against its pinned sha256 and unpacked once into the
    cache. The sdist is never fetched here: the error says how to put it in the cache."""
    if os.environ.get(LLAMA_CPP_ENV):
        script = Path(os.environ[LLAMA_CPP_ENV]) / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise LoraLabError(
                f"{LLAMA_CPP_ENV}={os.environ[LLAMA_CPP_ENV]}: no "
                f"convert_hf_to_gguf.py there; point it at a llama.cpp source "
                f"folder, or unset it."
            )
        return script
    version = importlib.metadata.version("llama_cpp_python")
    folder = cache_dir() / "llama.cpp" / version
    if not (folder / "convert_hf_to_gguf.py").is_file():
        _unpack_converter(_llama_cpp_sdist(version), folder)
    return folder / "convert_hf_to_gguf.py"


def _llama_cpp_sdist(version: str) -> Path:
    """The cached sdist of llama-cpp-python `version`, whole and as pinned."""
    wheels = cache_dir() / "wheels"
    sdist = wheels / f"llama_cpp_python-{version}.tar.gz"
    fetch = f"`make llama-cpp`, or: pip download --no-deps --no-binary :all: llama-cpp-python=={version} -d {wheels}"
    if version not in PINNED_SOURCES:
        raise LoraLabError(
            f"llama-cpp-python {version} is not the version lora-lab's GGUF export was checked with "
            f"({', '.join(PINNED_SOURCES)}): pip install 'lora-lab[gguf]', or set {LLAMA_CPP_ENV} to a "
            f"llama.cpp source folder you trust."
        )
    if not sdist.is_file():
        raise LoraLabError(
            f"the GGUF export needs llama.cpp's converter from the llama-cpp-python {version} source, "
            f"which is not in {wheels}; get it once with {fetch} (or set {LLAMA_CPP_ENV} to a llama.cpp "
            f"source folder)."
        )
    digest = hashlib.sha256()
    with open(sdist, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != PINNED_SOURCES[version]:
        raise LoraLabError(
            f"{sdist}: its sha256 is not the pinned one of llama-cpp-python {version}; nothing was run. "
            f"Delete it and get it again with {fetch}."
        )
    return sdist


def _unpack_converter(sdist: Path, folder: Path) -> None:
    prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
    with tarfile.open(sdist) as archive, staged_folder(folder) as staging:
        members = [
            m
            for m in archive.getmembers()
            if m.name.startswith(prefix)
            and m.name[len(prefix) :].startswith(CONVERTER_FILES)
            and (m.isfile() or m.isdir())
        ]
        for member in members:
            member.name = member.name[len(prefix) :]
        archive.extractall(staging, members=members, filter="data")
        (staging / "SOURCE.md").write_text(
            f"llama.cpp's HF-to-GGUF converter and its gguf-py (MIT, LICENSE), unpacked from "
            f"{sdist.name} (vendor/llama.cpp) by lora-lab.\n"
        )


class Milestones:
    """Progress of `total` items said in a few lines: at each quarter done."""

    def __init__(self, total: int, say):
        self.total, self.say, self.done = total, say, 0
        self.marks = {-(-total * k // 4) for k in range(1, 5)} if total else set()

    def step(self, done: int | None = None) -> None:
        self.done = self.done + 1 if done is None else done
        if self.done in self.marks:
            self.marks.discard(self.done)
            self.say(self.done, self.total)


CONVERTED_TENSOR = re.compile(r"^INFO:hf-to-gguf:[\w.]+,\s+\S+ --> \w+, shape")
WRITTEN_FILE = re.compile(r"n_tensors = (\d+), total_size = (\S+)")


def source_tensor_names(source: Path) -> list[str]:
    """The tensors of a folder's safetensors files (their headers only)."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names += handle.keys()
    return names


MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
"""Families whose checkpoints carry a multi-token-prediction block (`mtp.*`) that llama.cpp's
converter writes as draft layers; transformers does not load it, so a merged folder has none."""


def _drops_mtp(converter: Path, source: Path, tensors: list[str]) -> bool:
    """Whether to convert with --no-mtp: an MTP family's folder without `mtp.*` tensors (the
    converter would otherwise count draft layers it cannot find), where the converter knows the
    flag."""
    config = json.loads((source / "config.json").read_text())
    types = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
    if not types & set(MTP_MODEL_TYPES) or "--no-mtp" not in converter.read_text():
        return False
    return not any(name.startswith(("mtp.", "model.mtp.")) for name in tensors)


def convert_to_gguf(converter: Path, source: Path, target: Path) -> None:
    """llama.cpp's converter in a process of its own; its log is read as it runs and said as a
    few progress lines (tensors converted, the file written), its last lines kept for an
    error."""
    started = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=6)
    names = source_tensor_names(source)
    progress = Milestones(
        len(names), lambda done, total: log.info(f"  convert_hf_to_gguf.py: {done}/{total} tensors converted")
    )
    options = ["--no-mtp"] if _drops_mtp(converter, source, names) else []
    process = subprocess.Popen(
        [sys.executable, str(converter), str(source), "--outfile", str(target), "--outtype", "f16", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert process.stdout is not None  # stdout=PIPE
    for line in process.stdout:  # text mode: tqdm's carriage returns end lines too
        line = line.strip()
        if not line:
            continue
        tail.append(line)
        if CONVERTED_TENSOR.match(line):
            progress.step()
        elif written := WRITTEN_FILE.search(line):
            tensors, size = written.groups()
            log.info(f"  convert_hf_to_gguf.py: writing {tensors} tensors ({size}B) to {target}")
    if process.wait() != 0 or not target.is_file():
        raise ModelError(f"llama.cpp's convert_hf_to_gguf.py failed on {source}:\n" + "\n".join(tail))
    log.info(f"  convert_hf_to_gguf.py: done in {time.monotonic() - started:.0f} s")


QUANTIZED_TENSOR = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")


def quantize_gguf(f16: Path, target: Path, quantize: str) -> None:
    """llama_model_quantize, its per-tensor log said as a few progress lines (tensor i/n)."""
    import ctypes

    import llama_cpp
    from llama_cpp import _logger

    started = time.monotonic()
    sizes: list[str] = []
    progress: list[Milestones] = []

    @llama_cpp.llama_log_callback
    def read_log(level, text, user_data):
        line = text.decode("utf-8", errors="replace").strip()
        found = QUANTIZED_TENSOR.match(line)
        if found:
            done, total = map(int, found.groups())
            if not progress:  # the first tensor's line names the count
                progress.append(
                    Milestones(total, lambda done, total: log.info(f"  llama_model_quantize: {done}/{total} tensors"))
                )
            progress[0].step(done)
        elif "size  =" in line and line.startswith("llama_model_quantize"):
            sizes.append(line.split("=", 1)[1].strip())

    params = llama_cpp.llama_model_quantize_default_params()
    file_type = GGUF_TYPES[quantize]
    assert file_type is not None  # f16 is the converter's output, never quantized here
    params.ftype = getattr(llama_cpp, file_type)
    params.nthread = os.cpu_count() or 1
    llama_cpp.llama_log_set(read_log, ctypes.c_void_p(0))
    try:
        status = llama_cpp.llama_model_quantize(str(f16).encode(), str(target).encode(), ctypes.byref(params))
    finally:  # llama-cpp-python's own logger again
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if status != 0 or not target.is_file():
        raise ModelError(f"llama.cpp could not quantize {f16} to {quantize} (status {status}).")
    shown = f" ({' -> '.join(sizes)})" if len(sizes) == 2 else ""
    log.info(f"  llama_model_quantize: done in {time.monotonic() - started:.0f} s{shown}")


# ------------------------------------------------------------------------- llama.cpp: checks


def load_llama(gguf: Path, n_ctx: int = 512, logits_all: bool = False):
    """llama.cpp's model of a GGUF file; a file it cannot open is said in one line."""
    from llama_cpp import Llama

    try:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, logits_all=logits_all, verbose=False, seed=0)
    except ValueError as exc:
        raise ModelError(
            f"{gguf}: llama.cpp cannot open this GGUF file ({exc}); it is cut short, not a GGUF model, or of an "
            "architecture this llama.cpp does not know. Export it again with `lora-lab export RUN --format gguf`."
        ) from None


def check_gguf_metadata(gguf: Path, tokenizer, stops: list[str]) -> dict:
    """The file's chat template is the tokenizer's, and llama.cpp ends generation at every
    end-of-turn token (its end-of-generation tokens include them)."""
    import llama_cpp

    llm = load_llama(gguf)
    template = llm.metadata.get("tokenizer.chat_template")
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = tokenizer.convert_tokens_to_ids(stops)
    not_eog = [t for t, i in zip(stops, ids) if not llama_cpp.llama_vocab_is_eog(vocab, i)]
    eos = int(llm.metadata.get("tokenizer.ggml.eos_token_id", -1))
    del llm
    if template != tokenizer.chat_template:
        raise ModelError(
            f"{gguf}: the GGUF's tokenizer.chat_template is not the tokenizer's "
            f"chat template ({'missing' if template is None else 'different'})."
        )
    if not_eog or eos not in ids:
        raise ModelError(
            f"{gguf}: llama.cpp would not stop at {', '.join(not_eog) or 'eos'} "
            f"(end-of-turn tokens {stops}, GGUF eos id {eos})."
        )
    return {"chat_template": True, "eos_token_id": eos}


def check_gguf_logits(gguf: Path, tokenizer, batch, reference) -> tuple[float, float]:
    """llama.cpp's logits on the check prompts, from the source tokenizer's ids (which its own
    tokenizer must reproduce), against the source's: (max |difference|, top-1 agreement)."""
    import numpy as np
    import torch

    from .checks import top1_agreement

    mask = batch["attention_mask"].bool()
    llm = load_llama(gguf, n_ctx=int(mask.sum(-1).max()) + 8, logits_all=True)
    logits = torch.full_like(reference, float("nan"))
    for row, (ids, keep) in enumerate(zip(batch["input_ids"], mask)):
        ids = ids[keep].tolist()
        text = tokenizer.decode(ids).encode()
        if llm.tokenize(text, add_bos=False, special=True) != ids:
            raise ModelError(
                f"{gguf}: llama.cpp's tokenizer encodes the check prompt "
                f"{CHECK_PROMPTS[row]!r} differently from the source tokenizer."
            )
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
        logits[row, keep] = torch.from_numpy(scores[:, : reference.shape[-1]])
    del llm
    if not torch.isfinite(logits[mask]).all():
        raise CheckpointError(
            "llama.cpp gives non-finite logits on the check prompts for the GGUF file, so it was not kept."
        )
    diff = float((reference - logits)[mask].abs().max())
    return diff, top1_agreement(reference, torch.nan_to_num(logits), mask)


# ----------------------------------------------------------------------------- side files


def _write_side_files(staging: Path, source: Path, system: str | None) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    write_modelfile(staging, tokenizer, GGUF_NAME, system, _generation_eos_ids(source))
    for name in ("LICENSE", "NOTICE"):
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)


def gguf_versions() -> dict:
    return library_versions(("llama_cpp_python", "gguf", "torch", "transformers", "lora-lab"))
