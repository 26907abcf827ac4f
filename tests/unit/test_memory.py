"""The planner's parts, verdicts and engines (bench/tests/test_planner_against_results.py holds
its predictions against the stored GPU runs)."""

import pytest

from lora_lab.config import resolve_config
from lora_lab.planning.choice import pick_preset
from lora_lab.planning.memory import plan_memory


def test_report_breakdown_and_longest_length():
    config = resolve_config("16gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"]})
    plan = plan_memory(config, gpu_memory_gib=16)
    assert plan.quantization == "QLoRA nf4" and plan.fits
    text = plan.report()
    for part in (
        "weights (input embedding in CPU memory)",
        "LoRA weights + gradients + Adam state",
        "activation checkpoints",
        "memory means: input embedding in CPU memory, layer checkpoints in CPU memory",
        "attention mask of a packed row",
        "fits in 15.5 GiB",
        "longest data.pack_length that fits",
    ):
        assert part in text
    # plan_memory counts auto, unresolved, as a packed row's mask (lora_lab.plan resolves it)
    assert 32768 <= plan.longest_max_length < 65536


def test_a_packed_row_counts_its_mask_only_where_the_attention_builds_one():
    from dataclasses import replace

    from lora_lab.training.plan import Target, settle_packed_attention

    flags = {"model.name": "qwen2.5-7b", "data.datasets": ["x"]}
    mask = "attention mask of a packed row (counted)"
    for kind, counted in (("mask", True), ("auto", True), ("segments", False), ("varlen", False)):
        config = resolve_config("24gb", flags=flags, sets=[f"data.packed_attention={kind}"])
        assert (mask in plan_memory(config).parts_gib) is counted, kind
    # auto as the plan settles it: varlen on a CUDA GPU whose PyTorch has the kernel, else mask
    assert settle_packed_attention("auto", Target(gpu_gib=None, cuda=False)) == "mask"
    assert settle_packed_attention("auto", Target(gpu_gib=24, cuda=True, varlen=True)) == "varlen"
    assert settle_packed_attention("auto", Target(gpu_gib=24, cuda=True, varlen=False)) == "mask"
    auto = resolve_config("24gb", flags=flags)
    planned = replace(auto, data=replace(auto.data, packed_attention="varlen"))
    assert plan_memory(planned).total_gib == pytest.approx(plan_memory(auto).total_gib - 8192 * 8192 * 3 / 2**30)


def test_the_plan_api_plans_auto_as_cuda_runs_it_without_importing_torch():
    """`lora-lab plan` answers at once on any machine: the varlen kernel is found on disk."""
    import subprocess
    import sys

    code = (
        "import sys, lora_lab\n"
        "from lora_lab.config import resolve_config\n"
        "c = resolve_config('16gb', flags={'model.name': 'qwen2.5-7b', 'data.datasets': ['x']})\n"
        "p = lora_lab.plan(c)\n"
        "print('attention mask of a packed row (counted)' in p.parts_gib, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["False", "False"]  # this PyTorch has varlen: no mask


def test_the_plan_api_plans_a_gpu_run_on_the_tiers_card_wherever_it_is_made():
    import lora_lab

    config = resolve_config("16gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"]})
    plan = lora_lab.plan(config)  # no GPU here, no memory given: the 16gb tier's card
    assert plan.budget_gib == 15.5 and plan.fits
    assert "attention mask of a packed row (counted)" not in plan.parts_gib  # varlen, as on CUDA
    # measured: 65,536 tokens at 11.49 GiB under a 15.5 GiB cap (2026-12-04-peer-call40.jsonl)
    assert plan.longest_max_length >= 65536
    assert lora_lab.plan(config, gpu_memory_gib=12).budget_gib == 11.5
    cpu = resolve_config("cpu", flags={"model.name": "qwen2.5-0.5b", "data.datasets": ["x"]})
    assert lora_lab.plan(cpu).budget_gib is None  # no card to plan for


