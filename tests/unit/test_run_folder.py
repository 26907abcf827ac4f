"""The run folder's lock, and the disk check's count of what a save writes."""

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest

from lora_lab.config import resolve_config
from lora_lab.errors import LoraLabError
from lora_lab.planning.disk import TOKENIZER_BYTES_UNKNOWN, check_disk_space, tokenizer_bytes
from lora_lab.run_folder.names import LOCK_FILE
from lora_lab.training.lock import run_lock
from tests.support.tiny import TOKENIZER_DIR


def test_a_second_run_into_a_held_folder_stops_and_names_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    with run_lock(run_dir):
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with (
            pytest.raises(
                LoraLabError,
                match=rf"another run is writing into {run_dir} \(pid "
                rf"{os.getpid()} on ",
            ),
            run_lock(run_dir),
        ):
            pass
    assert not run_dir.exists()  # created for the run, empty again: removed


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, capsys):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("x")
    import socket

    (run_dir / LOCK_FILE).write_text(
        json.dumps({"pid": int(dead.stdout), "started": "then", "host": socket.gethostname()})
    )
    with run_lock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "is gone; taking it over" in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == ["keep.txt"]


def test_the_disk_check_counts_the_tokenizer_files_every_save_writes(tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(TOKENIZER_DIR, model)
    (model / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            }
        )
    )
    expected = sum(
        (model / n).stat().st_size
        for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
        if (model / n).is_file()
    )
    assert tokenizer_bytes(str(model)) == expected > 5_000_000
    assert tokenizer_bytes("Qwen/Qwen2.5-7B-Instruct") == TOKENIZER_BYTES_UNKNOWN
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1e9, 0, 15e6))  # a 15 MB disk
    config = resolve_config("cpu", flags={"model.name": str(model), "data.datasets": ["x"]})
    with pytest.raises(LoraLabError, match=r"this run writes about \d+ MB .* has 15 MB free"):
        check_disk_space(config, tmp_path / "run", total_steps=10)


def test_a_converted_gguf_folder_gives_a_short_run_name():
    from lora_lab.config import RunConfig
    from lora_lab.run_folder import default_run_name

    name = "/c/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m-76eebd29defcf988"
    config = RunConfig(preset="cpu").with_changes({"model.name": name}, "test")
    assert default_run_name(config).startswith("qwen2.5-coder-0.5b-instruct-q4_k_m-cpu-2")


@pytest.mark.parametrize(
    "saved,requested,expected",
    [
        ("fp32", None, ("fp32", "the run's training precision")),
        ("bf16", None, ("bf16", "the run's training precision")),
        ("fp32", "bf16", ("bf16", "--dtype")),
        (
            "auto",
            None,
            (
                "bf16",
                "default: the run folder does not record its training precision; "
                "--dtype fp32 merges in full precision",
            ),
        ),
    ],
)
def test_merge_dtype_follows_the_precision_the_run_recorded(tmp_path, saved, requested, expected):
    from lora_lab.run_folder import save_config, training_precision
    from lora_lab.use.merge import choose_merge_dtype

    config = resolve_config("cpu", flags={"data.datasets": ["d.jsonl"], "model.dtype": saved})
    save_config(config, tmp_path / "config.yaml")
    assert training_precision(tmp_path) == (None if saved == "auto" else saved)
    assert choose_merge_dtype(requested, tmp_path) == expected
    assert choose_merge_dtype(None, None)[0] == "bf16"  # an adapter folder without its run


def test_the_run_folder_names_every_part_of_a_run(tmp_path):
    from lora_lab.run_folder import Checkpoint, RunFolder, list_checkpoints

    run = RunFolder(tmp_path / "run")
    names = {
        "config": "config.yaml",
        "adapter": "adapter",
        "model": "model",
        "initial_adapter": "adapter_init",
        "step_log": "logs/train_log.jsonl",
        "data_problems": "logs/data_problems.jsonl",
        "console_log": "logs/console.log",
        "stop_record": "logs/stopped.json",
        "plots": "plots",
        "launch": "launch",
        "lock": ".lock",
        "summary": "run_summary.json",
    }
    assert {key: getattr(run, key).relative_to(run.path).as_posix() for key in names} == names
    assert RunFolder.launch_config(run.launch).relative_to(run.path).as_posix() == "launch/run_config.yaml"
    assert not run.is_run
    checkpoint = run.checkpoint(12)
    assert checkpoint == Checkpoint(run.path / "checkpoint-12") and checkpoint.step == 12
    assert (checkpoint.manifest.name, checkpoint.trainer_state.name) == ("manifest.json", "trainer_state.json")
    assert run.staging_checkpoint(12).name == ".staging-checkpoint-12"
    for step in (10, 2):
        run.checkpoint(step).path.mkdir(parents=True)
    run.staging_checkpoint(3).mkdir()
    assert [c.step for c in run.checkpoints()] == [2, 10] and len(list_checkpoints(run.path)) == 2
    assert run.hidden_checkpoints() == [run.staging_checkpoint(3)]
    run.config.write_text("model: {}\n")
    assert run.is_run and not run.checkpoint(2).holds_adapter
