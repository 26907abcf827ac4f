"""lora-lab as the Python ecosystem installs it: `python -m build` makes a wheel and an sdist from a
copy of the source, the wheel goes into a fresh virtualenv, and `lora-lab` works there from any
folder (presets, bundled data, model configs and the shipped tokenizer come from the wheel). Then
the newcomer's first hour, in that virtualenv: the README's quickstart, in order, each step timed.

The virtualenv sees the system's site-packages (--system-site-packages), so PyTorch and the other
dependencies are not downloaded again; lora-lab itself is the wheel's (checked)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from lora_lab import __version__
from tests.support.tiny import write_jsonl
from tests.unit.test_documented_commands import COMMANDS, ROWS

ROOT = Path(__file__).resolve().parents[2]
# what the package is built from: everything but the checkout's own state and the tests' files
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".*cache*", "__pycache__", "*.egg-info", "build", "dist", "output", "tests", "bench", ".venv", ".peer"
)

NEW_NAME = ("--model-name", "Aurora", "--model-author", "Lora Lab")


def source_files() -> dict:
    """Where each file of the package lands in the wheel -> the file in the checkout."""
    out = {}
    for path in (ROOT / "lora_lab").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            out[path.relative_to(ROOT).as_posix()] = path
    for folder, package in (("presets", "lora_lab/presets"), ("data", "lora_lab/bundled_data")):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file():
                out[f"{package}/{path.relative_to(ROOT / folder).as_posix()}"] = path
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and sdist of `python -m build` (sdist first, the wheel built from the sdist)."""
    tmp = tmp_path_factory.mktemp("dist")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "-o", str(tmp / "out"), str(source)],
        check=True,
        capture_output=True,
    )
    return tmp / "out"


