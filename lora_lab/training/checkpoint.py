"""Checkpoints that are either complete or invisible, and the checks made before a run resumes.

A checkpoint is written into a staging folder (`.staging-checkpoint-N`), every file is fsynced,
a manifest with the size and sha256 of every file is written last, and only then is the folder
renamed to `checkpoint-N` (atomic on one filesystem). A process killed at any point of a save
leaves either the previous checkpoints alone or a staging folder that nothing resumes from.

    checkpoint-N/manifest.json   {"format": 1, "step": N, "files": {name: {"bytes", "sha256"}},
                                  "train_data": {"samples": n, "sha256": ...}}

Before resuming, a checkpoint's files are checked against its manifest, its pickled state files
(optimizer, scheduler, RNG) are opened with torch.load(weights_only=True), and the run's settings
and training data are compared with the ones it was started with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..config import FLAG_FOR_KEY, RunConfig, flatten
from ..data.arrow import fingerprint_samples
from ..errors import CheckpointError, LoraLabError
from ..log import get_logger
from ..paths import PICKLE_SUFFIXES, REPLACED_PREFIX, file_sha256, fsync, replace_folder
from ..registry import resolve_model_spec
from ..run_folder import RunFolder, checkpoint_step, list_checkpoints, load_saved_config
from ..run_folder.names import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_CONFIG,
    MODEL_WEIGHTS,
    MODEL_WEIGHTS_INDEX,
    OPTIMIZER_FILE,
    RNG_STATE_FILE,
    RNG_STATE_NAME,
    SCHEDULER_FILE,
    STAGING_PREFIX,
    TRAINER_STATE_FILE,
)

log = get_logger()

MANIFEST_NAME = MANIFEST_FILE
MANIFEST_FORMAT = 1
REQUIRED_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG, TRAINER_STATE_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_STATE_FILE)
"""rng_state.pth is rng_state_<rank>.pth when several processes train."""
FULL_REQUIRED_FILES = (MODEL_CONFIG, MODEL_WEIGHTS) + REQUIRED_FILES[2:]
"""--tuner full checkpoints hold the whole model (model.safetensors, or its shards and
model.safetensors.index.json) instead of an adapter."""
DRIFT_KEYS = (
    "model.name",
    "model.quantization",
    "train.tuner",
    "train.gpus",
    "train.nodes",
    "train.engine",
    "lora.rank",
    "lora.alpha",
    "lora.dropout",
    "lora.use_rslora",
    "lora.init",
    "train.loraplus_lr_ratio",
    "train.neftune_noise_alpha",
    "lora.target_modules",
    "data.datasets",
    "data.val_data",
    "data.val_ratio",
    "data.format",
    "data.max_length",
    "data.truncation",
    "data.system",
    "data.enable_thinking",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.seed",
)
"""Settings that change what a step computes: resuming with other values is refused."""

OOM_SOURCE = "out-of-memory retry"
"""config.yaml source of micro_batch_size and grad_accum after an out-of-memory retry."""


# ----------------------------------------------------------------------------- writing


def staging_dir(run_dir: Path, step: int) -> Path:
    return RunFolder(run_dir).staging_checkpoint(step)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def write_manifest(staging: Path, step: int, train_data: dict | None) -> None:
    """fsync every staged file, then record its size and sha256 (the manifest comes last)."""
    files = {}
    for path in _files(staging):
        if path.name == MANIFEST_NAME:
            continue
        fsync(path)
        files[path.relative_to(staging).as_posix()] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    body = {"format": MANIFEST_FORMAT, "step": step, "files": files, "train_data": train_data}
    manifest = staging / MANIFEST_NAME
    manifest.write_text(json.dumps(body, indent=1) + "\n")
    fsync(manifest)
    fsync(staging)


def commit_checkpoint(staging: Path, final: Path) -> Path:
    """Rename a staged checkpoint (manifest written) to its final name, replacing an old one."""
    return replace_folder(staging, final)


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Clean up after a process killed during a save; returns the folders deleted.

    A staging folder whose save finished (manifest written, files intact) but was not renamed
    yet is committed, as is the checkpoint it was replacing if the kill came between the two
    renames; everything else left behind is deleted."""
    leftovers = sorted(
        (p for p in RunFolder(run_dir).hidden_checkpoints() if p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))),
        key=lambda p: not p.name.startswith(STAGING_PREFIX),
    )  # newer first
    deleted = []
    for folder in leftovers:
        final = folder.with_name(folder.name.removeprefix(STAGING_PREFIX).removeprefix(REPLACED_PREFIX))
        if not final.exists() and not checkpoint_problems(folder):
            commit_checkpoint(folder, final)
            continue
        shutil.rmtree(folder)
        deleted.append(folder)
    return deleted


