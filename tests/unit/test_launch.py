"""--gpus N / --engine: engine files, filled-in launch files, the command, clean refusals."""

import dataclasses
import json

import pytest
import yaml
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.config import DEEPSPEED_ENGINES, ENGINES, engine_template, resolve_config
from lora_lab.paths import presets_dir
from lora_lab.run_folder import save_config
from lora_lab.training.launch import (
    check_engine,
    fill_deepspeed_config,
    launch_command,
    launch_env,
    needs_launch,
    write_launch_files,
)
from lora_lab.training.plan import Target, plan_run, read_plan


def config_for(engine="ddp", gpus=2, **flags):
    return resolve_config(
        "24gb",
        flags={
            "model.name": "qwen2.5-7b",
            "data.datasets": ["x"],
            "train.gpus": gpus,
            "train.engine": engine,
            **flags,
        },
    )


def planned(config, run_dir, precision="bf16"):
    """The launcher's plan of `config` on a GPU, with run_dir as its run folder."""
    plan = plan_run(config, Target(gpu_gib=24, cuda=True), for_run=False)
    return dataclasses.replace(plan, run_dir=run_dir, precision=precision)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_a_readable_config_file(engine):
    path = engine_template(engine)
    assert path.parent == presets_dir() / "engines" and path.is_file()
    body = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    if engine in DEEPSPEED_ENGINES:
        zero = body["zero_optimization"]
        assert zero["stage"] == (3 if "zero3" in engine else 2)
        assert ("offload_optimizer" in zero) == engine.endswith("offload")
        assert ("offload_param" in zero) == (engine == "deepspeed-zero3-offload")
    else:
        assert body["distributed_type"] == {"ddp": "MULTI_GPU", "fsdp": "FSDP"}[engine]


@pytest.mark.parametrize("engine", DEEPSPEED_ENGINES)
def test_deepspeed_file_takes_batch_and_precision_from_the_run(engine, tmp_path):
    config = config_for(engine, gpus=4, **{"train.micro_batch_size": 2, "train.grad_accum": 8})
    accelerate = yaml.safe_load(write_launch_files(planned(config, tmp_path)).read_text())
    filled = json.loads((tmp_path / "launch" / "deepspeed.json").read_text())
    assert filled["train_micro_batch_size_per_gpu"] == 2
    assert filled["gradient_accumulation_steps"] == 8
    assert filled["train_batch_size"] == 2 * 8 * 4
    assert filled["gradient_clipping"] == config.train.max_grad_norm
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert accelerate["distributed_type"] == "DEEPSPEED" and accelerate["num_processes"] == 4
    assert accelerate["deepspeed_config"]["deepspeed_config_file"].endswith("deepspeed.json")
    assert "mixed_precision" not in accelerate  # accelerate takes it from the DeepSpeed file
    assert fill_deepspeed_config({}, config, "fp16")["fp16"]["enabled"] is True


