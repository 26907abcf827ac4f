"""Why a resumed run of more than two processes replays DDP's bucket rebuild before its first
step (training/trainer.py, replay_bucket_rebuild): torch DDP, as lora-lab builds it
(find_unused_parameters=False), reduces the first synchronised backward after it is built in one
bucket of every gradient in registration order, and rebuilds its buckets afterwards in the order
the gradients became ready. gloo's ring all-reduce adds each element in an order set by its
position in the bucket, so the same gradients summed over four processes differ in the last bits
between a fresh DDP (a resumed run's first step, without the replay) and a rebuilt one (the
uninterrupted run's); over two processes a + b does not depend on the order, and a DDP that
never rebuilds (find_unused_parameters=True) reduces alike. A fresh DDP after the replay (a
zero-weighted backward, here with dropout drawing from the RNG) reduces as the rebuilt one, bit
for bit, with its gradients cleared and the RNG where it was."""

import datetime
import os
import queue
import socket

import pytest


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    model(inputs).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _difference(expected, got) -> tuple:
    """(elements that differ, the largest difference relative to its tensor's largest element)"""
    return (
        sum(int((a != b).sum()) for a, b in zip(expected, got)),
        max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(expected, got)),
    )


def _compare(rank: int, world: int, port: int, results) -> None:
    """The second backward of one DDP against the first of a fresh one (same weights, same
    inputs on every rank), with find_unused_parameters False and True, and against the first
    after replay_bucket_rebuild."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lora_lab.training.ddp_buckets import replay_bucket_rebuild

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=240))

    def build(find_unused: bool):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)
        )
        return DistributedDataParallel(layers, find_unused_parameters=find_unused)

    generator = torch.Generator().manual_seed(rank)
    first, second = (torch.randn(4, 16, generator=generator) for _ in range(2))
    outcome = {}
    for find_unused in (False, True):
        used = build(find_unused)
        _grads(used, first)
        later, fresh = _grads(used, second), _grads(build(find_unused), second)
        outcome[find_unused] = _difference(later, fresh)
        if not find_unused:
            replayed, rng = build(False), torch.get_rng_state()
            replay_bucket_rebuild(replayed, lambda m: torch.nn.functional.dropout(m(first), 0.5).sum())
            kept = torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in replayed.parameters())
            outcome["replayed"] = (kept, _difference(later, _grads(replayed, second)))
    if rank == 0:
        results.put(outcome)
        results.close()
        results.join_thread()  # the outcome is through the pipe before this process ends
    dist.barrier()  # no rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()
    # end here: at interpreter teardown a thread torch leaves behind can abort a finished rank
    # now and then ("terminate called without an active exception", exit code -6)
    os._exit(0)


def reduce_twice(world: int) -> dict:
    """find_unused_parameters -> (elements that differ, the largest difference relative to its
    tensor's largest element), and "replayed" -> (gradients cleared and RNG kept, the same
    pair), over `world` gloo processes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    # daemons: a rank that fails leaves no process for pytest to wait on at exit
    processes = [
        context.Process(target=_compare, args=(rank, world, port, results), daemon=True) for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        outcome = results.get(timeout=300)  # a loaded 2-core machine starts 4 processes slowly
    except queue.Empty:
        pytest.fail(f"no result from rank 0 in 300 s; exit codes {[p.exitcode for p in processes]}")
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [p.exitcode for p in processes] == [0] * world
    return outcome


@pytest.mark.parametrize("world", [2, 4])
def test_a_fresh_ddp_reduces_like_a_rebuilt_one_only_over_two_processes_or_after_the_replay(world):
    outcome = reduce_twice(world)
    differing, largest = outcome[False]
    assert (differing > 0) is (world > 2), outcome
    assert largest < 1e-6  # the last bits of float32 sums, no more
    assert outcome[True] == (0, 0.0)  # no rebuild: every step reduces in the same layout
    assert outcome["replayed"] == (True, (0, 0.0))  # replayed rebuild: the rebuilt layout
