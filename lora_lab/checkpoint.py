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

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from .config import (FLAGS, RunConfig, flatten, load_saved_config, model_config_of,
                     resolve_model_spec)
from .errors import CheckpointError, LoraLabError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
REQUIRED_FILES = ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json",
                  "optimizer.pt", "scheduler.pt", "rng_state.pth")
"""rng_state.pth is rng_state_<rank>.pth when several processes train."""
FULL_REQUIRED_FILES = ("config.json", "model.safetensors") + REQUIRED_FILES[2:]
"""--tuner full checkpoints hold the whole model (model.safetensors, or its shards and
model.safetensors.index.json) instead of an adapter."""
PICKLED_SUFFIXES = (".pt", ".pth", ".bin")
DRIFT_KEYS = ("model.name", "model.quantization", "train.tuner", "train.gpus", "train.engine",
              "lora.rank", "lora.alpha", "lora.dropout",
              "lora.target_modules", "data.datasets", "data.val_data", "data.val_ratio",
              "data.format", "data.max_length", "data.truncation", "data.system",
              "train.micro_batch_size", "train.grad_accum", "train.seed")
"""Settings that change what a step computes: resuming with other values is refused."""

OOM_SOURCE = "out-of-memory retry"
"""config.yaml source of micro_batch_size and grad_accum after an out-of-memory retry."""


# ----------------------------------------------------------------------------- writing

def checkpoint_step(folder: Path) -> int | None:
    match = CHECKPOINT_NAME.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def staging_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"{STAGING_PREFIX}checkpoint-{step}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def write_manifest(staging: Path, step: int, train_data: dict | None) -> None:
    """fsync every staged file, then record its size and sha256 (the manifest comes last)."""
    files = {}
    for path in _files(staging):
        if path.name == MANIFEST_NAME:
            continue
        _fsync(path)
        files[path.relative_to(staging).as_posix()] = {"bytes": path.stat().st_size,
                                                       "sha256": file_sha256(path)}
    body = {"format": MANIFEST_FORMAT, "step": step, "files": files, "train_data": train_data}
    manifest = staging / MANIFEST_NAME
    manifest.write_text(json.dumps(body, indent=1) + "\n")
    _fsync(manifest)
    _fsync(staging)