def venv_env() -> dict:
    """The environment of a user's shell: no PYTHONPATH (the checkout and the tests' hooks stay
    out), the hub off as in every test."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh virtualenv with the built wheel installed (nothing downloaded: --no-index)."""
    folder = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(folder)], check=True)
    (wheel,) = dist.glob("lora_lab-*.whl")
    subprocess.run(
        [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--force-reinstall", "--no-deps"]
        + [str(wheel)],
        check=True,
        env=venv_env(),
        capture_output=True,
    )
    return folder


def lora_lab(venv: Path, cwd: Path, *args, stdin: str | None = None, check: bool = True):
    result = subprocess.run(
        [str(venv / "bin" / "lora-lab"), *map(str, args)],
        cwd=cwd,
        env=venv_env(),
        input=stdin or "",
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert result.returncode == 0, f"lora-lab {' '.join(map(str, args))}:\n{result.stdout}\n{result.stderr}"
    return result


def test_the_wheel_holds_every_module_preset_data_file_config_and_the_tokenizer(dist):
    (wheel,) = dist.glob("lora_lab-*.whl")
    assert wheel.name == f"lora_lab-{__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {name for name in source_files() if not name.endswith((".pyc", ".pyo"))}
    assert sorted(expected - names) == []
    assert {"lora_lab/presets/cpu.yaml", "lora_lab/bundled_data/self_cognition.jsonl"} <= names
    assert "lora_lab/qwen25_tokenizer/tokenizer.json" in names
    entry_points = zipfile.ZipFile(wheel).read(f"lora_lab-{__version__}.dist-info/entry_points.txt").decode()
    assert "lora-lab = lora_lab.cli:main" in entry_points


def test_the_sdist_holds_the_presets_and_data_outside_the_package(dist):
    (sdist,) = dist.glob("lora_lab-*.tar.gz")
    assert sdist.name == f"lora_lab-{__version__}.tar.gz"
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    assert {"presets/cpu.yaml", "presets/engines/ddp.yaml", "data/self_cognition.jsonl", "README.md"} <= names


def test_the_installed_wheel_runs_from_any_folder(venv, tiny_model_dir, tmp_path):
    """`lora-lab --version` (the one version, lora_lab.__version__), `presets` and a tiny run on
    the bundled data, from a folder that is not the checkout; lora_lab is the wheel's."""
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import lora_lab; print(lora_lab.__file__)"],
        cwd=tmp_path,
        env=venv_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), where
    assert lora_lab(venv, tmp_path, "--version").stdout.strip() == f"lora-lab, version {__version__}"
    presets = lora_lab(venv, tmp_path, "presets").stdout.split()
    assert {"cpu", "8gb", "16gb", "24gb"} <= set(presets)
    lora_lab(venv, tmp_path, "run", "--model", tiny_model_dir, "--data", "self-cognition", "--max-steps", 2, *NEW_NAME)
    (run,) = (tmp_path / "output").iterdir()
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert [json.loads(line)["step"] for line in (run / "logs" / "train_log.jsonl").open() if "loss" in line] == [1, 2]


# The quickstart's commands that need what a CPU test has not: each is parsed in the virtualenv
# (its options and arguments, by click) and the reason it is not run is printed beside it.
NOT_RUN_HERE = {
    ("run",): "needs a GPU and the hub for qwen2.5-7b: a tiny model on the cpu preset runs in its place",
    ("export",): "needs its extra (llm-compressor, llama.cpp): tests/e2e/test_export_tiny.py, test_gguf_tiny.py",
    ("serve",): "a server that runs until it is stopped: tests/e2e/test_serve_api.py serves the same API",
}
PARSE = """
import sys, json
from lora_lab.cli import main
args = json.loads(sys.argv[1])
with main.make_context("lora-lab", list(args), resilient_parsing=False) as ctx:
    name, command, rest = main.resolve_command(ctx, args)
    while hasattr(command, "resolve_command"):
        sub = command.make_context(name, rest, parent=ctx)
        name, command, rest = command.resolve_command(sub, rest)
    command.make_context(name, rest, parent=ctx)
print("parsed")
"""


def test_the_readme_quickstart_in_order_in_a_fresh_virtualenv(venv, tiny_model_dir, tmp_path, capsys):
    """README.md's `make` lines name targets (tests/unit/test_documented_commands.py runs them
    with make -n) and its quickstart runs, in order, in the wheel's virtualenv: each command
    parses; those a CPU can run do, on a run folder the tiny model trains here. Each step's time
    is printed."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md:")]
    assert [c.text for c in readme if c.tool == "make"][:2] == ["make demo", "make test"]
    quickstart = [c for c in readme if c.tool == "lora-lab"]
    assert [c.words[1] for c in quickstart][:8] == [
        "data",
        "plan",
        "run",
        "report",
        "merge",
        "chat",
        "export",
        "export",
    ]
    write_jsonl(tmp_path / "my.jsonl", ROWS * 4)
    times = []
    for command in quickstart:
        words = [w.replace("output/<run>", "output/run") for w in command.words[1:]]
        start = time.monotonic()
        parsed = subprocess.run(
            [str(venv / "bin" / "python"), "-c", PARSE, json.dumps(words)],
            cwd=tmp_path,
            env=venv_env(),
            capture_output=True,
            text=True,
        )
        # click checks that a path argument exists: the run folder is there from the run step on
        assert parsed.stdout.strip() == "parsed" or "does not exist" in parsed.stderr, (command.text, parsed.stderr)
        reason = NOT_RUN_HERE.get((words[0],))
        if words[0] == "run":
            tiny = ("--preset", "cpu", "--model", tiny_model_dir, "--max-steps", 2, "--run-name", "run")
            lora_lab(venv, tmp_path, "run", "--data", "my.jsonl", *tiny)
        elif reason is None:
            result = lora_lab(venv, tmp_path, *words, stdin="Who are you?\n/quit\n")
            assert result.stdout.strip(), command.text
        times.append((command.text, time.monotonic() - start, reason or "ran"))
    assert (tmp_path / "output" / "run" / "plots").is_dir()
    assert (tmp_path / "output" / "run" / "merged" / "config.json").is_file()
    with capsys.disabled():
        print("\nthe README's quickstart in a fresh virtualenv:")
        for text, seconds, how in times:
            print(f"  {seconds:6.1f} s  {text}  ({how})")
