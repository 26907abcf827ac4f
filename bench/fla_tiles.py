"""flash-linear-attention's chunked gated delta rule against transformers' torch one, per key tile
of fla's gated backward (chunk_bwd_dqkwg), on Qwen3.5's Gated DeltaNet shapes: which tiles give
the right gradients on this GPU and Triton (fla #640: Hopper with Triton 3.4 to before 3.7.1),
and what each costs. GPU only; fla-core installed.

    python bench/fla_tiles.py --out DIR        # writes DIR/fla-tiles.jsonl

Each row: key head width, input dtype, tile (fla's own choice, or 32 / 64 / 128 forced), the
largest error of the output and of each input's gradient relative to the reference's largest
value (the reference: transformers' torch_chunk_gated_delta_rule in fp32, sample by sample),
and the milliseconds of fla's forward + backward over the packed row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LENGTHS = (1500, 1000, 900, 696)  # one packed 4096-token row (--lengths: others)
V_HEADS, K_HEADS = 32, 16  # Qwen3.5-4B's linear attention


def inputs(key_dim: int, dtype: torch.dtype, lengths: tuple, seed: int = 0) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(dtype)

    q = randn(1, tokens, K_HEADS, key_dim).repeat_interleave(V_HEADS // K_HEADS, dim=2)
    k = randn(1, tokens, K_HEADS, key_dim).repeat_interleave(V_HEADS // K_HEADS, dim=2)
    v = randn(1, tokens, V_HEADS, 128)
    a = torch.randn(1, tokens, V_HEADS, generator=generator, device="cuda")
    g = (-torch.nn.functional.softplus(a - 2.0)).float()  # log decay <= 0, as Qwen3.5 computes it
    beta = torch.rand(1, tokens, V_HEADS, generator=generator, device="cuda").to(dtype)
    grad_out = randn(1, tokens, V_HEADS, 128)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "grad_out": grad_out, "lengths": list(lengths)}


def leaves(x: dict, dtype=None) -> dict:
    return {
        name: x[name].detach().to(dtype or x[name].dtype).requires_grad_(True) for name in ("q", "k", "v", "g", "beta")
    }


def reference(x: dict) -> tuple:
    """transformers' torch delta rule in fp32, sample by sample: (output, grads)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from lora_lab.models.linear_attention import torch_function_of

    rule = torch_function_of(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    t = leaves(x, torch.float32)
    outs = []
    for part in zip(*(torch.split(t[n], x["lengths"], dim=1) for n in ("q", "k", "v", "g", "beta"))):
        out, _ = rule(*part[:3], g=part[3], beta=part[4], use_qk_l2norm_in_kernel=True)
        outs.append(out)
    out = torch.cat(outs, dim=1)
    out.backward(x["grad_out"].float())
    return out.detach(), {n: t[n].grad for n in t}


@contextlib.contextmanager
def forced_tile(tile: int | None):
    """fla's gated backward (chunk_bwd_dqkwg) with its key/value tile forced to `tile` (None:
    fla's own choice) and its Hopper refusal lifted, by what its tile rule reads."""
    import fla.ops.common.chunk_o as chunk_o

    saved = chunk_o.check_shared_mem, chunk_o.IS_NVIDIA_HOPPER
    chunk_o.IS_NVIDIA_HOPPER = False
    if tile is not None:
        largest = {128: {"hopper"}, 64: {"ada"}, 32: set()}[tile]
        chunk_o.check_shared_mem = lambda arch="none", tensor_idx=0: arch in largest
    try:
        yield
    finally:
        chunk_o.check_shared_mem, chunk_o.IS_NVIDIA_HOPPER = saved


def fla_run(x: dict, tile: int | None) -> tuple:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ends = torch.tensor(x["lengths"], device="cuda").cumsum(0)
    cu = torch.cat([ends.new_zeros(1), ends]).long()
    t = leaves(x)
    with forced_tile(tile):
        out, _ = chunk_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True, cu_seqlens=cu
        )
        out.backward(x["grad_out"])
    return out.detach(), {n: t[n].grad for n in t}


def timed(x: dict, tile: int | None, repeats: int = 4) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fla_run(x, tile)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true", help="bf16 only, fla's own tile and the 32-wide one")
    parser.add_argument(
        "--lengths", help="the packed row's sample lengths, e.g. 9,17,5,70 (samples under fla's 64-token chunk)"
    )
    args = parser.parse_args()
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else LENGTHS
    dtypes = (torch.bfloat16,) if args.quick else (torch.float32, torch.bfloat16)
    tiles = (None, 32) if args.quick else (None, 128, 64, 32)
    import fla
    import triton

    header = {
        "header": True,
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "fla": fla.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/fla_tiles.py --out DIR"
        + (" --quick" if args.quick else "")
        + (f" --lengths {args.lengths}" if args.lengths else ""),
        "lengths": list(lengths),
        "python": platform.python_version(),
    }
    os.makedirs(args.out, exist_ok=True)
    stored = open(os.path.join(args.out, "fla-tiles.jsonl"), "w")  # row by row: a timeout keeps what ran

    def keep(row: dict) -> None:
        print(json.dumps(row), flush=True)
        stored.write(json.dumps(row) + "\n")
        stored.flush()

    keep(header)
    for key_dim in (128, 64):
        for dtype in dtypes:
            x = inputs(key_dim, dtype, lengths)
            ref_out, ref_grads = reference(x)
            print(f"reference of {key_dim}-wide keys done", flush=True)
            for tile in tiles:
                row = {"key_dim": key_dim, "dtype": str(dtype).removeprefix("torch."), "tile": tile or "fla's own"}
                try:
                    out, grads = fla_run(x, tile)
                    row["output_error"] = error(out, ref_out)
                    row["grad_errors"] = {n: error(grads[n], ref_grads[n]) for n in ref_grads}
                    row["ms_forward_backward"] = timed(x, tile)
                except Exception as exc:  # a refused or failing tile is a row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                keep(row)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            reference(x)
            end.record()
            torch.cuda.synchronize()
            row = {"key_dim": key_dim, "dtype": "float32", "tile": "transformers' torch rule"}
            row["ms_forward_backward"] = start.elapsed_time(end)
            keep(row)
            torch.cuda.empty_cache()
    stored.close()


if __name__ == "__main__":
    main()
