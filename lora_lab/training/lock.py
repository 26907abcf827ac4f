"""The run folder's lock: one run writes into a folder at a time; a lock left by a process that
died is taken over."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from ..errors import LoraLabError
from ..log import get_logger
from ..run_folder import RunFolder

log = get_logger()


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Hold the run folder while a run writes into it: a second run into the same folder stops
    with a message naming the process that holds it. A lock left by a process that died (same
    host, no such process) is taken over and said so."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunFolder(run_dir).lock
    _take_lock(lock)
    try:
        yield lock
    finally:
        lock.unlink(missing_ok=True)
        if created and not any(run_dir.iterdir()):
            run_dir.rmdir()


def _take_lock(lock: Path) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _lock_holder(lock)
            if holder is None:
                continue  # stale, removed: try again
            raise LoraLabError(
                f"--run-name {lock.parent.name}: another run is writing into {lock.parent} "
                f"(pid {holder.get('pid')} on {holder.get('host')}, since "
                f"{holder.get('started')}). Wait for it to finish, or pick another --run-name "
                f"or --output-dir. If no such run is alive, delete {lock}."
            ) from None
        with os.fdopen(descriptor, "w") as handle:
            handle.write(json.dumps(me) + "\n")
        return
    raise LoraLabError(
        f"{lock}: another process keeps taking this run folder's lock. Wait for it, or pick another --run-name."
    )


def _lock_holder(lock: Path) -> dict | None:
    """Who holds `lock`; None after removing a stale one (its process is gone)."""
    try:
        holder = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # cut short: its writer died between creating and writing it
        holder = {}
        if time.time() - lock.stat().st_mtime < 10:
            return {"pid": "?", "host": "?", "started": "just now"}
    alive = holder.get("host") != socket.gethostname() or _process_alive(holder.get("pid"))
    if holder and alive:
        return holder
    log.info(f"{lock}: the run that held this folder (pid {holder.get('pid')}) is gone; taking it over")
    lock.unlink(missing_ok=True)
    return None


def running_pid(run_dir: Path) -> int | None:
    """The process of this host that holds the run folder's lock (a run writing into it), or
    None; reads the lock only (a stale one is left for the next run to take over)."""
    try:
        holder = json.loads(RunFolder(run_dir).lock.read_text())
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if holder.get("host") != socket.gethostname() or not _process_alive(pid):
        return None
    return pid


def _process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True
