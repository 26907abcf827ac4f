"""Several machines (--nodes N): each runs the same `lora-lab run` command with its own
--node-rank, and accelerate starts --gpus processes on each, meeting at node 0's --main-address.

Before launching, node 0 checks that it can listen at that address and the other nodes wait (up
to train.node_wait_seconds) until it answers: a wrong address or a closed port is one message
naming them, not a hang in the rendezvous.

The run folder is node 0's: its launcher writes RUN_DIR/launch/ and takes the lock, its first
process (global rank 0) writes everything else; the other nodes' launchers keep their launch
files in the lora-lab cache folder of their own machine. Every process reads the run folder, so
it must be on storage all nodes share (the checkpoints each process adds its RNG state to, and
--resume auto reads, are there).

Right after the processes meet, every one of them sends the others (agree_across_nodes):

    its resolved config, but for what may differ between nodes (NODE_KEYS)
    the fingerprint of its encoded training data (each process reads and encodes the data
    itself: there is no shared cache, so each node needs the same data files)
    what it sees of the run folder: whether it exists, and its checkpoints and files

and all of them refuse to start, with the differing keys or the folder's two views named, unless
each matches global rank 0's.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ..config import RunConfig, flatten, main_host_port, world_size_of
from ..errors import ConfigError, LoraLabError
from ..log import get_logger
from ..paths import cache_dir

log = get_logger()
NODE_KEYS = ("train.node_rank", "train.node_wait_seconds", "train.output_dir")
"""Config keys that may differ between nodes. The output folder's path may too (a shared file
system mounted elsewhere): that every node sees the same folder is checked by its contents."""


def describe_global_batch(config: RunConfig) -> str:
    """The samples of one optimizer step, counted over every process of every node."""
    t = config.train
    nodes = f" x {t.nodes} nodes" if t.nodes > 1 else ""
    return (
        f"global batch: micro-batch {t.micro_batch_size} x grad-accum {t.grad_accum} x "
        f"{t.gpus} GPUs{nodes} = {t.micro_batch_size * t.grad_accum * world_size_of(t)} "
        f"samples per optimizer step"
    )


def local_launch_folder(run_dir: Path, node_rank: int) -> Path:
    """A node other than 0 keeps its launch files on its own machine, out of the run folder."""
    folder = cache_dir() / "launch" / run_dir.name
    log.info(f"node {node_rank}: launch files in {folder} (the run folder is node 0's to write)")
    return folder


def check_main_address(config: RunConfig) -> None:
    """Node 0: it can listen at --main-address. The others: node 0 answers there within
    train.node_wait_seconds."""
    t = config.train
    host, port = main_host_port(t)
    if t.node_rank == 0:
        try:
            with socket.create_server((host, port)):
                pass
        except OSError as exc:
            raise LoraLabError(
                f"--main-address {host}:{port}: node 0 (this machine) cannot "
                f"listen there ({exc.strerror or exc}). Pass an address of this "
                f"machine and a free port, the same on every node."
            ) from None
        return
    deadline, last = time.monotonic() + t.node_wait_seconds, None
    log.info(f"node {t.node_rank}: waiting for node 0 at {host}:{port}")
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as exc:
            last = exc
        time.sleep(0.5)
    raise LoraLabError(
        f"--main-address {host}:{port}: node 0 did not answer within "
        f"{t.node_wait_seconds:g} s ({getattr(last, 'strerror', None) or last}). "
        f"Start `lora-lab run ... --node-rank 0` on the machine at {host}, check "
        f"the address and that port {port} is open between the nodes "
        f"(train.node_wait_seconds waits longer)."
    )


def shared_config(config: RunConfig) -> dict:
    """The resolved config every node must agree on."""
    return {k: v for k, v in flatten(config.to_dict()).items() if k not in NODE_KEYS}


def folder_view(run_dir: Path) -> list | None:
    """What this process sees of the run folder: its entries, or None when there is none."""
    if not run_dir.is_dir():
        return None
    return sorted(p.name for p in run_dir.iterdir())


def agree_across_nodes(config: RunConfig, run_dir: Path, fingerprint: dict) -> None:
    """Every process: exchange config, data fingerprint and run folder view; refuse unless all
    match global rank 0's (every process raises the same error). Nothing to do in one process
    or on one node."""
    import torch.distributed as dist

    if config.train.nodes == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    mine = {
        "node": int(os.environ.get("GROUP_RANK", config.train.node_rank)),
        "rank": dist.get_rank(),
        "config": shared_config(config),
        "data": fingerprint,
        "run_dir": str(run_dir),
        "folder": folder_view(run_dir),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = disagreements(everyone)
    if problems:
        raise ConfigError(problems)


def disagreements(everyone: list) -> list[str]:
    """What the processes' reports (agree_across_nodes) disagree on with global rank 0's."""
    first, problems, said = everyone[0], [], set()
    for other in everyone[1:]:
        who = f"node {other['node']} (rank {other['rank']})"
        for key in sorted(set(first["config"]) | set(other["config"])):
            ours, theirs = first["config"].get(key), other["config"].get(key)
            if ours != theirs and (key, other["node"]) not in said:
                said.add((key, other["node"]))
                problems.append(
                    f"{key}: node 0 has {ours!r}, {who} has {theirs!r}. Every node "
                    f"must run the same command, but for --node-rank."
                )
        if other["data"] != first["data"] and ("data", other["node"]) not in said:
            said.add(("data", other["node"]))
            problems.append(
                f"the training data differ: {who} encoded {other['data']} where "
                f"node 0 encoded {first['data']}. Give every node the same data "
                f"files."
            )
        if other["folder"] != first["folder"] and ("folder", other["node"]) not in said:
            said.add(("folder", other["node"]))
            problems.append(
                f"{who} does not see the run folder as node 0 does (node 0: "
                f"{first['run_dir']}: {_listing(first['folder'])}; {who}: "
                f"{other['run_dir']}: {_listing(other['folder'])}). Put "
                f"--output-dir on storage every node shares (NFS, Lustre ...), "
                f"mounted on each."
            )
    return problems


def _listing(entries: list | None) -> str:
    if entries is None:
        return "no such folder"
    return ", ".join(entries) if entries else "an empty folder"