def test_short_data_is_planned_at_its_real_length():
    config = resolve_config(
        "24gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"], "data.max_length": 8192}
    )
    full = plan_memory(config)
    short = plan_memory(config, longest_sample_tokens=300)
    assert short.tokens_per_micro_batch == 300 and short.total_gib < full.total_gib - 1.0


@pytest.mark.parametrize(
    "gib,preset", [(24, "24gb"), (23.6, "24gb"), (16, "16gb"), (12, "12gb"), (11.6, "12gb"), (8, "8gb"), (6, "8gb")]
)
def test_auto_preset_picks_the_largest_tier_that_fits(gib, preset):
    assert pick_preset(gib)[0] == preset


def test_check_fits_refuses_with_the_knobs_to_turn():
    from lora_lab.errors import LoraLabError
    from lora_lab.planning.choice import check_fits

    flags = {"model.name": "qwen2.5-7b", "data.datasets": ["x"]}
    assert check_fits(resolve_config("16gb", flags=flags), 16).fits
    sixteen_bit = resolve_config("16gb", flags={**flags, "model.quantization": "none"})
    assert check_fits(sixteen_bit, 16).fits  # measured: 14.74 GiB (2026-12-05-fit-7b.jsonl)
    # on a 15 GiB card the plan (14.98 GiB here, with the mask a CPU's attention needs) is over
    # what is usable (14.5)
    with pytest.raises(
        LoraLabError,
        match=r"--preset 16gb needs about 14.9 GiB for Qwen2.5-7B "
        r"\(16-bit LoRA\) at --max-length 2048 in packed rows "
        r"of 8192 tokens; this GPU has 15.0 GiB \(14.5 usable\)"
        r".*Try --set data.pack_length=\d+ or "
        r"--quantization nf4",
    ):
        check_fits(sixteen_bit, 15)


def test_host_ram_is_planned_against_the_machine_and_a_run_that_overflows_it_is_refused():
    """Llama-3.1-8B, QLoRA, one 131,072-token sample on a 24 GB card: 32 layers x 131,072 tokens
    x 4096 x 2 bytes of pinned checkpoints (exactly: models/host_memory.py), the input embedding
    table and the process itself, against 85% of the machine's RAM; the longest length is the
    one both hold, and a run is refused before loading with the knobs to turn."""
    from lora_lab.errors import LoraLabError
    from lora_lab.planning.choice import check_fits
    from lora_lab.planning.memory_plan import FIT_PROCESS_HOST_GIB

    flags = {"model.name": "llama-3.1-8b", "data.datasets": ["x"], "data.max_length": 131072}
    sets = ["model.quantization=nf4", "data.packing=false"]
    config = resolve_config("24gb", flags=flags, sets=sets)
    roomy = plan_memory(config, 24, cpu_memory_gib=64)
    assert roomy.cpu_parts_gib["activation checkpoints (pinned)"] == 32.0
    assert roomy.host_gib == pytest.approx(32.0 + 128256 * 4096 * 2 / 2**30 + FIT_PROCESS_HOST_GIB)
    assert roomy.fits and roomy.cpu_fits and roomy.cpu_budget_gib == pytest.approx(64 * 0.85)
    assert "host RAM with the process" in roomy.report() and "fits in 54.4 GiB" in roomy.report()
    assert plan_memory(config, 24).cpu_fits is None  # no RAM given: not planned against one
    small = plan_memory(config, 24, cpu_memory_gib=32)
    assert small.fits and small.cpu_fits is False
    room = 32 * 0.85 - 128256 * 4096 * 2 / 2**30 - FIT_PROCESS_HOST_GIB
    assert small.longest_max_length == int(room / (32 * 4096 * 2 / 2**30)) // 256 * 256
    assert small.longest_max_length < plan_memory(config, 24, cpu_memory_gib=64).longest_max_length
    assert "--set train.offload_checkpoints=false" in " ".join(small.fixes)
    assert check_fits(config, 24, cpu_memory_gib=64).cpu_fits
    with pytest.raises(LoraLabError, match=r"needs about 34.8 GiB of host RAM .* this machine has 32.0 GiB") as raised:
        check_fits(config, 24, cpu_memory_gib=32)
    assert f"--max-length {small.longest_max_length}" in str(raised.value)


