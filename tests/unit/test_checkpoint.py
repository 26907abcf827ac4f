"""Checkpoints: visible only when complete, checked against their manifest, rotated safely."""

import json
import pickle

import pytest
import torch

from lora_lab.config import resolve_config
from lora_lab.errors import CheckpointError
from lora_lab.run_folder import trim_step_log
from lora_lab.training.checkpoint import (
    MANIFEST_NAME,
    REQUIRED_FILES,
    checkpoint_problems,
    commit_checkpoint,
    config_drift,
    find_resume_checkpoint,
    remove_leftovers,
    resolve_resume,
    rotate_checkpoints,
    staging_dir,
    unsafe_pickles,
    write_manifest,
)


def make_checkpoint(run_dir, step, commit=True):
    """A checkpoint with every required file (tiny stand-ins), staged and optionally committed."""
    staging = staging_dir(run_dir, step)
    staging.mkdir(parents=True)
    for name in REQUIRED_FILES:
        path = staging / name
        if name.endswith((".pt", ".pth")):
            torch.save({"step": step, "state": torch.arange(4.0)}, path)
        else:
            path.write_text(json.dumps({"step": step}))
    if not commit:
        return staging
    write_manifest(staging, step, {"samples": 3, "sha256": "ab"})
    return commit_checkpoint(staging, run_dir / f"checkpoint-{step}")


def test_commit_makes_a_complete_checkpoint_with_a_manifest(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    assert folder.name == "checkpoint-4" and not staging_dir(tmp_path, 4).exists()
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == set(REQUIRED_FILES) and manifest["step"] == 4
    assert checkpoint_problems(folder) == []


def test_an_unfinished_save_is_invisible_and_cleaned_up(tmp_path, capsys):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, commit=False)  # killed before the manifest and the rename
    assert find_resume_checkpoint(tmp_path).name == "checkpoint-2"
    assert capsys.readouterr().out == ""
    assert remove_leftovers(tmp_path) == [staging_dir(tmp_path, 4)]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]


