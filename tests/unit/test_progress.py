"""`make test` is quiet (-q), but each real-model test says its name when it starts and its
outcome and time when it ends, on a line of its own (tests/support/progress.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import pytest

def test_fast_one(): pass

@pytest.mark.real_model
def test_slow_one(): pass

@pytest.mark.real_model
def test_slow_two(): assert False

def test_fast_two(): pass
"""


def run_pytest(folder: Path, *args) -> str:
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    real_model: the real model\n")
    (folder / "test_sample.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.support.progress",
            "-p",
            "no:cacheprovider",
            *args,
            "test_sample.py",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout


def test_real_model_tests_say_their_name_and_time_in_quiet_mode(tmp_path):
    lines = run_pytest(tmp_path, "-q").splitlines()
    assert lines[:4] == [
        ".",
        "[real model] test_sample.py::test_slow_one ... . passed in 0 s",
        "[real model] test_sample.py::test_slow_two ... F failed in 0 s",
        lines[3],
    ]
    assert lines[3].startswith(".") and lines[3].endswith("[100%]")


def test_verbose_mode_is_left_as_pytest_writes_it(tmp_path):
    output = run_pytest(tmp_path, "-v")
    assert "[real model]" not in output and "test_sample.py::test_slow_one PASSED" in output


def test_under_two_xdist_workers_each_real_model_test_has_its_line(tmp_path):
    """make test runs two pytest-xdist workers: the tests run there, and this process names each
    real-model test with its outcome and time when it ends."""
    lines = run_pytest(tmp_path, "-q", "-n", "2").splitlines()
    named = sorted(line for line in lines if line.startswith("[real model]"))
    assert named == [
        "[real model] test_sample.py::test_slow_one passed in 0 s",
        "[real model] test_sample.py::test_slow_two failed in 0 s",
    ]