# ----------------------------------------------------------------------------- several GPUs
# These terms are counted from what each engine shards or offloads; the tests pin the arithmetic,
# and the last test of this file checks them against the two-GPU runs in bench/results.


def plan_for(engine, gpus, tuner="lora", **flags):
    config = resolve_config(
        "24gb",
        flags={
            "model.name": "qwen2.5-7b",
            "data.datasets": ["x"],
            "model.quantization": "none",
            "train.gpus": gpus,
            "train.engine": engine,
            "data.packing": False,
            "train.offload_checkpoints": False,
            "model.embedding_on_cpu": False,
            **flags,
        },
    )
    config = config.with_changes({"train.tuner": tuner}, "test")
    return plan_memory(config, gpu_memory_gib=40)


def _shape():
    from lora_lab.planning.shape import ModelShape
    from lora_lab.registry import known_model_config

    return ModelShape.from_config(known_model_config("7b"))


def _part(plan, prefix):
    return sum(v for k, v in plan.parts_gib.items() if k.startswith(prefix))


def test_one_gpu_lora_is_the_measured_single_gpu_plan():
    one = plan_for("ddp", 1)
    assert "LoRA weights + gradients + Adam state (fp32)" in one.parts_gib
    assert not one.cpu_parts_gib and "counted" not in one.report()


def test_ddp_keeps_a_full_replica_plus_gradient_buckets():
    one, four = plan_for("ddp", 1), plan_for("ddp", 4)
    rank = resolve_config("24gb", flags={"model.name": "qwen2.5-7b", "data.datasets": ["x"]}).lora.rank
    lora_grads = _shape().lora_params_per_rank * rank * 4 / 2**30  # fp32
    assert _part(four, "gradients") == _part(four, "DDP buckets") == pytest.approx(lora_grads)
    assert four.total_gib == pytest.approx(one.total_gib + lora_grads)
    assert "counted, checked on two GPUs" in four.report()  # DDP LoRA ran on two H200s
    assert "counted, not checked on GPUs" in plan_for("ddp", 1, "full").report()
    assert "counted, not checked on GPUs" in plan_for("deepspeed-zero3", 4, "lora").report()
    assert "too high: on the safe side: DeepSpeed moves" in plan_for("deepspeed-zero3-offload", 2, "full").report()


@pytest.mark.parametrize("gpus", [2, 4])
def test_zero2_shards_gradients_and_optimizer_state_only(gpus):
    ddp, zero2 = plan_for("ddp", gpus, "full"), plan_for("deepspeed-zero2", gpus, "full")
    params = _shape().linear_params + _shape().other_params
    assert _part(zero2, "weights") == _part(ddp, "weights") == pytest.approx(params * 2 / 2**30)
    assert _part(zero2, "gradients") == pytest.approx(params * 2 / gpus / 2**30)
    assert _part(zero2, "optimizer state") == pytest.approx(params * 12 / gpus / 2**30)


def test_full_fine_tuning_costs_16_bytes_a_parameter_before_activations():
    ddp = plan_for("ddp", 2, "full")
    params = _shape().linear_params + _shape().other_params
    state = _part(ddp, "weights") + _part(ddp, "gradients") + _part(ddp, "optimizer state")
    assert state == pytest.approx(params * 16 / 2**30)
    assert plan_for("ddp", 1, "full").quantization.startswith("full fine-tuning")


