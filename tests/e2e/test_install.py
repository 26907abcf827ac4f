"""A non-editable install finds its presets, bundled data and shipped tokenizer without the source
checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_non_editable_install_ships_presets_and_data(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    code = (
        "import json, lora_lab.config as c, lora_lab.data.formats as f, lora_lab.paths as p,"
        " lora_lab.registry as r, lora_lab.training.run, lora_lab.use.export, lora_lab.cli,"
        " lora_lab.models.shipped as s;"
        "print(json.dumps([str(p.presets_dir()), [p['name'] for p in c.list_presets()],"
        " len(f.read_rows('self-cognition')), r.known_model_config('7b')['hidden_size'],"
        " sorted(x.name for x in p.shipped_tokenizer_dir().iterdir()),"
        " s.shipped_model('gemma-3-270m').chat_template_text()[:15]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True
    ).stdout
    presets_path, names, rows, hidden, tokenizer_files, template = json.loads(out)
    assert presets_path.startswith(str(target))
    assert {"cpu", "16gb", "24gb"} <= set(names)
    assert rows >= 80 and hidden == 3584
    assert tokenizer_files == ["LICENSE", "SOURCE.md", "tokenizer.json", "tokenizer_config.json"]
    assert template == "{{ bos_token }}"


LLM_COMPRESSOR_LINES = (
    "llmcompressor 0.14.0.1 requires auto-round, which is not installed.",
    "llmcompressor 0.14.0.1 has requirement transformers",
)
"""What `pip check` says of llm-compressor, installed with --no-deps by `make install` (its
AutoRound modifier, which lora-lab never calls, and its transformers pin: docs/install.md)."""


def test_pip_check_reports_only_llm_compressors_declared_pins():
    """Of the packages lora-lab declares (its requirements and extras), `pip check` finds
    nothing broken but llm-compressor's two known lines."""
    import re
    from importlib.metadata import requires

    ours = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requires("lora-lab")} | {
        "lora-lab"
    }
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.split(" ", 1)[0].lower().replace("_", "-") in ours]
    others = [line for line in lines if not line.startswith(LLM_COMPRESSOR_LINES)]
    assert others == [], others
