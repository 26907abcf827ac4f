"""Two processes that want the same GGUF converted (make test's two workers, two shells) take
turns: the second waits on the conversion's flock and then uses the folder the first made,
instead of writing into it at the same time."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONVERT = "import sys; from lora_lab.models.gguf import convert_gguf; print('folder', convert_gguf(sys.argv[1], sys.argv[2]))"


def test_a_second_conversion_waits_for_the_first_and_uses_its_folder(tmp_path):
    gguf, out = tmp_path / "model.gguf", tmp_path / "model"
    gguf.write_bytes(b"GGUF" + bytes(60))  # never read: the folder is complete when the lock frees
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "model.lock", "a") as lock:  # the first process, converting
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = subprocess.Popen(
            [sys.executable, "-c", CONVERT, str(gguf), str(out)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert second.poll() is None  # waiting on the lock
        out.mkdir()
        (out / ".complete").write_text(f"{gguf}\n")
        fcntl.flock(lock, fcntl.LOCK_UN)
    stdout, stderr = second.communicate(timeout=60)
    assert second.returncode == 0, stderr
    assert stdout.strip() == f"folder {out}"
    assert "converting" not in stdout + stderr
