"""The encoded-data cache: a dataset is read and encoded once per key, and every later run, data
command and process of `--gpus N` maps the Arrow files instead (data.cache, data.num_proc).

    data_cache_dir()/KEY/meta.json        the key's parts, problems, warnings, fingerprints
    data_cache_dir()/KEY/*.arrow          encoded samples (stream.py writes them, arrow.py maps
                                          them); meta.json lists each report's files in order
    data_cache_dir()/KEY.lock             held (flock) while one process encodes KEY

KEY is the sha256 of everything that changes the encoded samples: the bytes of every data file
(a hub dataset: its `datasets` fingerprint), the tokenizer's vocabulary, special tokens and chat
template, the encode and read settings, the seed (PATH#N sampling and the val_ratio split), the
task, the library versions that render and tokenise, and ENCODER_VERSION. A changed byte in any
of them is another key; nothing stale is read. A folder is written as KEY.partial and renamed
into place whole, under an flock that the kernel releases if its process dies: the first
process encodes, the others wait for the lock and map the finished folder.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..log import get_logger
from ..paths import BUNDLED_DATA, bundled_data_dir, data_cache_dir, file_sha256, installed_versions, staged_folder
from .arrow import ArrowSamples, fingerprint_samples, map_samples
from .encode import EncodeReport
from .readers import Problem
from .reading import parse_spec
from .stream import StreamedEncoding

ENCODER_VERSION = 3
"""Raised whenever encode.py, formats.py, readers.py or the Arrow columns change what a row
encodes to."""
META = "meta.json"
log = get_logger()


def source_digest(spec: str) -> str | None:
    """sha256 of a --data entry's bytes (a dataset_info.json entry: the file and its data file;
    a hub dataset: its `datasets` fingerprint); None when it cannot be read (the read that
    follows reports why)."""
    from .dataset_info import DatasetInfoEntry

    source, _ = parse_spec(spec)
    if source in BUNDLED_DATA:
        return file_sha256(bundled_data_dir() / BUNDLED_DATA[source])
    try:
        entry = DatasetInfoEntry.from_source(source)
    except DataError:
        return None
    if entry is not None:
        parts: list[str | None] = [file_sha256(entry.info_path), entry.name]
        if entry.entry.get("file_name"):
            data_file = entry.info_path.parent / entry.entry["file_name"]
            parts.append(file_sha256(data_file) if data_file.is_file() else None)
        elif entry.entry.get("hf_hub_url"):
            split = entry.entry.get("split")
            parts.append(hub_fingerprint(entry.entry["hf_hub_url"] + (f":{split}" if split else "")))
        return None if None in parts else hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    path = Path(source).expanduser()
    if path.is_file():
        return file_sha256(path)
    if path.exists() or source.startswith((".", "/", "~")) or path.suffix:
        return None
    return hub_fingerprint(source)


def hub_fingerprint(source: str) -> str | None:
    name, _, split = source.partition(":")
    try:
        import datasets

        return datasets.load_dataset(name, split=split or "train")._fingerprint
    except Exception:
        return None


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what a tokenizer encodes with: its class, vocabulary and merges (the whole
    tokenizer.json of a fast tokenizer), special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256()
    for part in (
        type(tokenizer).__name__,
        vocab,
        str(tokenizer.chat_template),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
        json.dumps([tokenizer.eos_token_id, tokenizer.pad_token_id]),
    ):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def key_parts(kind: str, specs: list, args, tokenizer, seed: int, task: str, settings: tuple) -> dict | None:
    """Everything the encoded samples depend on; None if a dataset cannot be fingerprinted."""
    sources = [[spec, source_digest(spec)] for spec in specs]
    if any(digest is None for _, digest in sources):
        return None
    max_length, truncation, system, enable_thinking = settings
    return {
        "encoder_version": ENCODER_VERSION,
        "kind": kind,
        "sources": sources,
        "datasets": list(args.datasets),
        "val_data": list(args.val_data),
        "val_ratio": args.val_ratio,
        "seed": seed,
        "task": task,
        "format": args.format,
        "max_length": max_length,
        "truncation": truncation,
        "system": system,
        "enable_thinking": enable_thinking,
        "model_name": args.model_name,
        "model_author": args.model_author,
        "tokenizer": tokenizer_digest(tokenizer),
        "libraries": installed_versions(("transformers", "tokenizers", "jinja2")),
    }


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


@contextlib.contextmanager
def key_lock(lock: Path):
    """Hold `lock` (flock, released by the kernel if this process dies); a second process
    waits, saying who it waits for."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            log.info(f"data: waiting for {holder} to finish encoding {lock.with_suffix('')}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def problems_json(problems: list) -> list:
    return [[p.origin, p.reason] for p in problems]


