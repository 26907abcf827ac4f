"""--nodes N: the config's refusals, every node's launch files and command, the main-address
checks, the cross-node agreement, and the planner's per-GPU and interconnect figures."""

import dataclasses
import json
import socket
import time

import pytest
import yaml
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.config import DEEPSPEED_ENGINES, ENGINES, resolve_config
from lora_lab.errors import LoraLabError
from lora_lab.planning.memory import plan_memory
from lora_lab.planning.traffic import plan_traffic
from lora_lab.training.launch import launch_command, write_launch_files
from lora_lab.training.nodes import check_main_address, describe_global_batch, disagreements
from lora_lab.training.plan import Target, plan_run

NODES = {"train.nodes": 2, "train.main_address": "10.1.2.3:29601", "train.run_name": "r"}


def config_for(engine="ddp", gpus=4, **flags):
    return resolve_config(
        "24gb",
        flags={
            "model.name": "qwen2.5-7b",
            "data.datasets": ["x"],
            "train.gpus": gpus,
            "train.engine": engine,
            **NODES,
            **flags,
        },
    )


def planned(config, run_dir, precision="bf16"):
    """The launcher's plan of `config` on a GPU, with run_dir as its run folder."""
    plan = plan_run(config, Target(gpu_gib=24, cuda=True), for_run=False)
    return dataclasses.replace(plan, run_dir=run_dir, precision=precision)


def problems_of(flags: list) -> str:
    result = CliRunner().invoke(main, ["run", "--data", "x", *flags])
    assert result.exit_code == 2 and "Traceback" not in result.output
    return result.output


def test_a_node_rank_out_of_range_is_refused():
    output = problems_of(["--nodes", "2", "--node-rank", "2", "--main-address", "h", "--run-name", "r"])
    assert "--node-rank 2: out of range: with --nodes 2 the node ranks are 0 and 1; got 2." in output
    assert "--node-rank 1: out of range: with --nodes 1 the node ranks are 0; got 1." in problems_of(
        ["--node-rank", "1"]
    )


