"""The one skeleton every export runs through, and the one entry point that picks the format.

`export_model` is what `lora-lab export` and the web page call. Whatever the format, an export:
takes a run folder, an adapter folder or a merged 16-bit folder; writes to --output (default
RUN_DIR/export-NAME, or FOLDER-NAME beside any other folder), refusing an existing one without
--force; merges an adapter onto its 16-bit base into `<output>.merged-tmp` first (removed
afterwards); writes into a staging folder renamed only once the format's checks pass; and
records export_report.json. A format (Exporter) supplies only what differs: its name, the files
it writes and checks, and what it adds to the folder and the report.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from ..errors import CheckpointError, LoraLabError, ModelError
from ..log import get_logger, quiet_library_progress
from ..paths import installed_versions, pickled_files, staged_folder
from ..run_folder import RunFolder, is_adapter_folder, owning_run_dir
from ..run_folder.names import ADAPTER_CONFIG, CONFIG_FILE, EXPORT_REPORT, MERGED_SCRATCH_SUFFIX, MODEL_CONFIG
from .checks import CHECK_PROMPTS

log = get_logger()

DEFAULT_CALIB_SAMPLES = 256
EXPORT_FORMATS = ("safetensors", "gguf")
"""--format: safetensors (use/export.py, 4-bit for vLLM) or gguf (use/gguf_export.py)."""


class Exporter:
    """One export format: what the skeleton (run_export) asks of it."""

    name: str
    """The output folder's suffix (export-NAME)."""

    def prepare(self) -> None:
        """What the format needs before any work, once the output folder is known to be free."""

    def write(self, source: Path, staging: Path, scratch: Path, run_dir: Path | None):
        """Write and check the format's files from the 16-bit folder `source` into `staging`
        (`scratch`: a path beside the output for temporary files); return its result."""
        raise NotImplementedError

    def finish(self, staging: Path, result, source: Path, run_dir: Path | None) -> None:
        """Anything the format adds once the result knows its final folder."""

    def report_extra(self, result) -> dict:
        """Keys the format adds to export_report.json."""
        return {}


class ExportLines:
    """What `lora-lab export` and the page print after an export (a result mixin)."""

    warnings: list

    def summary(self) -> str:
        raise NotImplementedError

    def serving_lines(self) -> list[str]:
        raise NotImplementedError

    def lines(self) -> list[str]:
        """The summary, a `warning:` line per warning, a blank line, how to serve the export."""
        return [self.summary(), *(f"warning: {w}" for w in self.warnings), "", *self.serving_lines()]


def export_model(
    path: str | Path,
    *,
    format: str = "safetensors",
    quantize: str | None = None,
    calib_data: Iterable[str] = (),
    calib_samples: int | None = None,
    output: str | Path | None = None,
    gpu_tier: str | None = None,
    force: bool = False,
):
    """Export a merged folder, or a run (merged onto its 16-bit base first), for serving: 4-bit
    safetensors for vLLM (export.export_quantized) or GGUF for llama.cpp and Ollama
    (gguf_export.export_gguf). The result's lines() say what was written and how to serve it."""
    if format == "gguf":
        from .gguf_export import check_gguf_arguments, export_gguf

        quantize = check_gguf_arguments(quantize, list(calib_data), calib_samples, gpu_tier)
        return export_gguf(path, quantize=quantize, output=output, force=force)
    if format != "safetensors":
        raise LoraLabError(f"--format {format}: choose one of {', '.join(EXPORT_FORMATS)}.")
    from .export import export_quantized

    return export_quantized(
        path,
        quantize=quantize or "",
        calib_data=list(calib_data),
        calib_samples=DEFAULT_CALIB_SAMPLES if calib_samples is None else calib_samples,
        output=output,
        gpu_tier=gpu_tier,
        force=force,
    )