def rotate_checkpoints(run_dir: Path, limit: int | None, newest: Path, keep: tuple = ()) -> list[Path]:
    """Keep `newest` (just committed), anything in `keep` and the next complete checkpoints by
    step up to `limit` in all; delete older complete ones. Incomplete folders are left alone.
    A limit of None (the Trainer's save_total_limit unset) keeps every checkpoint."""
    if limit is None:
        return []
    complete = [c for c in list_checkpoints(run_dir) if (c / MANIFEST_NAME).is_file()]
    protected = {Path(newest).resolve()} | {Path(k).resolve() for k in keep if k}
    kept = [c for c in complete if c.resolve() in protected]
    deleted = []
    # list_checkpoints lists only folders named with a step
    for folder in sorted(complete, key=lambda c: checkpoint_step(c) or 0, reverse=True):
        if folder.resolve() in protected:
            continue
        if len(kept) < limit:
            kept.append(folder)
        else:
            shutil.rmtree(folder)
            deleted.append(folder)
    return deleted


# ----------------------------------------------------------------------------- checking


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST_NAME).read_text())


def checkpoint_problems(folder: Path) -> list[str]:
    """Why `folder` cannot be resumed from (empty when it is complete and intact)."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        return [f"{folder / MANIFEST_NAME} is missing: the save did not finish (or an older lora-lab wrote it)"]
    try:
        files = read_manifest(folder)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{folder / MANIFEST_NAME} is not readable ({exc})"]
    rng_files = [name for name in files if RNG_STATE_NAME.fullmatch(name)]
    required = REQUIRED_FILES if ADAPTER_CONFIG in files or MODEL_CONFIG not in files else FULL_REQUIRED_FILES
    weights_only = (
        " (no optimizer state: a checkpoint saved with train.save_only_model=true "
        "has the weights only, and a run cannot resume from it)"
    )
    problems = [
        f"{folder / name} is missing from the manifest" + (weights_only if name == OPTIMIZER_FILE else "")
        for name in required
        if name not in files
        and not (name == RNG_STATE_FILE and rng_files)
        and not (name == MODEL_WEIGHTS and MODEL_WEIGHTS_INDEX in files)
        and not (name == OPTIMIZER_FILE and _engine_optimizer_state(files))
    ]
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(
                f"{path} is {path.stat().st_size} bytes; the manifest says {entry['bytes']} (truncated or overwritten)"
            )
        elif file_sha256(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 does not match the manifest (corrupt or changed after the save)")
    return problems or unsafe_pickles(folder)


def _engine_optimizer_state(files: dict) -> bool:
    """DeepSpeed (`latest` + global_stepN/) and FSDP (optimizer_0/, optimizer.bin) save the
    optimizer state in their own layout instead of optimizer.pt."""
    return any(name == "latest" or name.startswith(("global_step", "optimizer_0/", "optimizer.bin")) for name in files)


def unsafe_pickles(folder: Path) -> list[str]:
    """Pickled files that torch.load(weights_only=True) refuses: they hold Python objects (code
    could run when they are opened), not just tensors and numbers."""
    import torch

    problems = []
    for path in _files(Path(folder)):
        if path.suffix not in PICKLE_SUFFIXES:
            continue
        try:
            with _numpy_allowed():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            first_line = (str(exc).splitlines() or [""])[0][:120]
            problems.append(
                f"{path} was refused by torch.load(weights_only=True): it holds more "
                f"than tensors ({type(exc).__name__}: {first_line})"
            )
    return problems


def _numpy_allowed():
    """The numpy types an RNG state file legitimately holds (as transformers allows them)."""
    import numpy as np
    import torch

    core = np._core if hasattr(np, "_core") else np.core
    return torch.serialization.safe_globals(
        [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    )


def find_resume_checkpoint(run_dir: Path, quiet: bool = False) -> Path | None:
    """The newest complete checkpoint of a run; every skipped one is reported with its reason."""
    for folder in reversed(list_checkpoints(run_dir)):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder
        if not quiet:
            log.warning(f"warning: not resuming from {folder.name}: {'; '.join(problems)}")
    return None


def resolve_resume(resume: str, run_dir: Path, quiet: bool = False) -> Path | None:
    """--resume auto|RUN_DIR|CHECKPOINT -> the checkpoint to resume from (None: start fresh)."""
    if resume == "auto":
        found = find_resume_checkpoint(run_dir, quiet) if run_dir.is_dir() else None
        if found is None and not quiet:
            log.info(f"--resume auto: no complete checkpoint in {run_dir}; starting a new run.")
        return found
    path = Path(resume).expanduser()
    if checkpoint_step(path) is not None and path.is_dir():
        problems = checkpoint_problems(path)
        if problems:
            raise CheckpointError(
                f"--resume {resume}: cannot resume from this checkpoint:\n  - "
                + "\n  - ".join(problems)
                + "\nPick another checkpoint, or "
                "--resume auto for the newest complete one."
            )
        return path
    if RunFolder(path).is_run:
        found = find_resume_checkpoint(path, quiet)
        if found is None:
            raise CheckpointError(f"--resume {resume}: this run folder has no complete checkpoint to resume from.")
        return found
    raise CheckpointError(
        f"--resume {resume}: not a checkpoint-N folder or a run folder. Pass "
        f"--resume auto (with --run-name), a run folder or a checkpoint."
    )


# ----------------------------------------------------------------------------- drift


def data_fingerprint(samples) -> dict:
    """Count and sha256 of the encoded training samples, in order (input_ids and labels); the
    data cache records the same value (data.arrow.fingerprint_samples)."""
    return fingerprint_samples(samples)


def _comparable(key: str, value):
    if key == "model.name" and value:
        try:
            return resolve_model_spec(value)[1]
        except LoraLabError:
            return value
    if key in ("data.datasets", "data.val_data") and value:
        return [str(Path(v).resolve()) if Path(v).is_file() else v for v in value]
    return value


def config_drift(saved: RunConfig, current: RunConfig) -> list[str]:
    """Settings in DRIFT_KEYS that differ between the run's config.yaml and this invocation."""
    before, now = flatten(saved.to_dict()), flatten(current.to_dict())
    changes = []
    for key in DRIFT_KEYS:
        if _comparable(key, before.get(key)) != _comparable(key, now.get(key)):
            flag = f" ({FLAG_FOR_KEY[key]})" if key in FLAG_FOR_KEY else ""
            changes.append(f"{key}{flag}: {before.get(key)!r} in the run, {now.get(key)!r} now")
    return changes


