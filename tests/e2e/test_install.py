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
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(ROOT)],
                   check=True, cwd=tmp_path)
    code = ("import json, lora_lab.config as c, lora_lab.data.formats as f, lora_lab.paths as p,"
            " lora_lab.registry as r, lora_lab.training.run, lora_lab.use.export, lora_lab.cli,"
            " lora_lab.models.shipped as s;"
            "print(json.dumps([str(p.presets_dir()), [p['name'] for p in c.list_presets()],"
            " len(f.read_rows('self-cognition')), r.known_model_config('7b')['hidden_size'],"
            " sorted(x.name for x in p.shipped_tokenizer_dir().iterdir()),"
            " s.shipped_model('gemma-3-270m').chat_template_text()[:15]]))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout
    presets_path, names, rows, hidden, tokenizer_files, template = json.loads(out)
    assert presets_path.startswith(str(target))
    assert {"cpu", "16gb", "24gb"} <= set(names)
    assert rows >= 80 and hidden == 3584
    assert tokenizer_files == ["LICENSE", "SOURCE.md", "tokenizer.json", "tokenizer_config.json"]
    assert template == "{{ bos_token }}"
