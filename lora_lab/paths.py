"""Files on disk that are nobody's format: the folders lora-lab ships, its cache folder, and the
one way every writer (checkpoints, merge, export, GGUF conversion) puts a folder in place."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import struct
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _shipped_dir(repo_folder: str, package: str) -> Path:
    """A folder shipped with lora-lab: the repo checkout's, or the installed package's copy."""
    in_checkout = PACKAGE_DIR.parent / repo_folder
    if in_checkout.is_dir():
        return in_checkout
    return Path(list(importlib.import_module(package).__path__)[0])


def presets_dir() -> Path:
    return _shipped_dir("presets", "lora_lab.presets")


def bundled_data_dir() -> Path:
    return _shipped_dir("data", "lora_lab.bundled_data")


BUNDLED_DATA = {"self-cognition": "self_cognition.jsonl"}
"""--data names of the datasets lora-lab ships -> their file in bundled_data_dir()."""
IDENTITY_DATA = frozenset({"self-cognition"})
"""Bundled sets whose rows say {{NAME}} / {{AUTHOR}}: they exist to be filled from --model-name
and --model-author, and are never trained with the placeholders left in."""


def identity_datasets(specs: list) -> list:
    """The --data entries (PATH#N too) that name a bundled identity set."""
    return [spec for spec in specs if spec.strip().partition("#")[0] in IDENTITY_DATA]


def human_bytes(count: int) -> str:
    """A size in MiB, or GiB from 1 GiB on."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def cache_dir() -> Path:
    return Path(os.environ.get("LORA_LAB_CACHE", Path.home() / ".cache" / "lora-lab"))


def data_cache_dir() -> Path:
    """Encoded datasets (data/cache.py): LORA_LAB_DATA_CACHE, else the cache folder's data/."""
    return Path(os.environ.get("LORA_LAB_DATA_CACHE", cache_dir() / "data"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


REPLACED_PREFIX = ".replaced-"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
"""Files that may be Python pickles: never loaded without torch.load(weights_only=True), never
written into a folder meant for serving."""


def pickled_files(folder: Path) -> list[str]:
    """Names of the files in `folder` that may be pickles (PICKLE_SUFFIXES)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.suffix in PICKLE_SUFFIXES)


def model_configs_dir() -> Path:
    """The real config.json files of the model sizes lora-lab knows (registry.py)."""
    return PACKAGE_DIR / "model_configs"


def shipped_tokenizer_dir() -> Path:
    """The Qwen2.5 Instruct tokenizer and chat template shipped with lora-lab (its SOURCE.md)."""
    return PACKAGE_DIR / "qwen25_tokenizer"


def replace_folder(staging: Path, final: Path) -> Path:
    """Rename a finished `staging` folder to `final`, replacing an old one: the old folder is
    renamed aside first, so that a kill at any moment leaves either the old or the new one
    complete (training.checkpoint.remove_leftovers finishes the job for checkpoints)."""
    replaced = final.with_name(REPLACED_PREFIX + final.name)
    if replaced.exists():
        shutil.rmtree(replaced)
    if final.exists():
        final.rename(replaced)
    staging.rename(final)
    fsync(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)
    return final


@contextlib.contextmanager
def staged_folder(final: Path):
    """Write a folder as FINAL.partial and put it in place as FINAL only when the block ends
    without an error; on an error FINAL stays as it was and the partial folder is removed."""
    final = Path(final)
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    readable_by_umask(staging)
    replace_folder(staging, final)


def readable_by_umask(folder: Path) -> None:
    """Give every file the mode a new file gets here (0644 under the usual umask 022): some
    writers (safetensors) create theirs 0600, which breaks serving the folder as another user."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


SAFETENSORS_HEADER_LIMIT = 100_000_000
"""The safetensors format's own cap on a header's size: a larger length is not safetensors."""


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be loaded (cut short, not safetensors), or None. Reads the
    header only: 8 bytes of length, a JSON table of tensors and their byte ranges."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > SAFETENSORS_HEADER_LIMIT:
                raise ValueError
            if length > size - 8:
                return f"{path} is cut short: {size:,} bytes where its header alone needs {8 + length:,}"
            header = json.loads(handle.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        return f"{path} is not a readable safetensors file ({size:,} bytes)"
    if 8 + length + end > size:
        return f"{path} is cut short: {size:,} bytes where its header needs {8 + length + end:,}"
    return None


def installed_versions(names) -> dict[str, str | None]:
    """The installed version of each package (None where it is not installed)."""
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions
