"""Attention kernels for packed rows on this GPU: time, agreement and first-call cost.

  python bench/attention_bench.py [--out DIR]

Qwen2.5-7B's attention shape (28 query heads, 4 key/value heads, head dim 128) on rows of 8192
tokens: two 4096-token samples, eight of 1024, and rows of mixed lengths (each a new set of
lengths, as packed SFT data brings). Kernels: flash varlen (torch.nn.attention.varlen, what
data.packed_attention=varlen runs), cuDNN over the whole row with cumulative lengths
(aten._cudnn_attention_forward), sdpa once per sample with the cuDNN or the flash backend, and
lora-lab's cuDNN batch for rows of one sample length (models/attention.cudnn_equal_lengths).
Each is checked against flash varlen (output and input gradients) and timed forward + backward
(median of 10 after 3 warm-up calls); "first" is the first call on a new set of lengths.
Prints one JSON line per (kernel, row) and writes DIR/attention-bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM, ROW = 28, 4, 128, 8192


def flash_varlen(q, k, v, lengths):
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    cu = cumulative(lengths, q.device)
    params = inspect.signature(varlen_attn).parameters
    options = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **options)


def cumulative(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


class CudnnVarlen(torch.autograd.Function):
    """cuDNN over the whole row from cumulative lengths (the nested-tensor entry of aten);
    its backward call fails on torch 2.11 (bench/results/2026-12-01-attention-bench.jsonl)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest):
        result = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False, scale=DIM**-0.5
        )
        out, lse, seed, offset = result[0], result[1], result[6], result[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.longest = longest
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            seed,
            offset,
            torch.empty(0, device=q.device),
            cu,
            cu,
            ctx.longest,
            ctx.longest,
            0.0,
            True,
            scale=DIM**-0.5,
        )
        return dq, dk, dv, None, None


def cudnn_varlen(q, k, v, lengths):
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    return CudnnVarlen.apply(q, k, v, cumulative(lengths, q.device), max(lengths))


def per_sample(backend):
    def attend(q, k, v, lengths):
        outputs, start = [], 0
        with sdpa_kernel(backend):
            for length in lengths:
                part = [t[start : start + length].transpose(0, 1)[None] for t in (q, k, v)]
                outputs.append(
                    F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                )
                start += length
        return torch.cat(outputs)

    return attend


def cudnn_batch(q, k, v, lengths):
    """lora-lab's varlen path on rows of one sample length: the samples as one cuDNN batch."""
    from lora_lab.models.attention import cudnn_equal_lengths

    if len(set(lengths)) != 1:
        raise ValueError("rows of mixed lengths stay on flash varlen")
    out = cudnn_equal_lengths(*(t.transpose(0, 1)[None] for t in (q, k, v)), lengths, torch.bfloat16, DIM**-0.5)
    if out is None:
        raise RuntimeError("cuDNN did not take the shape")
    return out[0]


KERNELS = {
    "flash-varlen": flash_varlen,
    "cudnn-varlen": cudnn_varlen,
    "sdpa-cudnn-per-sample": per_sample(SDPBackend.CUDNN_ATTENTION),
    "sdpa-flash-per-sample": per_sample(SDPBackend.FLASH_ATTENTION),
    "cudnn-batch": cudnn_batch,
}


def mixed_rows(count: int, seed: int = 0) -> list:
    rng, rows = random.Random(seed), []
    for _ in range(count):
        lengths, left = [], ROW
        while left > 64:
            length = min(left, rng.choice([rng.randint(40, 300), rng.randint(200, 1500), rng.randint(1500, 4096)]))
            lengths.append(length)
            left -= length
        rows.append(lengths)
    return rows


def inputs(lengths, seed=0):
    torch.manual_seed(seed)
    total = sum(lengths)
    make = lambda heads: torch.randn(total, heads, DIM, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    return [t.requires_grad_(True) for t in (q, k, v)], torch.randn_like(q)


def run(kernel, lengths, grad):
    (q, k, v), _ = inputs(lengths)
    out = kernel(q, k, v, lengths)
    out.backward(grad)
    return out, (q.grad, k.grad, v.grad)


def timed(kernel, lengths, repeat=10):
    (q, k, v), grad = inputs(lengths)
    seconds = []
    for _i in range(repeat + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        kernel(q, k, v, lengths).backward(grad)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[0], statistics.median(seconds[3:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rows = {"2x4096": [4096, 4096], "4x2048": [2048] * 4, "8x1024": [1024] * 8, "1x8192": [8192]}
    rows.update({f"mixed-{i}": r for i, r in enumerate(mixed_rows(4))})
    records = []
    for row_name, lengths in rows.items():
        _, grad = inputs(lengths)
        reference, reference_grads = run(flash_varlen, lengths, grad)
        for name, kernel in KERNELS.items():
            record = {"kernel": name, "row": row_name, "samples": len(lengths)}
            try:
                first, median = timed(kernel, lengths)
                out, grads = run(kernel, lengths, grad)
                record.update(
                    {
                        "first_call_ms": round(first * 1e3, 2),
                        "fwd_bwd_ms": round(median * 1e3, 3),
                        "max_diff_out": (out.float() - reference.float()).abs().max().item(),
                        "max_diff_grads": [
                            (a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference_grads)
                        ],
                    }
                )
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(record), flush=True)
            records.append(record)
    header = {
        "header": True,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/attention_bench.py",
    }
    Path(args.out, "attention-bench.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")


if __name__ == "__main__":
    main()
