"""The pure parts of `lora-lab ui`: the run's argument list from the form, the allowed folders,
the access token, what the run's own files say, and the length histogram."""

import json
import os
import socket
import sys
import time

import pytest

from lora_lab.errors import LoraLabError
from lora_lab.run_folder.names import LOCK_FILE
from lora_lab.ui.actions import config_flags, histogram
from lora_lab.ui.form import (
    AllowedFolders,
    RunForm,
    new_token,
    reachable_from_elsewhere,
    resume_arguments,
    run_arguments,
    token_matches,
)
from lora_lab.ui.runs import RunProcess, can_resume, find_runs, is_lora_lab_run, live_figures, run_state, stop_run


def test_the_form_becomes_one_argument_per_flag_and_value():
    form = RunForm(
        model="qwen2.5-0.5b",
        data=["a.jsonl", "", " b.jsonl#3 "],
        preset="auto",
        lora_rank="16",
        lr="1e-4",
        max_steps="40",
        qlora=True,
        output_dir="out",
        run_name="r",
        sets=["lora.dropout=0", " "],
    )
    assert run_arguments(form, "16gb") == [
        sys.executable,
        "-m",
        "lora_lab",
        "run",
        "--preset",
        "16gb",
        "--model",
        "qwen2.5-0.5b",
        "--data",
        "a.jsonl",
        "--data",
        "b.jsonl#3",
        "--lora-rank",
        "16",
        "--lr",
        "1e-4",
        "--max-steps",
        "40",
        "--output-dir",
        "out",
        "--run-name",
        "r",
        "--quantization",
        "nf4",
        "--set",
        "lora.dropout=0",
        "--set",
        "model.trust_remote_code=false",  # every run from the page: no model code
    ]


def test_a_value_with_shell_characters_stays_one_argument():
    form = RunForm(model="m", data=["x.jsonl; rm -rf ~ && echo $(id)"], run_name="a b")
    argv = run_arguments(form, "cpu")
    assert argv[argv.index("--data") + 1] == "x.jsonl; rm -rf ~ && echo $(id)"
    assert argv[argv.index("--run-name") + 1] == "a b"


def test_the_form_flags_are_the_config_keys_of_lora_lab_run():
    form = RunForm(
        model="m",
        data=["d.jsonl"],
        micro_batch_size="2",
        grad_accum="8",
        epochs="1",
        lora_alpha="32",
        max_length="1024",
    )
    assert config_flags(form) == {
        "model.name": "m",
        "data.datasets": ["d.jsonl"],
        "lora.alpha": "32",
        "data.max_length": "1024",
        "train.micro_batch_size": "2",
        "train.grad_accum": "8",
        "train.epochs": "1",
        "train.output_dir": "output",
    }


@pytest.mark.parametrize(
    "form, message",
    [
        (RunForm(model=" ", data=["d.jsonl"]), "model: choose a model"),
        (RunForm(model="m", data=["", " "]), "data: give at least one data file"),
        (RunForm(model="m", data=["d"], sets=["--config=/etc/passwd"]), "'--config=/etc/passwd' is not KEY=VALUE"),
        (RunForm(model="m", data=["d"], sets=["train.lr"]), "'train.lr' is not KEY=VALUE"),
    ],
)
def test_a_form_without_model_or_data_or_with_a_bad_set_line_is_refused(form, message):
    with pytest.raises(LoraLabError, match=message):
        run_arguments(form, "cpu")


def test_resume_continues_a_run_with_its_own_config(tmp_path):
    assert resume_arguments(tmp_path / "r") == [
        sys.executable,
        "-m",
        "lora_lab",
        "run",
        "--config",
        str(tmp_path / "r" / "config.yaml"),
        "--resume",
        str(tmp_path / "r"),
        "--set",
        "model.trust_remote_code=false",
    ]


def test_paths_outside_the_allowed_folders_are_refused(tmp_path):
    inside, outside = tmp_path / "work", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    (inside / "d.jsonl").write_text("{}\n")
    (outside / "secret.jsonl").write_text("{}\n")
    (inside / "link.jsonl").symlink_to(outside / "secret.jsonl")
    allowed = AllowedFolders([inside])
    assert allowed.check_data(f"{inside}/d.jsonl#8") == f"{inside}/d.jsonl#8"
    assert allowed.check(inside / "output", "output folder") == inside / "output"
    for escape in (outside / "secret.jsonl", inside / ".." / "elsewhere" / "secret.jsonl", inside / "link.jsonl"):
        with pytest.raises(
            LoraLabError,
            match=r"data: .* is outside the folders this page may "
            r"use .*--allow DIR",
        ):
            allowed.check_data(str(escape))
    with pytest.raises(LoraLabError, match="data: .* is not a file"):
        allowed.check_data(str(inside / "missing.jsonl"))