@pytest.mark.parametrize("engine, weight_bytes", [("deepspeed-zero3", 2), ("fsdp", 4)])
def test_zero3_and_fsdp_also_shard_the_parameters(engine, weight_bytes):
    """DeepSpeed keeps bf16 weights and an fp32 master copy in the optimizer state; FSDP
    (through accelerate) shards fp32 weights and gradients: 16 bytes a parameter either way."""
    plan = plan_for(engine, 4, "full")
    params = _shape().linear_params + _shape().other_params
    assert _part(plan, "weights") == pytest.approx(params * weight_bytes / 4 / 2**30)
    state = _part(plan, "weights") + _part(plan, "gradients") + _part(plan, "optimizer state")
    assert state == pytest.approx(params * 16 / 4 / 2**30)
    assert _part(plan, "gathered parameters") > 0 and not plan.cpu_parts_gib


def test_fsdp_without_a_sync_each_micro_batch_holds_the_whole_gradients():
    """Under no_sync FSDP2 accumulates every parameter's unsharded bf16 gradient; with
    train.sync_each_micro_batch (auto: on for fsdp) they are reduced after each micro-batch."""
    params = _shape().linear_params + _shape().other_params
    synced = plan_for("fsdp", 2, "full", **{"train.grad_accum": 4})
    held = plan_for("fsdp", 2, "full", **{"train.grad_accum": 4, "train.sync_each_micro_batch": False})
    assert _part(synced, "whole gradients") == 0
    assert _part(held, "whole gradients") == pytest.approx(params * 2 / 2**30)
    assert held.total_gib - synced.total_gib == pytest.approx(params * 2 / 2**30)
    one_micro_batch = plan_for("fsdp", 2, "full", **{"train.grad_accum": 1, "train.sync_each_micro_batch": False})
    assert _part(one_micro_batch, "whole gradients") == 0  # nothing to hold between


@pytest.mark.parametrize("engine, synced", [("fsdp", True), ("ddp", False)])
def test_the_trainer_is_told_to_sync_each_micro_batch_for_fsdp(engine, synced, tmp_path):
    import dataclasses

    from lora_lab.models.load import Precision
    from lora_lab.training.args import build_training_arguments
    from lora_lab.training.plan import Target, plan_run

    def arguments(config):
        plan = plan_run(config, Target(gpu_gib=None, cuda=False), for_run=False)
        return build_training_arguments(dataclasses.replace(plan, run_dir=tmp_path), Precision("fp32"), 10, False)

    config = resolve_config("cpu", flags={"data.datasets": ["x"], "train.engine": engine})
    args = arguments(config)
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": synced}
    args = arguments(config.with_changes({"train.sync_each_micro_batch": True}, "test"))
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}


def test_offload_moves_optimizer_state_and_zero3_parameters_to_cpu():
    from lora_lab.planning.engines import PROCESS_CPU_GIB

    params = _shape().linear_params + _shape().other_params
    zero2 = plan_for("deepspeed-zero2-offload", 2, "full", **{"train.grad_accum": 4})
    assert _part(zero2, "optimizer state") == 0 and _part(zero2, "weights") > 0
    # DeepSpeed's CPU optimizer state and fp32 gradients, its 16-bit partition buffers and,
    # with gradient accumulation, a whole 16-bit gradient per process; each process's own
    assert zero2.cpu_total_gib == pytest.approx(params * (12 + 4 + 2 + 2 * 2) / 2**30 + 2 * PROCESS_CPU_GIB)
    one_step = plan_for("deepspeed-zero2-offload", 2, "full", **{"train.grad_accum": 1})
    assert zero2.cpu_total_gib - one_step.cpu_total_gib == pytest.approx(params * 4 / 2**30)
    zero3 = plan_for("deepspeed-zero3-offload", 2, "full")
    assert _part(zero3, "weights") == 0 and _part(zero3, "optimizer state") == 0
    assert zero3.cpu_total_gib == pytest.approx(params * (2 + 12 + 4) / 2**30 + 2 * PROCESS_CPU_GIB)
    assert zero3.total_gib < plan_for("deepspeed-zero3", 2, "full").total_gib
    assert "CPU memory for offload" in zero3.report()


