"""`make finetune` passes DATA, MODEL and PRESET through to `lora-lab run`."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make(*args):
    return subprocess.run(["make", "-s", *args], cwd=ROOT, capture_output=True, text=True)


def test_finetune_without_data_prints_usage():
    result = make("finetune", "-o", ".install.stamp")
    assert result.returncode != 0
    assert "usage: make finetune DATA=my.jsonl" in result.stdout


def test_finetune_builds_the_run_command():
    result = make(
        "-n", "finetune", "-o", ".install.stamp", "DATA=a.jsonl b.jsonl", "MODEL=qwen2.5-1.5b", "PRESET=16gb"
    )
    assert "lora-lab run --preset 16gb --model qwen2.5-1.5b --data a.jsonl --data b.jsonl" in (result.stdout)


def test_finetune_passes_gpus_and_engine():
    result = make("-n", "finetune", "-o", ".install.stamp", "DATA=a.jsonl", "GPUS=2", "ENGINE=deepspeed-zero3")
    assert "--data a.jsonl --gpus 2 --engine deepspeed-zero3" in result.stdout
    plain = make("-n", "finetune", "-o", ".install.stamp", "DATA=a.jsonl")
    assert plain.stdout.strip().endswith("--data a.jsonl --gpus 1")


def test_finetune_passes_nodes_node_rank_and_main_address():
    result = make(
        "-n",
        "finetune",
        "-o",
        ".install.stamp",
        "DATA=a.jsonl",
        "GPUS=8",
        "NODES=2",
        "NODE_RANK=1",
        "MAIN_ADDRESS=10.0.0.1:29500",
        "RUN_NAME=big",
    )
    assert result.stdout.strip().endswith(
        "--data a.jsonl --gpus 8 --nodes 2 --node-rank 1 --main-address 10.0.0.1:29500 --run-name big"
    )


def test_test_target_is_quiet_and_lists_the_slowest_tests():
    """CI runs `make test` (.ci/run): the unit and e2e tiers, -q (the real-model tests name
    themselves through tests/support/progress.py) and the slowest tests at the end."""
    result = make("-n", "test", "-o", ".install.stamp", "-o", ".test-deps.stamp")
    assert "-m pytest -q --durations=10 -n 2 --dist loadfile tests/unit tests/e2e" in result.stdout
    # make lint (ruff, mypy) first
    assert result.stdout.index("-m mypy") < result.stdout.index("-m pytest")


def test_llama_cpp_wheel_is_built_once_and_installed_from_the_cache(tmp_path):
    """`make install` builds llama-cpp-python from its sdist only when WHEELS has no wheel of
    that version, and installs the cached wheel (never a build from PyPI's sdist)."""
    result = make("-n", "llama-cpp", f"WHEELS={tmp_path}")
    assert f"--no-deps --no-binary :all: -d {tmp_path} \\\n    llama-cpp-python==0.3.36" in result.stdout
    assert f"pip wheel -q --no-deps -w {tmp_path}" in result.stdout
    assert f"pip install -q --find-links {tmp_path} --only-binary llama-cpp-python" in result.stdout
    install = make("-n", "-W", "setup.cfg", "test-deps", f"WHEELS={tmp_path}").stdout
    assert f"--find-links {tmp_path} --only-binary llama-cpp-python" in install


def test_demo_installs_only_what_the_demo_trains_with():
    """`make demo` (and `make install`): PyTorch, then lora-lab with its own dependencies; no
    extra, browser, llm-compressor or llama.cpp (`make test` adds those through test-deps)."""
    demo = make("-n", "-W", "setup.cfg", "demo").stdout
    assert "pip install -q -e .\n" in demo
    assert "torch==2.13.0" in demo
    assert demo.strip().endswith("lora-lab demo")
    for needed_by_tests_only in ("[test]", "chromium", "llmcompressor", "llama", "playwright"):
        assert needed_by_tests_only not in demo
    test = make("-n", "-W", "setup.cfg", "test").stdout
    for needed_by_tests in ('-e ".[test]"', "chromium", "llmcompressor==0.14.0.1", "llama-cpp-python"):
        assert needed_by_tests in test
