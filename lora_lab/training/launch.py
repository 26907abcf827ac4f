"""Several GPUs: relaunch the same run through `accelerate launch`, one process per GPU.

`lora-lab run --gpus N [--engine E]` settles the run's plan once (training/plan.py: engine,
precision, model, run folder, resume point), writes

    RUN_DIR/launch/run_config.yaml    the plan: the settled config as config.yaml has it and a
                                      plan: section (training/plan.py write_plan)
    RUN_DIR/launch/accelerate.yaml    presets/engines/<engine> filled in: processes, precision
    RUN_DIR/launch/deepspeed.json     (DeepSpeed engines) presets/engines/<engine>.json with
                                      micro-batch, gradient accumulation, global batch,
                                      clipping and precision taken from the run config

and runs `python -m accelerate.commands.launch ... --module lora_lab.training.worker --config
RUN_DIR/launch/run_config.yaml`. Each worker reads that plan back (read_plan) and trains with transformers' Trainer, which picks up the
engine from accelerate; only rank 0 writes into the run folder (training/run.py).

With --nodes N each machine runs the same command with its --node-rank: the launch files of node R
are RUN_DIR/launch/node-R/ (node 0; a dry run writes every node's), with num_machines,
machine_rank and node 0's address, and accelerate's num_processes counts every node's processes;
training/nodes.py says what else changes.

Without a CUDA GPU the workers are CPU processes talking over gloo (ddp only): that is how the
tests exercise this path. accelerate's own `--cpu` flag starts a single process unless MPI is
set up, so on CPU the launch goes through its torchrun-based launcher, and each worker's
TrainingArguments(use_cpu=True) selects gloo.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config import DEEPSPEED_ENGINES, RunConfig, engine_of, engine_template, main_host_port, world_size_of
from ..device import ALLOCATOR_ENV, EXPANDABLE_SEGMENTS, allocator_chosen, cuda_available, in_launched_worker
from ..errors import LoraLabError, TrainingError
from ..log import get_logger
from ..models.load import choose_precision
from ..planning.memory import TIERS_GIB, plan_memory
from ..run_folder import RunFolder, TrainResult, check_run_dir, read_result, recorded_stop
from ..run_folder.names import ACCELERATE_FILE, DEEPSPEED_FILE, LAUNCH_FOLDER, STOP_FILE
from .lock import run_lock
from .nodes import check_main_address, describe_global_batch, local_launch_folder
from .plan import RunPlan, Target, plan_run, write_plan

log = get_logger()


def needs_launch(config: RunConfig) -> bool:
    """Several processes, or an engine other than plain single-process training."""
    wants = world_size_of(config.train) > 1 or engine_of(config.train) != "ddp"
    return wants and not in_launched_worker()


def check_engine(config: RunConfig, cuda_gpus: int) -> None:
    """Refuse, before anything starts, an engine this machine cannot run."""
    engine, gpus = config.train.engine, config.train.gpus
    if engine in DEEPSPEED_ENGINES and importlib.util.find_spec("deepspeed") is None:
        raise LoraLabError(
            f"--engine {engine} needs DeepSpeed, which is not installed: "
            f"pip install deepspeed (on the machine with the GPUs), or use "
            f"--engine ddp or --engine fsdp."
        )
    if cuda_gpus == 0 and engine != "ddp":
        raise LoraLabError(
            f"--engine {engine} needs CUDA GPUs; this machine has none. Without "
            f"a GPU, --gpus {gpus} runs CPU processes with --engine ddp."
        )
    if cuda_gpus and gpus > cuda_gpus:
        raise LoraLabError(
            f"--gpus {gpus}: this machine has {cuda_gpus} CUDA GPU(s). Pass --gpus {cuda_gpus} or fewer."
        )
    if config.model.quantization == "nf4" and engine != "ddp":
        raise LoraLabError(
            f"--engine {engine} with --quantization nf4: 4-bit weights cannot be "
            f"sharded by lora-lab's engines; use --engine ddp for QLoRA."
        )
    if not engine_template(engine).is_file():
        raise LoraLabError(f"--engine {engine}: its config {engine_template(engine)} is missing.")


def mixed_precision_of(precision_name: str) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(precision_name, "no")


def fill_deepspeed_config(template: dict, config: RunConfig, precision_name: str) -> dict:
    """The DeepSpeed config with every batch and precision value taken from the run config."""
    t = config.train
    filled = json.loads(json.dumps(template))
    filled["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    filled["gradient_accumulation_steps"] = t.grad_accum
    filled["train_batch_size"] = t.micro_batch_size * t.grad_accum * world_size_of(t)
    filled["gradient_clipping"] = t.max_grad_norm
    filled.setdefault("bf16", {})["enabled"] = precision_name == "bf16"
    filled.setdefault("fp16", {})["enabled"] = precision_name == "fp16"
    return filled


def node_folder(folder: Path, config: RunConfig, node_rank: int) -> Path:
    """Where one node's accelerate.yaml and run_config.yaml go: the launch folder itself on one
    machine, its node-R/ subfolder with several."""
    return RunFolder.launch_node(folder, config.train.nodes, node_rank)


def write_launch_files(plan: RunPlan, folder: Path | None = None, node_rank: int | None = None) -> Path:
    """Write the launch files into `folder` (RUN_DIR/launch by default) for node `node_rank`
    (train.node_rank by default): the plan the workers train with (run_config.yaml,
    training/plan.py write_plan) and accelerate's config; returns the accelerate config."""
    config, precision_name = plan.config, plan.precision
    folder = folder or plan.folder / LAUNCH_FOLDER
    node_rank = config.train.node_rank if node_rank is None else node_rank
    node = node_folder(folder, config, node_rank)
    node.mkdir(parents=True, exist_ok=True)
    node_plan = plan
    if node_rank != config.train.node_rank:  # a dry run writes every node's plan
        node_plan = plan.with_config(
            config.with_changes({"train.node_rank": node_rank}, f"dry run (node {node_rank})")
        )
    write_plan(node_plan, RunFolder.launch_config(node))
    engine = config.train.engine
    if engine in DEEPSPEED_ENGINES:
        template = json.loads(engine_template(engine).read_text())
        filled = fill_deepspeed_config(template, config, precision_name)
        (folder / DEEPSPEED_FILE).write_text(json.dumps(filled, indent=2) + "\n")
        accelerate: dict[str, Any] = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "deepspeed_config_file": str((folder / DEEPSPEED_FILE).resolve()),
                "zero3_init_flag": filled["zero_optimization"]["stage"] == 3,
            },
            # no mixed_precision here: with a DeepSpeed file, accelerate takes it from the file
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": False,
        }
        if config.train.nodes > 1:  # torchrun on every node, not DeepSpeed's pdsh launcher
            accelerate["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    else:
        accelerate = yaml.safe_load(engine_template(engine).read_text())
        accelerate["mixed_precision"] = mixed_precision_of(precision_name)
    accelerate.update(machines_of(config, node_rank))
    path = node / ACCELERATE_FILE
    header = (
        f"# written by lora-lab from {engine_template(engine).name}: processes, machines "
        f"and precision come from the run config\n"
    )
    path.write_text(header + yaml.safe_dump(accelerate, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machines_of(config: RunConfig, node_rank: int) -> dict:
    """accelerate's keys for the processes and machines: num_processes counts every node's."""
    t = config.train
    machines: dict[str, Any] = {"num_processes": world_size_of(t), "num_machines": t.nodes, "machine_rank": node_rank}
    if t.nodes > 1:
        host, port = main_host_port(t)
        machines.update(main_process_ip=host, main_process_port=port)
    return machines


def launch_command(
    config: RunConfig, run_dir: Path, accelerate_config: Path, port: int | None = None, node_rank: int | None = None
) -> list[str]:
    """`accelerate launch` of the workers (training/worker.py) with the plan beside
    accelerate_config; several nodes: this node's machine rank and node 0's address."""
    t = config.train
    if t.nodes == 1:
        where = ["--main_process_port", str(port or free_port())]
    else:
        machines = machines_of(config, t.node_rank if node_rank is None else node_rank)
        where = sum(([f"--{key}", str(value)] for key, value in machines.items() if key != "num_processes"), [])
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config),
        "--num_processes",
        str(world_size_of(t)),
        *where,
        "--module",
        "lora_lab.training.worker",
        "--config",
        str(RunFolder.launch_config(accelerate_config.parent)),
    ]


def prepare_launch(
    config: RunConfig, dry_run: bool = False, hold: contextlib.ExitStack | None = None
) -> tuple[list[str], RunPlan]:
    """Settle the run's plan (training/plan.py), check the engine and write the launch files;
    returns the command and the plan.

    dry_run: for a machine other than this one (e.g. 8 GPUs planned from a laptop): a GPU of the
    preset's tier with bf16, no model located, and no check of this machine's GPUs or DeepSpeed
    install. hold: takes the run folder's lock (training.lock.run_lock) before anything is written
    into it, until `hold` closes."""
    target = Target(gpu_gib=TIERS_GIB.get(config.preset), cuda=True) if dry_run else Target.here()
    plan = plan_run(config, target, quiet=True, locate=False)
    config, run_dir = plan.config, plan.folder
    if not dry_run:
        import torch

        choose_precision(plan.precision)  # refuses a forced dtype this machine lacks
        check_engine(config, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        plan = plan.located()  # once, for every worker
    log.info(describe_global_batch(config))
    if config.train.node_rank > 0 and not dry_run:  # the run folder is node 0's to write
        check_main_address(config)
        folder = local_launch_folder(run_dir, config.train.node_rank)
        accelerate_config = write_launch_files(plan, folder)
        return launch_command(config, run_dir, accelerate_config), plan
    check_run_dir(run_dir, config, plan.resume_from)
    if config.train.nodes > 1 and not dry_run:
        check_main_address(config)
    if hold is not None:
        hold.enter_context(run_lock(run_dir))
    for node_rank in range(config.train.nodes if dry_run else 0):  # every node's files
        write_launch_files(plan, node_rank=node_rank)
    accelerate_config = write_launch_files(plan)
    return launch_command(config, run_dir, accelerate_config), plan


def dry_run_launch(config: RunConfig) -> Path:
    """Write the launch files (every node's) and print the command each node runs and the
    per-GPU memory plan; run nothing."""
    command, plan = prepare_launch(config, dry_run=True)
    config, run_dir = plan.config, plan.folder
    folder, t = run_dir / LAUNCH_FOLDER, config.train
    if t.nodes == 1:
        log.info(
            f"dry run: launch files in {folder}; on a machine with {t.gpus} GPUs this runs:\n  {shlex.join(command)}"
        )
    else:
        log.info(
            f"dry run: launch files for {t.nodes} nodes in {folder}; each machine with "
            f"{t.gpus} GPUs runs its own line (the same `lora-lab run` command with its "
            f"--node-rank writes the same files for itself):"
        )
        for rank in range(t.nodes):
            accelerate_config = node_folder(folder, config, rank) / ACCELERATE_FILE
            node_command = launch_command(config, run_dir, accelerate_config, node_rank=rank)
            log.info(f"  node {rank}: {shlex.join(node_command)}")
    try:
        log.info(plan_memory(plan.planner_config).report())
    except ValueError as exc:  # a model the planner does not know
        log.info(f"(no memory plan: {exc})")
    return run_dir


def launch_env(config: RunConfig, environ=None, cpus: int | None = None) -> dict:
    """The workers' environment. Offload engines run the optimizer step on the CPU (DeepSpeed's
    CPU Adam uses OpenMP threads), and torchrun/accelerate start each worker with
    OMP_NUM_THREADS=1: the CPU optimizer step of the offload engines then runs on one core.
    Unless the user set it, give each worker its share of the cores.

    FSDP gathers and frees every layer's weights on its own CUDA streams, and PyTorch's caching
    allocator keeps what one stream freed from the others: unless the user set
    PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, FSDP workers get expandable segments
    (docs/benchmarks-history.md, several GPUs)."""
    env = dict(os.environ if environ is None else environ)
    if config.train.engine.endswith("-offload") and "OMP_NUM_THREADS" not in env:
        cpus = cpus or len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, cpus // config.train.gpus))
    if config.train.engine == "fsdp" and not allocator_chosen(env):
        env[ALLOCATOR_ENV] = EXPANDABLE_SEGMENTS
    return env


def launch_run(config: RunConfig) -> TrainResult:
    """Run `config` as train.gpus processes under accelerate; returns rank 0's result."""
    with contextlib.ExitStack() as hold:
        command, plan = prepare_launch(config, hold=hold)
        return _run_workers(plan.config, command, plan.folder)


def _run_workers(config: RunConfig, command: list, run_dir: Path) -> TrainResult:
    where = "CUDA GPUs" if cuda_available() else "CPU processes (gloo)"
    env = launch_env(config)
    threads = (
        f" (OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per worker for the CPU optimizer)"
        if env.get("OMP_NUM_THREADS") != os.environ.get("OMP_NUM_THREADS")
        else ""
    )
    if env.get(ALLOCATOR_ENV) != os.environ.get(ALLOCATOR_ENV):
        threads += f" ({ALLOCATOR_ENV}={env[ALLOCATOR_ENV]})"
    t = config.train
    node = f" on node {t.node_rank} of {t.nodes}" if t.nodes > 1 else ""
    log.info(f"launching {t.gpus} {where}{node} with engine {t.engine}{threads}:\n  {shlex.join(command)}")
    if t.node_rank == 0:
        (run_dir / STOP_FILE).unlink(missing_ok=True)
    returncode = run_forwarding_signals(command, env)
    stopped = recorded_stop(run_dir)
    if stopped is not None:  # the workers stopped on a signal and wrote a checkpoint
        raise stopped
    if returncode != 0:
        files = Path(command[command.index("--config") + 1]).parent
        raise TrainingError(
            f"--gpus {t.gpus}{node}: the launched run failed (exit status "
            f"{returncode}); the workers' messages are above. The "
            f"launch files are in {files}."
        )
    return read_result(run_dir)


def run_forwarding_signals(command: list, env: dict) -> int:
    """Run the launcher in its own session and pass SIGTERM / SIGINT on to it (it hands them to
    every worker once), so that a Ctrl-C or a scheduler's notice reaches the workers exactly
    once; returns the exit status."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    forward = lambda signum, frame: process.send_signal(signum)  # noqa: E731
    previous = {n: signal.signal(n, forward) for n in (signal.SIGTERM, signal.SIGINT)}
    try:
        return process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