def test_plan_command_takes_gpus_and_engine():
    from click.testing import CliRunner

    from lora_lab.cli import main

    result = CliRunner().invoke(
        main, ["plan", "--preset", "24gb", "--gpu-memory", "40", "--gpus", "2", "--engine", "deepspeed-zero2-offload"]
    )
    assert result.exit_code == 0, result.output
    assert "per GPU of 2, engine deepspeed-zero2-offload" in result.output
    assert "CPU memory for offload" in result.output


def test_plan_command_says_whether_a_context_fits_the_machines_ram():
    from click.testing import CliRunner

    from lora_lab.cli import main

    args = ["plan", "--preset", "24gb", "--model", "llama-3.1-8b", "--max-length", "131072", "--gpu-memory", "24"]
    args += ["--set", "model.quantization=nf4", "--set", "data.packing=false"]
    small = CliRunner().invoke(main, [*args, "--cpu-memory", "32"])
    assert small.exit_code == 1
    assert "34.78 GiB, does NOT fit in 27.2 GiB (85% of the machine's RAM)" in small.output
    assert "fits in 23.5 GiB" in small.output and "to fit: --max-length" in small.output
    roomy = CliRunner().invoke(main, [*args, "--cpu-memory", "64"])
    assert roomy.exit_code == 0 and "34.78 GiB, fits in 54.4 GiB" in roomy.output
    bad = CliRunner().invoke(main, [*args, "--cpu-memory", "0"])
    assert bad.exit_code == 2 and "--cpu-memory" in bad.output and "Traceback" not in bad.output


def test_engine_auto_picks_the_fastest_engine_that_fits():
    from lora_lab.planning.choice import pick_engine

    def config(size, tuner="full", **extra):
        return resolve_config(
            "24gb",
            flags={
                "data.datasets": ["x"],
                "model.name": f"qwen2.5-{size}",
                "train.gpus": 2,
                "train.tuner": tuner,
                "data.max_length": 2048,
                **extra,
            },
            sets=["data.packing=false"],
        )

    assert config("7b").train.engine == "auto"
    assert pick_engine(config("1.5b"), 40)[0] == "ddp"
    engine, why = pick_engine(config("7b"), 40, cpu_memory_gib=320)
    assert engine == "deepspeed-zero2-offload"
    assert "does not fit: ddp" in why and "deepspeed-zero2 " in why
    # ZeRO-2 offload's CPU plan (165 GiB) with the measured margin does not fit 256 GiB
    engine, why = pick_engine(config("7b"), 40, cpu_memory_gib=256)
    assert engine == "deepspeed-zero3-offload" and "(+165 GiB CPU)" in why
    # not enough CPU memory for the offloaded optimizer state: nothing fits, the most sharded
    engine, why = pick_engine(config("7b"), 40, cpu_memory_gib=64)
    assert engine == "deepspeed-zero3-offload" and why.startswith("nothing fits 40.0 GiB")
    assert pick_engine(config("7b"), 40, deepspeed=False)[0] == "fsdp"
    assert pick_engine(config("7b", "lora", **{"model.quantization": "nf4"}), 40)[0] == "ddp"
    # one process: the config keeps what the user asked for, the run plan settles ddp
    from lora_lab.config import engine_of
    from lora_lab.training.plan import Target, plan_run

    one = resolve_config("24gb", flags={"data.datasets": ["x"]})
    assert one.train.engine == "auto" and engine_of(one.train) == "ddp"
    settled = plan_run(one, Target.card(24.0), for_run=False)
    assert settled.engine == "ddp" and settled.config.sources["train.engine"] == "auto (one GPU)"