def test_several_nodes_need_node_0s_address_and_one_run_name():
    output = problems_of(["--nodes", "3"])
    assert "--nodes 3 needs node 0's address: --main-address HOST[:PORT]" in output
    assert "--nodes 3: pass --run-name NAME, the same on every node" in output
    assert "expected HOST or HOST:PORT" in problems_of(
        ["--nodes", "2", "--main-address", "10.0.0.1:port", "--run-name", "r"]
    )
    assert "expected HOST or HOST:PORT" in problems_of(
        ["--nodes", "2", "--main-address", "h:70000", "--run-name", "r"]
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_gets_each_nodes_machine_rank_and_node_0s_address(engine, tmp_path):
    config = config_for(engine, gpus=4, **{"train.micro_batch_size": 2, "train.grad_accum": 8})
    for rank in (0, 1):
        path = write_launch_files(planned(config, tmp_path), node_rank=rank)
        assert path == tmp_path / "launch" / f"node-{rank}" / "accelerate.yaml"
        accelerate = yaml.safe_load(path.read_text())
        assert accelerate["num_processes"] == 8 and accelerate["num_machines"] == 2
        assert accelerate["machine_rank"] == rank
        assert accelerate["main_process_ip"] == "10.1.2.3"
        assert accelerate["main_process_port"] == 29601
        saved = yaml.safe_load((path.parent / "run_config.yaml").read_text())
        assert saved["train"]["node_rank"] == rank and saved["train"]["nodes"] == 2
        command = " ".join(launch_command(config, tmp_path, path, node_rank=rank))
        assert (
            f"--num_processes 8 --num_machines 2 --machine_rank {rank} --main_process_ip "
            f"10.1.2.3 --main_process_port 29601 --module lora_lab.training.worker" in command
        )
        assert command.endswith(f"--config {path.parent}/run_config.yaml")
        if engine in DEEPSPEED_ENGINES:
            # torchrun on every node (the command each node runs), not DeepSpeed's pdsh
            assert accelerate["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    if engine in DEEPSPEED_ENGINES:
        filled = json.loads((tmp_path / "launch" / "deepspeed.json").read_text())
        assert filled["train_batch_size"] == 2 * 8 * 4 * 2  # every node's processes


def test_the_global_batch_counts_every_node():
    assert describe_global_batch(config_for(**{"train.grad_accum": 4})) == (
        "global batch: micro-batch 1 x grad-accum 4 x 4 GPUs x 2 nodes = 32 samples per optimizer step"
    )


def test_dry_run_writes_every_nodes_files_and_prints_each_nodes_command(tmp_path):
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
            "--gpus",
            "8",
            "--nodes",
            "2",
            "--main-address",
            "node01:29700",
            "--engine",
            "deepspeed-zero3",
            "--grad-accum",
            "4",
            "--output-dir",
            str(tmp_path / "out"),
            "--run-name",
            "big",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    launch = tmp_path / "out" / "big" / "launch"
    assert sorted(str(p.relative_to(launch)) for p in launch.rglob("*") if p.is_file()) == [
        "deepspeed.json",
        "node-0/accelerate.yaml",
        "node-0/run_config.yaml",
        "node-1/accelerate.yaml",
        "node-1/run_config.yaml",
    ]
    assert "global batch: micro-batch 1 x grad-accum 4 x 8 GPUs x 2 nodes = 64 samples" in result.output
    for rank in (0, 1):
        assert (
            f"  node {rank}: " in result.output
            and f"--machine_rank {rank} --main_process_ip node01 --main_process_port 29700" in result.output
        )
        assert f"{launch}/node-{rank}/run_config.yaml" in result.output
    assert "per GPU of 16 (2 nodes x 8), engine deepspeed-zero3" in result.output
    assert "interconnect per optimizer step, engine deepspeed-zero3" in result.output


def test_node_0_refuses_an_address_it_cannot_listen_at():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = config_for(**{"train.main_address": f"127.0.0.1:{port}"})
        with pytest.raises(
            LoraLabError, match=f"--main-address 127.0.0.1:{port}: node 0 \\(this machine\\) cannot listen there"
        ):
            check_main_address(config)
    check_main_address(config)  # free again


def test_other_nodes_wait_for_node_0_then_refuse_naming_the_address(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    config = config_for(
        **{"train.main_address": f"127.0.0.1:{port}", "train.node_rank": 1, "train.node_wait_seconds": 1.5}
    )
    started = time.monotonic()
    with pytest.raises(LoraLabError) as caught:
        check_main_address(config)
    assert 1.5 <= time.monotonic() - started < 10  # a timeout, not a hang
    assert str(caught.value).startswith(
        f"--main-address 127.0.0.1:{port}: node 0 did not answer within 1.5 s (Connection refused)"
    )
    with socket.create_server(("127.0.0.1", port)):
        check_main_address(config)  # node 0 listens: it returns at once


def report(rank, node, lr=1e-4, folder=("config.yaml", "launch"), data="abc", run_dir="/s/r"):
    return {
        "rank": rank,
        "node": node,
        "config": {"train.lr": lr, "train.gpus": 2},
        "data": data,
        "run_dir": run_dir,
        "folder": list(folder) if folder is not None else None,
    }


def test_processes_that_disagree_with_rank_0_are_named_once_per_node():
    assert disagreements([report(0, 0), report(1, 0), report(2, 1), report(3, 1)]) == []
    problems = disagreements([report(0, 0), report(1, 0), report(2, 1, lr=2e-4), report(3, 1, lr=2e-4)])
    assert problems == [
        "train.lr: node 0 has 0.0001, node 1 (rank 2) has 0.0002. Every node "
        "must run the same command, but for --node-rank."
    ]
    blind = disagreements(
        [
            report(0, 0),
            report(1, 0),
            report(2, 1, folder=None, run_dir="/l/r"),
            report(3, 1, folder=None, run_dir="/l/r"),
        ]
    )
    assert blind == [
        "node 1 (rank 2) does not see the run folder as node 0 does (node 0: "
        "/s/r: config.yaml, launch; node 1 (rank 2): /l/r: no such folder). Put "
        "--output-dir on storage every node shares (NFS, Lustre ...), mounted on "
        "each."
    ]
    assert "the training data differ" in disagreements([report(0, 0), report(1, 1, data="x")])[0]


def test_plan_shards_over_every_nodes_gpus():
    one = plan_memory(config_for("deepspeed-zero3", gpus=8, **{"train.nodes": 1}))
    two = plan_memory(config_for("deepspeed-zero3", gpus=8))
    assert one.gpus == 8 and two.gpus == 16 and two.nodes == 2
    assert two.parts_gib["weights (16-bit base, fp32 LoRA) (1/16)"] == pytest.approx(
        one.parts_gib["weights (16-bit base, fp32 LoRA) (1/8)"] / 2
    )
    assert one.traffic is None and two.traffic is not None


@pytest.mark.parametrize(
    "engine,expected",
    [
        # 7B: 7,615,616,512 parameters; LoRA r8 on every linear: 20,185,088; 16 processes, 4
        # micro-batches a step, ring collectives
        ("ddp", 2 * 15 / 16 * 20_185_088 * 4),
        ("deepspeed-zero2", 15 / 16 * 20_185_088 * 2 * 4 + 15 / 16 * 20_185_088 * 2),
        ("deepspeed-zero3", 15 / 16 * 7_615_616_512 * 2 * 2 * 4 + 15 / 16 * 20_185_088 * 2 * 4),
        ("fsdp", 15 / 16 * 7_615_616_512 * 2 * 2 * 4 + 15 / 16 * 20_185_088 * 4 * 4),
    ],
)
def test_interconnect_bytes_per_step_of_each_engine(engine, expected):
    config = config_for(engine, gpus=8, **{"train.grad_accum": 4})
    plan = plan_memory(config)
    assert plan.traffic.sent_bytes_per_step == pytest.approx(expected)
    assert plan_traffic(config, 7_615_616_512, 20_185_088).sent_bytes_per_step == pytest.approx(expected)


def test_plan_command_prints_the_interconnect_arithmetic_for_two_nodes():
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--preset",
            "24gb",
            "--nodes",
            "2",
            "--gpus",
            "8",
            "--engine",
            "deepspeed-zero2",
            "--grad-accum",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "per GPU of 16 (2 nodes x 8), engine deepspeed-zero2" in result.output
    assert (
        "reduce-scatter of the LoRA gradients (20,185,088 trained parameters x 2 B), every "
        "micro-batch:\n      (16-1)/16 x 40.4 MB x 4 = 0.15 GB"
    ) in result.output
    assert "all-gather of the updated LoRA weights" in result.output
    assert "total 0.19 GB per step" in result.output