def test_a_model_alias_passes_and_a_model_path_must_be_allowed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    allowed = AllowedFolders([tmp_path])
    assert allowed.check_model("qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert allowed.check_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert allowed.check_model("./models/tiny") == "./models/tiny"
    for path in ("/etc", "~/model.gguf", "../other/model"):
        with pytest.raises(LoraLabError, match="model: .* is outside the folders"):
            allowed.check_model(path)


def test_only_a_loopback_host_is_out_of_other_machines_reach():
    assert [reachable_from_elsewhere(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2")] == [False] * 4
    assert [reachable_from_elsewhere(h) for h in ("0.0.0.0", "192.168.1.20", "::", "gpu-box")] == [True] * 4


def test_the_token_must_match_exactly():
    token = new_token()
    assert len(token) >= 32 and token != new_token()
    assert token_matches(token, token)
    assert not token_matches(token[:-1], token)
    assert not token_matches("", token) and not token_matches(None, token)


EVENTS = [
    {"step": 1, "loss": 12.5, "grad_norm": 3.0, "learning_rate": 0.002, "tokens_per_second": 120.0, "epoch": 0.1},
    {
        "step": 5,
        "loss": 9.25,
        "learning_rate": 0.01,
        "tokens_per_second": 150.4,
        "gpu_memory_gib": 1.0,
        "gpu_peak_memory_gib": 1.5,
    },
    {"step": 5, "eval_loss": 9.5, "eval_runtime": 0.1},
    {"step": 10, "train_runtime": 9.0, "train_loss": 10.0},
]
CONSOLE = (
    "loading\nstep 1/10 · loss 12.500 · lr 2.0e-03 · 120 tok/s · ETA 1m 05s\n"
    "step 5/10 · loss 9.250 · lr 1.0e-02 · 150 tok/s · ETA 12s · GPU 1.5 GiB\n"
    "step 5/10 · eval loss 9.500\n"
)


def test_the_live_figures_come_from_the_step_log_and_the_progress_line():
    figures = live_figures(EVENTS, CONSOLE)
    assert figures.losses == [(1, 12.5, "train loss"), (5, 9.25, "train loss"), (5, 9.5, "eval loss")]
    assert (figures.step, figures.total_steps, figures.eta) == (10, 10, None)  # eval: no ETA
    assert figures.line() == ("step 10/10 · loss 9.2500 · eval loss 9.5000 · lr 0.01 · tok/s 150 · GPU GiB 1.50")
    running = live_figures(EVENTS[:2], CONSOLE.splitlines()[1])
    assert (running.step, running.total_steps, running.eta) == (5, 10, "1m 05s")
    assert live_figures([], "").line() == "step 0"


def test_the_length_histogram_counts_every_sample():
    assert histogram([10, 11, 12, 20, 33], bins=3) == [(10, 3), (18, 1), (26, 1)]
    assert histogram([39] * 8) == [(39, 8)]
    assert histogram([]) == []


def test_the_run_state_is_read_from_the_run_folder(tmp_path):
    run = tmp_path / "r"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    assert run_state(run) == "not started" and not can_resume(run)
    (run / "checkpoint-5").mkdir()
    assert run_state(run) == "incomplete" and can_resume(run)
    (run / "logs" / "stopped.json").write_text(json.dumps({"signal": 15, "step": 5}))
    assert run_state(run) == "stopped"
    (run / "run_summary.json").write_text("{}")
    assert run_state(run) == "finished" and not can_resume(run)
    assert find_runs([tmp_path, tmp_path / "missing"]) == [run]


def test_a_run_process_takes_an_argument_list_and_stops_with_sigterm(tmp_path):
    with pytest.raises(TypeError, match="never a shell string"):
        RunProcess("lora-lab run --model m", tmp_path)
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
        "print('up' * 2, flush=True); time.sleep(60)"
    )
    process = RunProcess([sys.executable, "-c", code], tmp_path)
    console = tmp_path / "logs" / "console.log"
    while "upup" not in console.read_text():  # its handler is set
        assert process.running
    assert os.getpgid(process.process.pid) == process.process.pid  # a process group of its own
    process.stop()
    assert process.wait(30) == 7 and not process.running
    assert run_state(tmp_path, process.process) == "failed (exit status 7)"
    assert console.read_text().startswith(f"$ {sys.executable} -c import signal")
    with pytest.raises(LoraLabError, match="is not running"):
        process.stop()


def test_a_run_started_elsewhere_is_seen_running_and_stopped_through_its_lock(tmp_path):
    import socket
    import subprocess

    run = tmp_path / "r"
    run.mkdir()
    # a process whose command line is `python -m lora_lab run` (what a lock of a real run names)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "lora_lab", "run"])
    deadline = time.monotonic() + 10
    while not is_lora_lab_run(sleeper.pid):  # /proc shows the command line once exec is done
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (run / LOCK_FILE).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": "now"}))
    assert run_state(run) == "running"
    stop_run(run)
    assert sleeper.wait(30) == -15  # SIGTERM
    assert run_state(run) == "not started" and (run / LOCK_FILE).is_file()  # left as it was
    with pytest.raises(LoraLabError, match="no run of this machine is writing into it"):
        stop_run(run)


def test_the_page_says_who_can_reach_it(tmp_path):
    from lora_lab.ui import safety_note

    allowed = AllowedFolders([tmp_path])
    assert safety_note("127.0.0.1", None, allowed) == (
        f"Bound to 127.0.0.1: reachable from this machine only, by every account of it. "
        f"Files: only under `{tmp_path}` (`lora-lab ui --allow DIR`)."
    )
    assert safety_note("0.0.0.0", "t", allowed).startswith(
        "Bound to 0.0.0.0: reachable from other machines, after the token. Files: only under"
    )


def test_the_page_has_a_token_unless_told_no_token_on_loopback(tmp_path, monkeypatch):
    from lora_lab.ui import page_token

    monkeypatch.delenv("LORA_LAB_UI_TOKEN", raising=False)
    token, new = page_token("127.0.0.1", None, None, no_token=False)
    assert new and len(token) >= 32
    assert page_token("127.0.0.1", None, None, no_token=True) == (None, False)
    (tmp_path / "t").write_text("from-a-file\n")
    assert page_token("0.0.0.0", None, str(tmp_path / "t"), no_token=False) == ("from-a-file", False)
    monkeypatch.setenv("LORA_LAB_UI_TOKEN", "from-the-environment")
    assert page_token("localhost", None, None, no_token=False) == ("from-the-environment", False)
    with pytest.raises(LoraLabError, match=r"^--no-token: a token was given as well"):
        page_token("127.0.0.1", None, None, no_token=True)


def test_no_token_is_refused_off_loopback_in_one_line():
    from click.testing import CliRunner

    from lora_lab.cli import main

    result = CliRunner().invoke(main, ["ui", "--host", "0.0.0.0", "--no-token"])
    assert result.exit_code == 2
    assert result.output == (
        "error: --no-token: the page on --host 0.0.0.0 could be used from other machines without a token; "
        "drop --no-token (a token is made and printed), or serve on 127.0.0.1.\n"
    )


def test_the_login_link_names_the_address_a_browser_opens():
    from lora_lab.ui.guard import login_link

    assert login_link("127.0.0.1", 7860, "a b") == "http://127.0.0.1:7860/?token=a+b"
    assert login_link("::1", 7860, "t") == "http://[::1]:7860/?token=t"
    assert login_link("0.0.0.0", 80, "t") == f"http://{socket.gethostname()}:80/?token=t"


def test_ui_refuses_a_missing_allowed_folder_in_one_line(tmp_path):
    from click.testing import CliRunner

    from lora_lab.cli import main

    result = CliRunner().invoke(main, ["ui", "--allow", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.output == f"error: --allow {tmp_path / 'nope'}: no such folder.\n"


def test_a_planted_lock_naming_another_process_is_not_obeyed(tmp_path):
    import socket
    import subprocess

    run = tmp_path / "r"
    run.mkdir()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / LOCK_FILE).write_text(json.dumps({"pid": victim.pid, "host": socket.gethostname(), "started": "x"}))
        with pytest.raises(LoraLabError, match=f"names process {victim.pid}, which is not a `lora-lab run`"):
            stop_run(run)
        time.sleep(0.2)
        assert victim.poll() is None  # not signalled
    finally:
        victim.kill()
        victim.wait(30)