def test_ddp_and_fsdp_files_are_filled_in_and_the_run_config_saved(tmp_path):
    config = config_for("fsdp", gpus=2)
    plan = planned(config, tmp_path)
    accelerate = yaml.safe_load(write_launch_files(plan).read_text())
    assert accelerate["num_processes"] == 2 and accelerate["mixed_precision"] == "bf16"
    assert accelerate["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Qwen2DecoderLayer"
    again = resolve_config("24gb", str(tmp_path / "launch" / "run_config.yaml"))
    assert again.to_dict() == plan.config.to_dict() and again.sources == plan.config.sources
    assert again.model.dtype == "bf16" and again.sources["model.dtype"] == "auto (GPU)"  # settled once


def test_a_worker_reads_back_the_plan_its_launcher_wrote(tmp_path):
    """The launch file is the plan: read_plan (what each worker trains with) gives it back whole."""
    plan = planned(config_for("deepspeed-zero3", gpus=4, **{"train.micro_batch_size": 2}), tmp_path)
    write_launch_files(plan)
    worker = read_plan(tmp_path / "launch" / "run_config.yaml")
    assert worker == plan
    assert worker.model.config_json == plan.model.config_json and worker.model.model_type == "qwen2"
    assert (worker.engine, worker.precision, worker.fast_lora) == ("deepspeed-zero3", "bf16", False)


def test_launch_command_relaunches_lora_lab_run_with_the_saved_config(tmp_path):
    config = config_for("ddp", gpus=2)
    command = launch_command(config, tmp_path, tmp_path / "launch" / "accelerate.yaml", 29555)
    text = " ".join(command)
    assert "-m accelerate.commands.launch --config_file" in text
    assert "--num_processes 2 --main_process_port 29555 --module lora_lab.training.worker --config" in text
    assert text.endswith(f"--config {tmp_path}/launch/run_config.yaml")


@pytest.mark.parametrize("engine", ["deepspeed-zero2-offload", "deepspeed-zero3-offload"])
def test_offload_workers_get_their_share_of_the_cores_for_the_cpu_optimizer(engine):
    assert launch_env(config_for(engine, gpus=2), {}, cpus=32)["OMP_NUM_THREADS"] == "16"
    assert launch_env(config_for(engine, gpus=8), {}, cpus=4)["OMP_NUM_THREADS"] == "1"
    # what the user set stays; engines without a CPU optimizer keep torchrun's default
    assert launch_env(config_for(engine), {"OMP_NUM_THREADS": "3"}, 32)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in launch_env(config_for("deepspeed-zero3"), {}, cpus=32)


def test_fsdp_workers_get_expandable_segments_unless_the_user_chose_an_allocator():
    assert launch_env(config_for("fsdp", gpus=2), {})["PYTORCH_CUDA_ALLOC_CONF"] == ("expandable_segments:True")
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert launch_env(config_for("fsdp", gpus=2), mine)["PYTORCH_CUDA_ALLOC_CONF"] == ("max_split_size_mb:512")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in launch_env(config_for("deepspeed-zero3", gpus=2), {})


def test_only_several_gpus_or_an_engine_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not needs_launch(config_for("ddp", gpus=1))
    assert needs_launch(config_for("ddp", gpus=2))
    assert needs_launch(config_for("deepspeed-zero3-offload", gpus=1))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not needs_launch(config_for("ddp", gpus=2))  # a worker trains, never relaunches


def test_deepspeed_missing_is_a_clean_error_naming_pip_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(Exception, match="pip install deepspeed"):
        check_engine(config_for("deepspeed-zero2"), cuda_gpus=2)
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--data",
            "self-cognition",
            "--model-name",
            "A",
            "--model-author",
            "B",
            "--gpus",
            "2",
            "--engine",
            "deepspeed-zero2",
        ],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--engine deepspeed-zero2 needs DeepSpeed" in result.output
    assert "pip install deepspeed" in result.output