def commit_checkpoint(staging: Path, final: Path) -> Path:
    """Rename a staged checkpoint (manifest written) to its final name, replacing an old one."""
    replaced = final.with_name(REPLACED_PREFIX + final.name)
    if replaced.exists():
        shutil.rmtree(replaced)
    if final.exists():
        final.rename(replaced)
    staging.rename(final)
    _fsync(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)
    return final


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Clean up after a process killed during a save; returns the folders deleted.

    A staging folder whose save finished (manifest written, files intact) but was not renamed
    yet is committed, as is the checkpoint it was replacing if the kill came between the two
    renames; everything else left behind is deleted."""
    leftovers = sorted((p for p in Path(run_dir).glob(".*checkpoint-*") if p.is_dir() and
                        p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))),
                       key=lambda p: not p.name.startswith(STAGING_PREFIX))  # newer first
    deleted = []
    for folder in leftovers:
        final = folder.with_name(folder.name.removeprefix(STAGING_PREFIX)
                                 .removeprefix(REPLACED_PREFIX))
        if not final.exists() and not checkpoint_problems(folder):
            commit_checkpoint(folder, final)
            continue
        shutil.rmtree(folder)
        deleted.append(folder)
    return deleted


def rotate_checkpoints(run_dir: Path, limit: int, newest: Path, keep: tuple = ()) -> list[Path]:
    """Keep `newest` (just committed), anything in `keep` and the next complete checkpoints by
    step up to `limit` in all; delete older complete ones. Incomplete folders are left alone."""
    complete = [c for c in list_checkpoints(run_dir) if (c / MANIFEST_NAME).is_file()]
    protected = {Path(newest).resolve()} | {Path(k).resolve() for k in keep if k}
    kept = [c for c in complete if c.resolve() in protected]
    deleted = []
    for folder in sorted(complete, key=checkpoint_step, reverse=True):
        if folder.resolve() in protected:
            continue
        if len(kept) < limit:
            kept.append(folder)
        else:
            shutil.rmtree(folder)
            deleted.append(folder)
    return deleted


# ----------------------------------------------------------------------------- checking

def list_checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint-N folders of a run, lowest step first."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and checkpoint_step(p)
             is not None]
    return sorted(found, key=checkpoint_step)


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST_NAME).read_text())


def checkpoint_problems(folder: Path) -> list[str]:
    """Why `folder` cannot be resumed from (empty when it is complete and intact)."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        return [f"{folder / MANIFEST_NAME} is missing: the save did not finish (or an older "
                f"lora-lab wrote it)"]
    try:
        files = read_manifest(folder)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{folder / MANIFEST_NAME} is not readable ({exc})"]
    rng_files = [name for name in files if re.fullmatch(r"rng_state(_\d+)?\.pth", name)]
    required = REQUIRED_FILES if "adapter_config.json" in files or "config.json" not in files \
        else FULL_REQUIRED_FILES
    weights_only = (" (no optimizer state: a checkpoint saved with train.save_only_model=true "
                    "has the weights only, and a run cannot resume from it)")
    problems = [f"{folder / name} is missing from the manifest"
                + (weights_only if name == "optimizer.pt" else "") for name in required
                if name not in files and not (name == "rng_state.pth" and rng_files)
                and not (name == "model.safetensors" and "model.safetensors.index.json" in files)
                and not (name == "optimizer.pt" and _engine_optimizer_state(files))]
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{path} is {path.stat().st_size} bytes; the manifest says "
                            f"{entry['bytes']} (truncated or overwritten)")
        elif file_sha256(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 does not match the manifest (corrupt or changed "
                            f"after the save)")
    return problems or unsafe_pickles(folder)


def _engine_optimizer_state(files: dict) -> bool:
    """DeepSpeed (`latest` + global_stepN/) and FSDP (optimizer_0/, optimizer.bin) save the
    optimizer state in their own layout instead of optimizer.pt."""
    return any(name == "latest" or name.startswith(("global_step", "optimizer_0/",
                                                     "optimizer.bin")) for name in files)


def unsafe_pickles(folder: Path) -> list[str]:
    """Pickled files that torch.load(weights_only=True) refuses: they hold Python objects (code
    could run when they are opened), not just tensors and numbers."""
    import torch

    problems = []
    for path in _files(Path(folder)):
        if path.suffix not in PICKLED_SUFFIXES:
            continue
        try:
            with _numpy_allowed():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal means: do not load this file
            first_line = (str(exc).splitlines() or [""])[0][:120]
            problems.append(f"{path} was refused by torch.load(weights_only=True): it holds more "
                            f"than tensors ({type(exc).__name__}: {first_line})")
    return problems


def _numpy_allowed():
    """The numpy types an RNG state file legitimately holds (as transformers allows them)."""
    import numpy as np
    import torch

    core = np._core if hasattr(np, "_core") else np.core
    return torch.serialization.safe_globals([core.multiarray._reconstruct, np.ndarray, np.dtype,
                                             type(np.dtype(np.uint32))])


def find_resume_checkpoint(run_dir: Path, warn=print) -> Path | None:
    """The newest complete checkpoint of a run; every skipped one is reported with its reason."""
    for folder in reversed(list_checkpoints(run_dir)):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder
        warn(f"warning: not resuming from {folder.name}: {'; '.join(problems)}")
    return None


def resolve_resume(resume: str, run_dir: Path, warn=print) -> Path | None:
    """--resume auto|RUN_DIR|CHECKPOINT -> the checkpoint to resume from (None: start fresh)."""
    if resume == "auto":
        found = find_resume_checkpoint(run_dir, warn) if run_dir.is_dir() else None
        if found is None:
            warn(f"--resume auto: no complete checkpoint in {run_dir}; starting a new run.")
        return found
    path = Path(resume).expanduser()
    if checkpoint_step(path) is not None and path.is_dir():
        problems = checkpoint_problems(path)
        if problems:
            raise CheckpointError(f"--resume {resume}: cannot resume from this checkpoint:\n  - "
                                  + "\n  - ".join(problems) + "\nPick another checkpoint, or "
                                  "--resume auto for the newest complete one.")
        return path
    if (path / "config.yaml").is_file():
        found = find_resume_checkpoint(path, warn)
        if found is None:
            raise CheckpointError(f"--resume {resume}: this run folder has no complete "
                                  f"checkpoint to resume from.")
        return found
    raise CheckpointError(f"--resume {resume}: not a checkpoint-N folder or a run folder. Pass "
                          f"--resume auto (with --run-name), a run folder or a checkpoint.")


def run_dir_of(resume: str) -> Path | None:
    """The run folder named by --resume PATH (None for auto)."""
    if resume == "auto":
        return None
    path = Path(resume).expanduser()
    return path.parent if checkpoint_step(path) is not None else path


# ----------------------------------------------------------------------------- drift

def data_fingerprint(samples: list) -> dict:
    """Count and sha256 of the encoded training samples, in order (input_ids and labels)."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(json.dumps([sample.input_ids, sample.labels]).encode())
    return {"samples": len(samples), "sha256": digest.hexdigest()}


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
    flag_for_key = {key: flag.split("/")[0] for flag, key in FLAGS.items()}
    changes = []
    for key in DRIFT_KEYS:
        if _comparable(key, before.get(key)) != _comparable(key, now.get(key)):
            flag = f" ({flag_for_key[key]})" if key in flag_for_key else ""
            changes.append(f"{key}{flag}: {before.get(key)!r} in the run, {now.get(key)!r} now")
    return changes


def data_drift(checkpoint: Path, fingerprint: dict) -> list[str]:
    recorded = read_manifest(checkpoint).get("train_data")
    if not recorded or recorded == fingerprint:
        return []
    return [f"training data: {recorded['samples']} samples (sha256 {recorded['sha256'][:12]}) "
            f"in {checkpoint.name}, {fingerprint['samples']} samples (sha256 "
            f"{fingerprint['sha256'][:12]}) now"]


def adopt_oom_batch(saved: RunConfig, current: RunConfig, echo=print) -> None:
    """After an out-of-memory retry the run continues with its smaller micro-batch."""
    s, c = saved.train, current.train
    if saved.sources.get("train.micro_batch_size") != OOM_SOURCE:
        return
    if s.micro_batch_size * s.grad_accum != c.micro_batch_size * c.grad_accum:
        return
    if (s.micro_batch_size, s.grad_accum) != (c.micro_batch_size, c.grad_accum):
        echo(f"resuming with micro-batch {s.micro_batch_size} x grad-accum {s.grad_accum}, "
             f"as the run did after running out of memory")
        c.micro_batch_size, c.grad_accum = s.micro_batch_size, s.grad_accum
        current.sources["train.micro_batch_size"] = current.sources["train.grad_accum"] = OOM_SOURCE


def check_drift(run_dir: Path, checkpoint: Path, current: RunConfig, fingerprint: dict,
                echo=print) -> list:
    """What changed since the run started; raises unless --allow-config-change."""
    saved_file = run_dir / "config.yaml"
    changes = data_drift(checkpoint, fingerprint)
    if saved_file.is_file():
        saved = load_saved_config(saved_file)
        adopt_oom_batch(saved, current, echo)
        changes = config_drift(saved, current) + changes
    if changes and not current.train.allow_config_change:
        lines = "\n".join(f"  - {c}" for c in changes)
        raise CheckpointError(f"--resume: {run_dir} was trained with other settings:\n{lines}\n"
                              f"Resuming would not continue the same training. Use the run's "
                              f"settings ({saved_file}), or pass --allow-config-change to "
                              f"resume anyway.")
    return changes


def trim_step_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint resumed from: they are about to be trained again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except ValueError:
            continue  # a line cut short by the kill
    path.write_text("".join(kept))


# ----------------------------------------------------------------------------- disk space

GB = 1e9


def checkpoint_sizes(config: RunConfig, model_config: dict) -> tuple[float, float, float]:
    """Estimated bytes of a checkpoint's weights, of its optimizer state, and of the final
    weights, from the model's shape.

    Weights: LoRA adapters in fp32; full fine-tuning in 16 bits with DeepSpeed (its module is
    16-bit) and in fp32 otherwise (the master weights), the final model of a one-process run
    in bf16. Optimizer state: AdamW's two fp32 moments, plus DeepSpeed's fp32 master copy."""
    from .memory import ModelShape

    shape = ModelShape.from_config(model_config)
    engine, full = config.train.engine, config.train.tuner == "full"
    deepspeed = engine.startswith("deepspeed")
    trained = shape.trained_params(config.train.tuner, config.lora.rank)
    weight_bytes = (2 if deepspeed else 4) if full else 4
    optimizer_bytes = 12 if deepspeed and full else 8
    final_bytes = (4 if engine == "fsdp" else 2) if full else 4
    return trained * weight_bytes, trained * optimizer_bytes, trained * final_bytes


def check_disk_space(config: RunConfig, run_dir: Path, total_steps: int) -> None:
    """Refuse before training a run whose checkpoints and final weights will not fit the free
    space where they go: a full disk fails the save at the end, after all the training."""
    model_config = model_config_of(config.model.name) if config.train.disk_check else None
    if model_config is None or "hidden_size" not in model_config:
        return
    t = config.train
    weights, optimizer, final = checkpoint_sizes(config, model_config)
    per_checkpoint = weights + (0 if t.save_only_model else optimizer)
    saves = -(-total_steps // t.save_steps)  # every save_steps, and at the last step
    # a new checkpoint is written before the oldest beyond save_total_limit is deleted
    kept = min(saves, t.save_total_limit + 1)
    needed = kept * per_checkpoint + final
    where = Path(run_dir)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed <= free:
        return
    what = "model" if t.tuner == "full" else "adapter"
    fixes = []
    if kept > 2:
        fixes.append(f"keep one checkpoint (--set train.save_total_limit=1: "
                     f"{(2 * per_checkpoint + final) / GB:.0f} GB)")
    if not t.save_only_model:
        fixes.append(f"save weights only (--set train.save_only_model=true: "
                     f"{(kept * weights + final) / GB:.0f} GB; such checkpoints cannot be "
                     f"resumed)")
    fixes.append("write elsewhere (--output-dir) or free space")
    raise LoraLabError(
        f"--output-dir {t.output_dir}: this run writes about {needed / GB:.0f} GB (up to {kept} "
        f"checkpoint(s) of {per_checkpoint / GB:.1f} GB and the final {what} of "
        f"{final / GB:.1f} GB) but {where} has {free / GB:.0f} GB free. Either "
        + "; or ".join(fixes) + ". --set train.disk_check=false skips this check.")