def test_a_save_killed_between_manifest_and_rename_is_recovered(tmp_path):
    staging = make_checkpoint(tmp_path, 6, commit=False)
    write_manifest(staging, 6, None)  # complete, but the process died before the rename
    assert remove_leftovers(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-6"]
    assert checkpoint_problems(tmp_path / "checkpoint-6") == []


@pytest.mark.parametrize(
    "damage,expected",
    [
        ("no_manifest", "manifest.json is missing: the save did not finish"),
        ("truncated", "adapter_model.safetensors is 5 bytes; the manifest says"),
        ("missing_file", "rng_state.pth is missing"),
        ("checksum", "optimizer.pt: sha256 does not match the manifest"),
    ],
)
def test_auto_resume_skips_broken_checkpoints_and_names_the_file(tmp_path, damage, expected, capsys):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    if damage == "no_manifest":
        (newest / MANIFEST_NAME).unlink()
    elif damage == "truncated":
        (newest / "adapter_model.safetensors").write_bytes(b"{...}")
    elif damage == "missing_file":
        (newest / "rng_state.pth").unlink()
    else:  # one flipped byte, same size
        data = bytearray((newest / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "optimizer.pt").write_bytes(bytes(data))
    assert resolve_resume("auto", tmp_path).name == "checkpoint-2"
    warnings = capsys.readouterr().out.splitlines()
    assert len(warnings) == 1 and "checkpoint-4" in warnings[0] and expected in warnings[0]
    with pytest.raises(CheckpointError, match="cannot resume from this checkpoint"):
        resolve_resume(str(newest), tmp_path)


def test_auto_resume_without_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    assert resolve_resume("auto", tmp_path / "new-run") is None
    said = capsys.readouterr().out
    assert "no complete checkpoint" in said and "starting a new run" in said


def test_resume_path_can_be_a_run_folder(tmp_path):
    (tmp_path / "config.yaml").write_text("preset: cpu\n")
    make_checkpoint(tmp_path, 3)
    assert resolve_resume(str(tmp_path), tmp_path).name == "checkpoint-3"
    with pytest.raises(CheckpointError, match="not a checkpoint-N folder or a run folder"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)


def test_rotation_keeps_the_newest_and_deletes_only_complete_older_ones(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    broken = tmp_path / "checkpoint-1"
    broken.mkdir()
    newest = make_checkpoint(tmp_path, 8)
    deleted = rotate_checkpoints(tmp_path, 2, newest)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-6", "checkpoint-8"]
    rotate_checkpoints(tmp_path, 1, newest, keep=(tmp_path / "checkpoint-6",))  # a "best" one
    assert (tmp_path / "checkpoint-6").is_dir() and (tmp_path / "checkpoint-8").is_dir()


def test_recommitting_a_step_replaces_the_old_checkpoint(tmp_path):
    old = make_checkpoint(tmp_path, 4)
    (old / "adapter_config.json").write_text("stale")  # e.g. a corrupt copy from a crashed run
    remove_leftovers(tmp_path)
    staging = staging_dir(tmp_path, 4)
    staging.mkdir()
    (staging / "adapter_config.json").write_text("fresh")
    commit_checkpoint(staging, tmp_path / "checkpoint-4")
    assert (tmp_path / "checkpoint-4" / "adapter_config.json").read_text() == "fresh"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-4"]


class _Payload:
    """Unpickling this would create a file: what a malicious state file does."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.mark.parametrize("name", ["rng_state.pth", "training_args.bin"])
def test_a_pickled_payload_is_refused_without_running(tmp_path, name):
    folder = make_checkpoint(tmp_path, 2)
    marker = tmp_path / "pwned"
    with open(folder / name, "wb") as handle:
        pickle.dump({"python": _Payload(marker)}, handle)
    write_manifest(folder, 2, None)  # an attacker can rewrite the manifest too
    problems = checkpoint_problems(folder)
    assert len(problems) == 1 and name in problems[0] and "weights_only=True" in problems[0]
    assert unsafe_pickles(folder) == problems
    assert not marker.exists()


def test_drift_lists_every_changed_setting():
    saved = resolve_config("cpu", flags={"data.datasets": ["a.jsonl"], "lora.rank": 4})
    same = resolve_config(
        "cpu", flags={"data.datasets": ["a.jsonl"], "lora.rank": 4, "train.lr": 1e-3, "train.max_steps": 50}
    )
    assert config_drift(saved, same) == []  # learning rate and length may change on resume
    other = resolve_config(
        "cpu",
        flags={
            "data.datasets": ["b.jsonl"],
            "lora.rank": 8,
            "model.name": "qwen2.5-1.5b",
            "data.max_length": 256,
            "train.micro_batch_size": 2,
            "train.grad_accum": 8,
        },
    )
    changed = [line.split()[0].rstrip(":") for line in config_drift(saved, other)]
    assert changed == [
        "model.name",
        "lora.rank",
        "data.datasets",
        "data.max_length",
        "train.micro_batch_size",
        "train.grad_accum",
    ]
    alias = resolve_config(
        "cpu", flags={"data.datasets": ["a.jsonl"], "lora.rank": 4, "model.name": "Qwen/Qwen2.5-0.5B-Instruct"}
    )
    assert config_drift(saved, alias) == []  # the same model, spelled as its hub id


def test_step_log_is_trimmed_to_the_resumed_step(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text(
        "".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo'
    )  # the line the kill cut short
    trim_step_log(log, 3)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]


def _checkpoint_with(run_dir, step, names):
    staging = staging_dir(run_dir, step)
    staging.mkdir(parents=True)
    for name in names:
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith((".pt", ".pth")):
            torch.save({"step": step}, staging / name)
        else:
            (staging / name).write_text("{}")
    write_manifest(staging, step, None)
    return commit_checkpoint(staging, run_dir / f"checkpoint-{step}")


def test_full_fine_tuning_and_engine_checkpoints_are_complete_in_their_own_layout(tmp_path):
    state = ["trainer_state.json", "scheduler.pt"]
    full = _checkpoint_with(
        tmp_path, 1, ["config.json", "model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", *state]
    )
    assert checkpoint_problems(full) == []
    sharded = _checkpoint_with(
        tmp_path,
        2,
        [
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "latest",
            "rng_state.pth",
            *state,
        ],
    )
    assert checkpoint_problems(sharded) == []  # DeepSpeed: latest + global_stepN/, no optimizer.pt
    missing = _checkpoint_with(tmp_path, 3, ["config.json", "rng_state.pth", *state])
    assert {p.rsplit("/", 1)[-1] for p in checkpoint_problems(missing)} == {
        "model.safetensors is missing from the manifest",
        "optimizer.pt is missing from the manifest (no optimizer state: a checkpoint saved with "
        "train.save_only_model=true has the weights only, and a run cannot resume from it)",
    }


def test_a_weights_only_checkpoint_is_refused_for_resume_with_the_reason(tmp_path):
    staging = staging_dir(tmp_path, 3)
    staging.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json"):
        (staging / name).write_text("{}")
    write_manifest(staging, 3, None)
    folder = commit_checkpoint(staging, tmp_path / "checkpoint-3")
    problems = checkpoint_problems(folder)
    assert any("train.save_only_model=true" in p and "cannot resume" in p for p in problems)
    assert problems[0].endswith(
        "optimizer.pt is missing from the manifest (no optimizer state: "
        "a checkpoint saved with train.save_only_model=true has the "
        "weights only, and a run cannot resume from it)"
    )
    with pytest.raises(CheckpointError, match="save_only_model"):
        resolve_resume(str(folder), tmp_path)


def _full_7b(**sets):
    flags = {
        "model.name": "qwen2.5-7b",
        "data.datasets": ["x"],
        "train.tuner": "full",
        "train.gpus": 2,
        "train.engine": "deepspeed-zero3-offload",
        "train.output_dir": "/tmp/out",
    }
    return resolve_config("24gb", flags=flags, sets=[f"{k}={v}" for k, v in sets.items()])


def test_checkpoint_sizes_follow_the_tuner_engine_and_save_only_model():
    from lora_lab.planning.disk import checkpoint_sizes
    from lora_lab.registry import known_model_config

    qwen7b = known_model_config("7b")
    params = 7_615_616_512  # Qwen2.5-7B, untied embedding and head
    weights, optimizer, final = checkpoint_sizes(_full_7b(), qwen7b)
    assert (weights, optimizer, final) == (2 * params, 12 * params, 2 * params)
    weights, optimizer, _ = checkpoint_sizes(_full_7b(**{"train.engine": "ddp"}), qwen7b)
    assert (weights, optimizer) == (4 * params, 8 * params)
    lora = resolve_config("24gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"]})
    weights, optimizer, final = checkpoint_sizes(lora, qwen7b)
    assert weights == final == 4 * 20_185_088 and optimizer == 8 * 20_185_088  # rank 8 LoRA


def test_a_run_that_would_fill_the_disk_is_refused_before_training(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from lora_lab.errors import LoraLabError
    from lora_lab.planning.disk import check_disk_space

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(128e9, 60e9, 68e9))
    # 3 saves of 15.2 GB weights + 91.4 GB optimizer state, all three on disk while the third
    # is written (save_total_limit 2, then the oldest goes), plus the final model
    with pytest.raises(LoraLabError) as refused:
        check_disk_space(_full_7b(), tmp_path / "new" / "run", total_steps=300)
    message = str(refused.value)
    assert (
        "this run writes about 335 GB (up to 3 checkpoint(s) of 106.6 GB and the final model of 15.2 GB)" in message
        and "has 68 GB free" in message
    )
    assert "--set train.save_total_limit=1: 229 GB" in message  # with 3 x 13 MB of side files
    assert "--set train.save_only_model=true: 61 GB" in message
    assert "--set train.disk_check=false" in message
    check_disk_space(_full_7b(**{"train.save_only_model": "true"}), tmp_path, total_steps=300)
    check_disk_space(_full_7b(**{"train.disk_check": "false"}), tmp_path, total_steps=300)