@pytest.mark.parametrize(
    "engine,cuda,message",
    [
        ("fsdp", 0, "--engine fsdp needs CUDA GPUs; this machine has none"),
        ("ddp", 2, "--gpus 3: this machine has 2 CUDA GPU(s)"),
    ],
)
def test_engines_the_machine_cannot_run_are_refused(engine, cuda, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_engine(config_for(engine, gpus=3), cuda_gpus=cuda)


def test_unknown_engine_names_the_flag():
    result = CliRunner().invoke(main, ["run", "--data", "x", "--engine", "zero2"])
    assert result.exit_code == 2 and "--engine zero2: must be one of auto, ddp," in result.output


def test_a_saved_config_yaml_given_as_config_resolves_to_the_same_run(tmp_path):
    config = config_for("ddp", gpus=2, **{"lora.rank": 32})
    save_config(config, tmp_path / "config.yaml")
    again = resolve_config("24gb", str(tmp_path / "config.yaml"), flags={"train.seed": 3})
    assert again.sources["train.gpus"] == "--gpus" and again.sources["lora.rank"] == "--lora-rank"
    assert again.sources["train.seed"] == "--seed" and again.train.seed == 3
    assert "train.weight_decay" not in again.sources  # a default stays a default


@pytest.mark.parametrize(
    "gpus,engine", [(4, "deepspeed-zero2-offload"), (4, "deepspeed-zero3"), (8, "deepspeed-zero3"), (8, "fsdp")]
)
def test_dry_run_writes_the_launch_for_4_and_8_gpus_and_plans_per_gpu(tmp_path, gpus, engine):
    """The full launch for a machine this one is not (no GPU here), nothing trains."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"query": "q", "response": "r"}\n')
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--preset",
            "24gb",
            "--model",
            "qwen2.5-7b",
            "--data",
            str(data),
            "--tuner",
            "full",
            "--gpus",
            str(gpus),
            "--engine",
            engine,
            "--grad-accum",
            "4",
            "--max-length",
            "2048",
            "--set",
            "data.packing=false",
            "--output-dir",
            str(tmp_path / "out"),
            "--run-name",
            "dry",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    launch = tmp_path / "out" / "dry" / "launch"
    accelerate = yaml.safe_load((launch / "accelerate.yaml").read_text())
    assert accelerate["num_processes"] == gpus
    assert f"--num_processes {gpus}" in result.output
    assert f"per GPU of {gpus}, engine {engine}" in result.output
    if engine.startswith("deepspeed"):
        filled = json.loads((launch / "deepspeed.json").read_text())
        assert filled["train_batch_size"] == 1 * 4 * gpus and filled["bf16"]["enabled"]
    assert not (tmp_path / "out" / "dry" / "adapter").exists()
    assert not (tmp_path / "out" / "dry" / "model").exists()


def test_dry_run_with_engine_auto_picks_the_engine_that_fits_the_tier(tmp_path):
    """--preset 24gb --gpus 8 --engine auto for 7B full fine-tuning: planned against 24 GiB."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"query": "q", "response": "r"}\n')
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--preset",
            "24gb",
            "--model",
            "qwen2.5-7b",
            "--data",
            str(data),
            "--tuner",
            "full",
            "--gpus",
            "8",
            "--grad-accum",
            "4",
            "--max-length",
            "2048",
            "--set",
            "data.packing=false",
            "--output-dir",
            str(tmp_path / "out"),
            "--run-name",
            "dry",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "--engine auto: deepspeed-zero2-offload for 8 GPUs (24.0 GiB per GPU): about" in result.output
    assert "does not fit: ddp" in result.output
    saved = yaml.safe_load((tmp_path / "out" / "dry" / "launch" / "run_config.yaml").read_text())
    assert saved["train"]["engine"] == "deepspeed-zero2-offload"
    assert (tmp_path / "out" / "dry" / "launch" / "deepspeed.json").is_file()


def test_fsdp_workers_keep_an_allocator_set_by_the_unified_variable():
    mine = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in launch_env(config_for("fsdp", gpus=2), mine)


@pytest.mark.parametrize(
    "environ, release, applied",
    [
        ({}, "6.8.0-87-generic", True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "6.8.0-87-generic", False),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, "6.8.0-87-generic", False),
        ({}, "5.15.167.4-microsoft-standard-WSL2", False),  # WSL 2, Docker on it included
        ({"WSL_DISTRO_NAME": "Ubuntu"}, "6.8.0-87-generic", False),
    ],
)
def test_expandable_segments_unless_the_user_chose_or_the_driver_lacks_them(monkeypatch, environ, release, applied):
    import os

    import torch

    from lora_lab import device

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "WSL_DISTRO_NAME", "WSL_INTEROP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(("Linux", "h", release, "", "")))
    settings = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", settings.append)
    assert device.use_expandable_segments(True) is applied
    assert settings == (["expandable_segments:True"] if applied else [])
    assert device.use_expandable_segments(False) is False
