"""What attention's forward and backward pass hold at long context, per kernel, on this GPU.

  python bench/attention_memory.py [--out DIR] [--lengths 32768,65536,131072]

Llama-3.1-8B's attention shape (32 query heads, 8 key/value heads, head dim 128), one causal
sample of each length, bf16: the peak GPU memory allocated beyond the inputs (q, k, v and the
incoming gradient) during forward + backward, in bytes per token and in bytes per token per
hidden element (hidden 4096), for flash varlen (torch.nn.attention.varlen: what
data.packed_attention=varlen runs; with enable_gqa where this torch has it, else k and v
repeated per query head as models/attention.varlen_attention does), and sdpa's cuDNN and flash
backends with enable_gqa. Prints one JSON line per (kernel, length) and writes
DIR/attention-memory.jsonl.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM, HIDDEN = 32, 8, 128, 4096


def varlen(q, k, v):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    cu = torch.tensor([0, q.shape[0]], device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, q.shape[0], q.shape[0], **options)


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


KERNELS = {
    "flash varlen": varlen,
    "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
}


def measure(name: str, length: int) -> dict:
    torch.cuda.empty_cache()
    q = torch.randn(1, HEADS, length, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, KV_HEADS, length, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    grad = torch.randn(length, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    row = {"kernel": name, "tokens": length}
    try:
        out = KERNELS[name](q, k, v)
        forward_peak = torch.cuda.max_memory_allocated() - base
        out = out.reshape(length, HEADS, DIM) if out.dim() == 3 else out[0].transpose(0, 1)
        out.backward(grad)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        row.update(
            forward_bytes_per_token=round(forward_peak / length),
            peak_bytes_per_token=round(peak / length),
            peak_bytes_per_token_per_hidden=round(peak / length / HIDDEN, 2),
        )
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--lengths", default="32768,65536,131072")
    args = parser.parse_args()
    from torch.nn.attention.varlen import varlen_attn

    header = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "varlen": str(inspect.signature(varlen_attn)),
    }
    print(json.dumps(header))
    rows = [header]
    for length in map(int, args.lengths.split(",")):
        for name in KERNELS:
            rows.append(measure(name, length))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "attention-memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