def data_drift(checkpoint: Path, fingerprint: dict) -> list[str]:
    recorded = read_manifest(checkpoint).get("train_data")
    if not recorded or recorded == fingerprint:
        return []
    return [
        f"training data: {recorded['samples']} samples (sha256 {recorded['sha256'][:12]}) "
        f"in {checkpoint.name}, {fingerprint['samples']} samples (sha256 "
        f"{fingerprint['sha256'][:12]}) now"
    ]


def resumed_batch(run_dir: Path, current: RunConfig) -> tuple[int, int] | None:
    """The (micro_batch_size, grad_accum) a run moved to after running out of memory, when it
    differs from `current` at the same effective batch: the resumed run continues with it."""
    saved_file = run_dir / CONFIG_FILE
    if not saved_file.is_file():
        return None
    saved = load_saved_config(saved_file)
    s, c = saved.train, current.train
    if saved.sources.get("train.micro_batch_size") != OOM_SOURCE:
        return None
    if s.micro_batch_size * s.grad_accum != c.micro_batch_size * c.grad_accum:
        return None
    if (s.micro_batch_size, s.grad_accum) == (c.micro_batch_size, c.grad_accum):
        return None
    return s.micro_batch_size, s.grad_accum


def check_drift(run_dir: Path, checkpoint: Path, current: RunConfig, fingerprint: dict) -> list:
    """What changed since the run started; raises unless --allow-config-change."""
    saved_file = run_dir / CONFIG_FILE
    changes = data_drift(checkpoint, fingerprint)
    if saved_file.is_file():
        changes = config_drift(load_saved_config(saved_file), current) + changes
    if changes and not current.train.allow_config_change:
        lines = "\n".join(f"  - {c}" for c in changes)
        raise CheckpointError(
            f"--resume: {run_dir} was trained with other settings:\n{lines}\n"
            f"Resuming would not continue the same training. Use the run's "
            f"settings ({saved_file}), or pass --allow-config-change to "
            f"resume anyway."
        )
    return changes


# ----------------------------------------------------------------------------- disk space