@quiet_library_progress()
def run_export(path: str | Path, output: str | Path | None, force: bool, merge_dtype: str | None, exporter: Exporter):
    """The export skeleton: output folder, --force, the merged scratch folder, staging, the
    result's paths and time, export_report.json."""
    path = Path(path)
    run_dir = owning_run_dir(path)
    output = Path(output) if output else default_output(path, run_dir, exporter.name)
    if output.exists() and not force:
        raise CheckpointError(
            f"--output {output}: the folder already exists. Pass --force to replace it, or choose another --output."
        )
    exporter.prepare()
    started = time.time()
    scratch = output.with_name(output.name + MERGED_SCRATCH_SUFFIX)
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        with staged_folder(output) as staging:
            source = source_folder(path, scratch, merge_dtype)
            check_not_quantized(source)
            result = exporter.write(source, staging, scratch, run_dir)
            result.output_dir, result.run_dir = output, str(run_dir) if run_dir else None
            result.source = str(path if source == scratch else source)
            exporter.finish(staging, result, source, run_dir)
            result.seconds = round(time.time() - started, 1)
            write_report(staging, result, merged=source == scratch, extra=exporter.report_extra(result))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def problems_error(problems: list[str]) -> LoraLabError:
    """Every argument problem in one message."""
    if len(problems) == 1:
        return LoraLabError(problems[0])
    return LoraLabError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))


def default_output(path: Path, run_dir: Path | None, name: str) -> Path:
    """RUN_DIR/export-NAME for a run or its adapter; FOLDER-NAME beside any other folder."""
    adapter = is_adapter_folder(path)
    if run_dir is not None and (adapter or path.resolve() == run_dir.resolve()):
        return RunFolder(run_dir).export(name)
    return path.with_name(f"{path.name}-{name}")


def source_folder(path: Path, merged_tmp: Path, merge_dtype: str | None) -> Path:
    """A 16-bit Hugging Face folder to export: the folder itself, a full fine-tuning run's
    model/, or the adapter of a run (or adapter folder) merged onto its 16-bit base."""
    if (path / MODEL_CONFIG).is_file():
        return path
    if (RunFolder(path).model / MODEL_CONFIG).is_file():  # --tuner full
        return RunFolder(path).model
    if RunFolder(path).is_run or is_adapter_folder(path):
        from .merge import merge_adapter

        how = merge_dtype or "the run's training precision"
        log.info(f"merging the adapter of {path} onto its 16-bit base ({how}) first")
        merge_adapter(path, output=merged_tmp, dtype=merge_dtype)
        return merged_tmp
    raise CheckpointError(
        f"{path}: not a run folder ({CONFIG_FILE}), a merged or model folder "
        f"(config.json) or an adapter folder ({ADAPTER_CONFIG})."
    )


def check_not_quantized(source: Path) -> None:
    config = json.loads((source / MODEL_CONFIG).read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method:
        raise ModelError(
            f"{source}: this model is already quantized ({method}). Export from the "
            f"16-bit merged folder or from the run folder."
        )
    if not any(source.glob("*.safetensors")):
        raise ModelError(
            f"{source}: no *.safetensors weights (lora-lab exports only safetensors "
            f"folders and never loads pickled weights)."
        )


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def library_versions(names: Iterable[str]) -> dict:
    """The installed version of each package (None where it is not installed)."""
    return installed_versions(names)


def write_report(staging: Path, result, merged: bool, extra: dict) -> None:
    """export_report.json: the result, the format's extra keys, the folder's files and when."""
    pickles = pickled_files(staging)
    if pickles:
        raise LoraLabError(f"internal: pickled files in the export folder: {pickles}")
    report = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    report.update(
        extra,
        merged_from_adapter=merged,
        files=sorted([p.name for p in staging.iterdir()] + [EXPORT_REPORT]),
        folder_bytes=sum(p.stat().st_size for p in staging.iterdir()),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        check_prompts=CHECK_PROMPTS,
    )
    (staging / EXPORT_REPORT).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
