"""Model folders a user can hand in, broken every way a copy or a planted file breaks them:
`lora-lab run` ends in one message naming the file and the fix, never a traceback, and a
pickled payload never runs."""

import json
import os
import pickle
import shutil

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if value is KeyError:
                del config[key]
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def cut(name, keep=0.5):
    def edit(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])

    return edit


def pickled(folder):
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(folder.parent / "code-ran")))


def garbage_bin(folder):
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02not a pickle at all")


CASES = {
    "no hidden_size": (edit_config(hidden_size=KeyError), "config.json: hidden_size is missing"),
    "hidden_size as text": (edit_config(hidden_size="32"), "config.json: hidden_size is '32'"),
    "hidden_size null": (edit_config(hidden_size=None), "config.json: hidden_size is None"),
    "no vocab_size": (edit_config(vocab_size=KeyError), "config.json: vocab_size is missing"),
    "negative layers": (edit_config(num_hidden_layers=-2), "config.json: num_hidden_layers is -2"),
    "zero heads": (edit_config(num_attention_heads=0), "config.json: num_attention_heads is 0"),
    "bad head_dim": (edit_config(head_dim="x"), "config.json: head_dim is 'x'"),
    "config cut short": (cut("config.json"), "config.json: not valid JSON"),
    "config a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json: holds no JSON object"),
    "weights cut short": (cut("model.safetensors"), "model.safetensors"),
    "weights of another shape": (edit_config(intermediate_size=48), "do not load as a model"),
    "pickle payload": (pickled, "pytorch_model.bin) holds a pickle that is not plain tensors"),
    "pickle garbage": (garbage_bin, "pytorch_model.bin"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_model_folder_ends_in_one_message(case, tiny_model_dir, tmp_path):
    breaks, message = CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    breaks(folder)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    args = [
        "run",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]) and str(folder) in errors[0]
    assert not (tmp_path / "code-ran").exists()
