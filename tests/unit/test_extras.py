"""A command that needs an extra which is not installed stops with one line naming the extra
(`pip install 'lora-lab[ui]'`), no traceback: `make install` and `pip install lora-lab` bring
only what training needs, the rest installs on demand."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

PAIRS = [{"prompt": "Who are you?", "chosen": "Aurora.", "rejected": "Qwen."}] * 4


def without(monkeypatch, *modules: str) -> None:
    """Act as if the modules were not installed (make test installs every extra)."""
    real_find_spec = importlib.util.find_spec
    blocked = set(modules)

    def find_spec(name, *args):
        return None if name.split(".")[0] in blocked else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for name in list(sys.modules):
        if name.split(".")[0] in blocked:
            monkeypatch.delitem(sys.modules, name)
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # import name -> ImportError


def error_lines(result) -> list:
    """What the command wrote to stderr, blank lines left out."""
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "extra, modules, args",
    [
        ("ui", ["gradio"], ["ui", "--port", "0"]),
        ("gguf", ["llama_cpp"], ["export", "{run}", "--format", "gguf"]),
        ("export", ["llmcompressor"], ["export", "{run}", "--quantize", "w4a16"]),
        ("trackers", ["wandb"], ["run", "--model", "{model}", "--data", "{data}", "--report-to", "wandb"]),
        ("preference", ["trl"], ["run", "--model", "{model}", "--data", "{pairs}", "--task", "dpo"]),
        ("eval", ["lm_eval"], ["eval", "{run}", "--tasks", "arc_easy"]),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(extra, modules, args, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    args = [a.format(run=run, model=tiny_model_dir, data=data, pairs=pairs) for a in args]
    without(monkeypatch, *modules)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    # the message (a configuration problem is one line of the list of every problem)
    (line,) = [line for line in error_lines(result) if "pip install" in line]
    assert f"pip install 'lora-lab[{extra}]'" in line
    assert len(error_lines(result)) <= 2 and "Traceback" not in result.output