def problems_from_json(rows: list) -> list:
    return [Problem(origin, reason) for origin, reason in rows]


def temporary_folder() -> Path:
    """A folder for encoded samples that are not cached, removed when the process ends."""
    folder = Path(tempfile.mkdtemp(prefix="lora-lab-encoded-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def cached_encoding(
    kind: str, specs: list, args, tokenizer, seed: int, task: str, settings: tuple, build
) -> tuple[dict, dict, str]:
    """build(stream) -> ({name: EncodeReport or None}, extra: a JSON-able dict), where stream
    is a StreamedEncoding with `settings` (max_length, truncation, system, enable_thinking)
    writing into the cache entry. Returns the reports, extra and how they were got: "reused",
    "encoded" (and stored), or "not cached" (data.cache false, or a dataset without a
    fingerprint: encoded into a temporary folder)."""
    parts = key_parts(kind, specs, args, tokenizer, seed, task, settings) if args.cache else None
    if parts is None:
        with StreamedEncoding(tokenizer, settings, temporary_folder(), args.num_proc) as stream:
            reports, extra = build(stream)
        return reports, extra, "not cached"
    final = data_cache_dir() / cache_key(parts)
    with key_lock(final.with_name(final.name + ".lock")):
        if (final / META).is_file():
            try:
                reports, extra = read_cache(final)
            except (OSError, ValueError, KeyError, TypeError) as exc:  # damaged: encode again
                log.info(f"data: {final} cannot be read ({type(exc).__name__}); encoding again")
                shutil.rmtree(final, ignore_errors=True)
            else:
                log.info(f"data: encoded data reused from {final}")
                return reports, extra, "reused"
        started = time.time()
        try:
            with staged_folder(final) as staging:
                with StreamedEncoding(tokenizer, settings, staging, args.num_proc) as stream:
                    reports, extra = build(stream)
                write_meta(staging, parts, reports, extra, stream, time.time() - started)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise DataError(
                f"no space left in {data_cache_dir()} for the encoded data: free "
                f"space there, point LORA_LAB_DATA_CACHE at a larger disk, or pass "
                f"--set data.cache=false."
            ) from None
        reports, extra = read_cache(final)
    processes = stream.used_processes
    log.info(f"data: encoded in {time.time() - started:.1f} s with {processes} process(es), stored in {final}")
    return reports, extra, "encoded"


def write_meta(
    folder: Path, parts: dict, reports: dict, extra: dict, stream: StreamedEncoding, seconds: float
) -> None:
    meta: dict[str, Any] = {
        "format": 1,
        "key": parts,
        "seconds": round(seconds, 2),
        "num_proc": {name: stream.used_processes for name in stream.report_files},
        "extra": extra,
        "reports": {},
    }
    for name, report in reports.items():
        if report is None:
            meta["reports"][name] = None
            continue
        meta["reports"][name] = {
            "files": stream.report_files[name],
            "problems": problems_json(report.problems),
            "truncated": list(report.truncated),
            "fingerprint": fingerprint_samples(report.samples) if name == "train" else None,
        }  # what --resume checks
    (folder / META).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")


def read_cache(folder: Path) -> tuple[dict, dict]:
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    reports: dict[str, EncodeReport | None] = {}
    for name, entry in meta["reports"].items():
        if entry is None:
            reports[name] = None
            continue
        samples: ArrowSamples = map_samples(folder, entry["files"])
        reports[name] = EncodeReport(
            samples,  # type: ignore[arg-type]  # a read-only Sequence, read as the list it annotates
            list(entry["truncated"]),
            problems_from_json(entry["problems"]),
            fingerprint=entry["fingerprint"],
        )
    return reports, meta["extra"]
