"""What each distributed engine does with the training state: the tables the memory planner
(memory.py) and the interconnect planner (traffic.py) both count from."""
from __future__ import annotations

# What each engine does with the training state, per GPU: shards (divides by the number of GPUs)
# or offloads to CPU memory. Counted from the DeepSpeed ZeRO paper and docs and PyTorch FSDP's.
ENGINE_SHARDING = {
    #                          parameters      gradients   optimizer state
    "ddp":                     ("replica",     "replica",  "replica"),
    "deepspeed-zero2":         ("replica",     "shard",    "shard"),
    "deepspeed-zero2-offload": ("replica",     "shard",    "cpu"),
    "deepspeed-zero3":         ("shard",       "shard",    "shard"),
    "deepspeed-zero3-offload": ("cpu",         "shard",    "cpu"),
    "fsdp":                    ("shard",       "shard",    "shard"),
}
TRAINED_STATE_BYTES = {
    # per trained parameter: weights, gradients, optimizer state
    "lora": (4, 4, 8),   # fp32 LoRA weights and gradients; AdamW's two fp32 moments
    "full": (2, 2, 12),  # bf16 weights and gradients; fp32 master copy + two fp32 moments = 16
}
FSDP_FULL_STATE_BYTES = (4, 4, 8)
"""Full fine-tuning under FSDP: accelerate upcasts the sharded weights to fp32, the gradients
follow them, and there is no separate master copy."""