def test_a_plan_known_to_miss_says_so():
    config = resolve_config(
        "24gb",
        flags={
            "model.name": "qwen2.5-1.5b",
            "data.datasets": ["x"],
            "train.gpus": 2,
            "train.grad_accum": 4,
            "train.engine": "deepspeed-zero2-offload",
            "train.tuner": "full",
        },
    )
    report = plan_memory(config).report()
    assert "TOO LOW: DeepSpeed's caching allocator reserves more" in report
    assert "the processes' own memory (measured)" in report
    config = config.with_changes({"train.engine": "fsdp"}, "test")
    assert "checked on two GPUs" in plan_memory(config).report()


def test_warm_up_never_takes_the_only_steps_there_are():
    from lora_lab.training.args import warmup_steps

    assert [warmup_steps(0.05, n) for n in (1, 2, 19, 20, 100)] == [0, 0, 0, 1, 5]
    assert [warmup_steps(0.5, n) for n in (1, 2, 3)] == [0, 1, 1]
    assert warmup_steps(1.0, 4) == 3 and warmup_steps(0.0, 4) == 0


def test_uncheckpointed_layers_are_planned_with_their_activations():
    """train.uncheckpointed_layers 8 of 7B's 28: the plan adds 8 layers' activations (fast
    path: 4 hidden- and 2 intermediate-sized bf16 tensors a token) and offloads 20 checkpoints;
    all 28 on a 24 GB card are refused."""
    flags = {"model.name": "qwen2.5-7b", "data.datasets": ["x"], "data.max_length": 1024}
    sets = ["data.pack_length=4096", "lora.dropout=0"]
    config = resolve_config("24gb", flags=flags, sets=sets)
    kept = resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=8"])
    every, some = plan_memory(config, gpu_memory_gib=24), plan_memory(kept, gpu_memory_gib=24)
    part = some.parts_gib["8 layers kept, not recomputed (fitted)"]
    assert part == pytest.approx(8 * 4096 * 2 * (4 * 3584 + 2 * 18944) / 2**30)
    assert some.total_gib == pytest.approx(every.total_gib + part)
    pinned = "activation checkpoints (pinned)"
    assert some.cpu_parts_gib[pinned] == pytest.approx(every.cpu_parts_gib[pinned] * 20 / 28)
    assert "the last 8 layers not recomputed" in some.means
    assert some.fits is True
    whole = resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=28"])
    assert plan_memory(whole, gpu_memory_gib=24).fits is False


def test_the_plan_says_how_many_layers_could_skip_their_recomputation():
    """A 7B row of 4096 tokens on the 24gb preset leaves room: the plan names the setting and
    the number that fits in 90% of the usable memory (auto takes that number); planned with it,
    the run still fits; a plan that does not fit offers fewer such layers first."""
    flags = {"model.name": "qwen2.5-7b", "data.datasets": ["x"], "data.max_length": 1024}
    sets = ["data.pack_length=4096", "lora.dropout=0"]
    plan = plan_memory(resolve_config("24gb", flags=flags, sets=sets), gpu_memory_gib=24)
    room = plan.room_for_layers
    assert 5 <= room <= 28
    assert f"--set train.uncheckpointed_layers={room}" in plan.report()
    kept = plan_memory(
        resolve_config("24gb", flags=flags, sets=sets + [f"train.uncheckpointed_layers={room}"]), gpu_memory_gib=24
    )
    assert kept.fits and kept.total_gib <= 0.90 * 23.5 and kept.room_for_layers == 0
    assert "room for" not in kept.report()
    auto = plan_memory(
        resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=auto"]), gpu_memory_gib=24
    )
    assert auto.kept == room and auto.total_gib == pytest.approx(kept.total_gib)
    assert f"the last {room} layers not recomputed" in auto.means
    no_gpu = plan_memory(resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=auto"]))
    assert no_gpu.kept == 0  # nothing to fill
    over = plan_memory(
        resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=28"]), gpu_memory_gib=24
    )
    assert over.fixes[0] == "fewer train.uncheckpointed_layers"
