"""The resolved config is frozen and every derived fact of a run is settled once into its plan
(training/plan.py): planning leaves the config as it was, a retry or a resume makes a new plan."""

import copy
import dataclasses

import pytest
import yaml

import lora_lab
from lora_lab.config import resolve_config
from lora_lab.errors import TrainingError
from lora_lab.models.load import Precision
from lora_lab.training.oom import halved_plan
from lora_lab.training.plan import Target, plan_run, read_plan, write_plan

DATA = {"data.datasets": ["x"]}


def test_a_resolved_config_cannot_be_changed():
    config = resolve_config("24gb", flags=DATA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.micro_batch_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = config.model
    changed = config.with_changes({"lora.rank": 64}, "test")
    assert changed.lora.rank == 64 and changed.sources["lora.rank"] == "test"
    assert config.lora.rank != 64 and "test" not in config.sources.values()


def test_planning_leaves_the_config_as_it_was():
    """lora_lab.plan settles engine auto for 8 GPUs (and the dtype, the packed attention) in its
    plan, never in the caller's config."""
    config = resolve_config(
        "24gb", flags={"model.name": "qwen2.5-7b", "train.gpus": 8, "train.tuner": "full"}, need_data=False
    )
    before = copy.deepcopy(config)
    memory = lora_lab.plan(config)
    assert config == before and config.sources == before.sources
    assert config.train.engine == "auto" and config.model.dtype == "auto"
    settled = plan_run(config, Target.card(24), for_run=False)
    assert settled.engine != "auto" and settled.config.sources["train.engine"] == "auto"
    assert memory.total_gib == lora_lab.plan(settled.config).total_gib  # the settled plan is a fixed point


def test_a_run_plans_what_lora_lab_plan_plans(tmp_path):
    """The same settling on the same target: the run's plan (folder and model located aside)
    has the facts `lora-lab plan` counts with."""
    flags = {"model.name": "qwen2.5-7b", "train.output_dir": str(tmp_path), "train.run_name": "r", **DATA}
    config = resolve_config("24gb", flags=flags)
    target = Target(gpu_gib=24, cuda=True, liger=True, varlen=True)
    planned = plan_run(config, target, for_run=False)
    run = plan_run(config, target, for_run=True, locate=False)
    assert run.run_dir == tmp_path / "r" and run.resume_from is None
    assert dataclasses.replace(run, run_dir=None, config=planned.config) == planned
    assert (run.precision, run.kernels, run.packed_attention) == ("bf16", "liger", "varlen")
    assert run.config.train.output_dir == str(tmp_path) and config == resolve_config("24gb", flags=flags)


def test_out_of_memory_makes_a_new_plan_with_half_the_micro_batch(tmp_path):
    flags = {"train.micro_batch_size": 4, "train.grad_accum": 2, "train.output_dir": str(tmp_path), **DATA}
    plan = plan_run(resolve_config("cpu", flags=flags), Target(gpu_gib=None, cuda=False), locate=False)
    retried = halved_plan(plan, 3, Precision("fp32"))
    assert (retried.config.train.micro_batch_size, retried.config.train.grad_accum) == (2, 4)
    assert retried.config.sources["train.micro_batch_size"] == "out-of-memory retry"
    assert (plan.config.train.micro_batch_size, plan.config.train.grad_accum) == (4, 2)  # the old plan stands
    write_plan(retried, tmp_path / "plan.yaml")
    assert read_plan(tmp_path / "plan.yaml") == retried
    saved = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert saved["train"]["micro_batch_size"] == 2 and saved["plan"]["precision"] == "fp32"


def test_out_of_memory_at_micro_batch_1_in_grpo_names_the_generation_batch(tmp_path):
    """A smaller micro-batch does not shrink grpo's generation (the step's completions at once):
    the stop names the completion length and the completions a step."""
    flags = {"train.micro_batch_size": 1, "train.grad_accum": 8, "train.output_dir": str(tmp_path), **DATA}
    flags.update({"train.task": "grpo", "grpo.rewards": ["format"], "grpo.max_completion_length": 512})
    plan = plan_run(resolve_config("cpu", flags=flags), Target(gpu_gib=None, cuda=False), locate=False)
    with pytest.raises(TrainingError, match=r"generates the step's 8 completions of up to 512 tokens at once.*"
                       r"--max-completion-length \(e.g. 256\)"):  # fmt: skip
        halved_plan(plan, 3, Precision("fp32"))


def test_out_of_memory_at_micro_batch_1_of_a_qlora_run_does_not_advise_qlora(tmp_path):
    flags = {"train.micro_batch_size": 1, "model.quantization": "nf4", "train.output_dir": str(tmp_path), **DATA}
    plan = plan_run(resolve_config("24gb", flags=flags), Target(gpu_gib=None, cuda=False), locate=False)
    with pytest.raises(TrainingError) as stop:
        halved_plan(plan, 1, Precision("bf16"))
    assert "nf4 weights, bf16, --max-length" in str(stop.value) and "--quantization" not in str(stop.value)
