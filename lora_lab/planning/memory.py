"""The memory planner: predicted peak GPU memory of a lora-lab run, broken down. Imports no torch.

peak = weights (less the input embedding when it lives in CPU memory)
     + LoRA (fp32 weights, gradients, Adam moments: 16 bytes a parameter)
     + activation checkpoints (one bf16 hidden state per layer per token; 0 when offloaded)
     + per-token working memory of the layer being recomputed (its MLP part counted over one
       chunk of tokens when the MLP runs in chunks), plus the fused loss's chunks
     + the attention mask of a packed row (tokens x tokens, counted)
     + a constant (allocator and kernel workspaces)
The memory means (models/memory_means.py) are chosen by `choose_memory_means`, here and in
training. The last two terms are an empirical fit to measured peaks (`python
bench/fit_planner.py` refits them; docs/memory-planner.md); the others are counted from the
model's config.
"Peak" is torch.cuda.max_memory_reserved: the CUDA context (about 0.3-0.5 GiB) comes on top, which
is why a card of G GiB is planned with G - 0.5 GiB.

Several GPUs and the distributed engines are planned per GPU (planning/engines.py); hybrid
linear-attention and mixture-of-experts layers add their own terms (planning/shape.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..architecture import is_mxfp4, streams_experts
from ..config import PAIRED_TASKS, REFERENCE_TASKS, RunConfig, engine_of, trains_adapter, world_size_of
from ..config.rules import expert_lora_rank_grouped
from ..registry import model_config_of, model_display_name, wants_trainable_tokens
from .engines import engine_parts
from .generation import generation_part
from .memory_plan import CONTEXT_GIB, HOST_SHARE, MemoryPlan, usable_host_gib
from .policies import resolve_fast_lora, resolve_liger_experts
from .shape import ModelShape, layer_kind_parts
from .tuners import ADAPTER_NAMES, adapter_state_part, dora_parts

GIB = 2**30
# Fitted by weighted least squares on every successful single-GPU lora-lab benchmark cell
# (`python bench/fit_planner.py`; docs/memory-planner.md).
FIT_CONSTANT_GIB = 0.1480
FIT_BYTES_PER_TOKEN_PER_HIDDEN = 39.34
FIT_BYTES_PER_TOKEN_PER_INTERMEDIATE = 11.875
FIT_16BIT_BYTES_PER_TOKEN_PER_HIDDEN = 13.32  # extra per token when the base is 16-bit
# The fast LoRA path (models/fast_lora/: the LoRA inputs in 16 bits where peft keeps fp32
# copies, gate and up kept for the MLP's own backward pass) works in other memory: its per-hidden
# and per-intermediate terms are the ones above times these, fitted on the fast-path cells by the
# same script after the terms above. On a 4-bit base it also holds base weights dequantized to
# bf16 for its products: FIT_FAST_NF4_MLP_COPIES times one decoder layer's MLP weights, fitted
# with the two scales (a count of weights, not of tokens).
FIT_FAST_HIDDEN_SCALE = 0.7444
FIT_FAST_INTERMEDIATE_SCALE = 0.0587
FIT_FAST_NF4_MLP_COPIES = 1.1803
NF4_BYTES_PER_WEIGHT = 0.5156  # 4 bits + double-quantized absmax per 64-weight block
UNFUSED_LOSS_BYTES_PER_LOGIT = 10  # bf16 logits, their fp32 copy and its gradient (estimate)
TIERS_GIB = {"8gb": 8, "12gb": 12, "16gb": 16, "24gb": 24}
"""Each hardware tier (preset name) and its card's memory in GiB."""
PACKED_MASK_BYTES_PER_PAIR = 3  # the bool mask, and sdpa's bf16 additive copy (counted)
ROOM_SHARE = 0.90
"""Layers not recomputed (train.uncheckpointed_layers auto, and the plan's suggestion) stay
within this share of the usable memory: a margin for the fitted terms, whose plans fall some
percent under the measured peak of some cells (each cell's plan / measured: docs/memory-planner.md)."""
CHECKPOINTS_PART = "activation checkpoints (pinned)"
ALLOCATOR_PART, DEQUANTIZED_PART = "allocator and workspaces (fitted)", "4-bit weights dequantized (fitted)"
MAX_PLANNED_LENGTH = 1048576  # the longest length the plan searches for


@dataclass
class MemoryMeans:
    """Which long-sequence means (models/memory_means.py) a run uses."""

    embedding_on_cpu: bool = False
    offload_checkpoints: bool = False
    mlp_chunk_tokens: int = 0
    uncheckpointed_layers: int = 0  # the last N decoder layers are not recomputed
    checkpoint_tokens: int = 0  # offloaded checkpoints: the tokens of a micro-batch, its longest

    def describe(self) -> str:
        parts = [
            name
            for name, on in (
                ("input embedding in CPU memory", self.embedding_on_cpu),
                ("layer checkpoints in CPU memory", self.offload_checkpoints),
            )
            if on
        ]
        if self.mlp_chunk_tokens:
            parts.append(f"MLP in chunks of {self.mlp_chunk_tokens} tokens")
        if self.uncheckpointed_layers:
            parts.append(f"the last {self.uncheckpointed_layers} layers not recomputed")
        return ", ".join(parts) or "none"


def choose_memory_means(
    config: RunConfig,
    on_gpu: bool,
    tied_embeddings: bool,
    row_tokens: int | None = None,
    budget_gib: float | None = None,
) -> MemoryMeans:
    """What `auto` / on / off mean for this run. The means serve LoRA in one process with
    gradient checkpointing (their nested backward is not seen by DDP or DeepSpeed); `true`
    elsewhere is refused by the config's validation.

    MLP chunks cost a third pass through every MLP: with a GPU budget (GiB usable) they are used
    only when the plan without them does not fit it. So are a grpo run's checkpoints in CPU
    memory (offload_checkpoints auto): its steps train many short completions, whose copies to
    and from the host cost more than they save where the plan fits without them."""
    t = config.train
    single = t.gpus == 1 and engine_of(t) == "ddp" and trains_adapter(t) and t.gradient_checkpointing
    row_tokens = row_tokens or config.data.max_length

    def wanted(setting, auto: bool) -> bool:
        return single and (setting is True or (setting == "auto" and auto))

    chunk = t.mlp_chunk_tokens if single and 0 < t.mlp_chunk_tokens < row_tokens else 0
    kept = t.uncheckpointed_layers if single else 0
    means = MemoryMeans(
        embedding_on_cpu=not tied_embeddings and wanted(config.model.embedding_on_cpu, on_gpu),
        offload_checkpoints=wanted(t.offload_checkpoints, on_gpu),
        mlp_chunk_tokens=chunk,
        uncheckpointed_layers=kept if isinstance(kept, int) else 0,  # "auto": decided below
    )
    if means.offload_checkpoints:  # the pinned host memory is sized for the longest micro-batch
        means = replace(means, checkpoint_tokens=row_tokens * micro_batch_rows(config))
    model_config = model_config_of(config.model.name)
    if budget_gib is None or model_config is None:
        return means
    shape = ModelShape.from_config(model_config)
    tokens = row_tokens * micro_batch_rows(config)
    if chunk:
        unchunked = replace(means, mlp_chunk_tokens=0)
        if sum(_parts(shape, config, tokens, unchunked).values()) <= budget_gib:
            means = unchunked
    if means.offload_checkpoints and t.task == "grpo" and t.offload_checkpoints == "auto":
        kept_on_gpu = replace(means, offload_checkpoints=False, checkpoint_tokens=0)
        if sum(_parts(shape, config, tokens, kept_on_gpu).values()) <= budget_gib:
            means = kept_on_gpu
    if kept == "auto":
        means = replace(means, uncheckpointed_layers=_room_for_layers(shape, config, tokens, means, budget_gib))
    return means


def _room_for_layers(shape: ModelShape, config: RunConfig, tokens: int, means: MemoryMeans, budget_gib: float) -> int:
    """How many more decoder layers could keep their activations (not be recomputed) with the
    plan staying within ROOM_SHARE of the budget."""
    per_layer = _kept_layer_bytes(shape, tokens, resolve_fast_lora(config)) / GIB
    planned = sum(_parts(shape, config, tokens, means).values())
    room = int((ROOM_SHARE * budget_gib - planned) / per_layer)
    return max(0, min(room, shape.layers - min(means.uncheckpointed_layers, shape.layers)))


def plan_memory(
    config: RunConfig,
    gpu_memory_gib: float | None = None,
    longest_sample_tokens: int | None = None,
    cpu_memory_gib: float | None = None,
) -> MemoryPlan:
    """Predicted peak of `config` on a GPU; tokens from the data's longest sample when known.
    cpu_memory_gib: the machine's RAM, which a one-GPU run's host memory is planned against."""
    model_config = model_config_of(config.model.name)
    if model_config is None:
        raise ValueError(f"unknown model shape: {config.model.name}")
    shape = ModelShape.from_config(model_config)
    row = row_length(config)
    longest = longest_sample_tokens + completion_tokens(config) if longest_sample_tokens else row
    tokens = min(row, longest) * micro_batch_rows(config)
    plan = MemoryPlan(
        model=model_display_name(config.model.name),
        quantization=_method(config),
        tokens_per_micro_batch=tokens,
        gpus=world_size_of(config.train),
        nodes=config.train.nodes,
        engine=engine_of(config.train),
        tuner=config.train.tuner,
        packed=config.data.packing,
    )
    budget = usable_gib(gpu_memory_gib)
    means = None
    if _single_gpu_lora(config):
        means = _means(shape, config, tokens, budget)
        plan.parts_gib = _parts(shape, config, tokens, means)
        plan.means = means.describe()
        plan.kept = min(means.uncheckpointed_layers, shape.layers)
        if means.offload_checkpoints:
            recomputed = shape.layers - plan.kept
            plan.cpu_parts_gib[CHECKPOINTS_PART] = _checkpoint_bytes(shape, tokens) * recomputed / shape.layers / GIB
        if means.embedding_on_cpu:
            plan.cpu_parts_gib["input embedding table"] = shape.vocab * shape.hidden * 2 / GIB
        plan.cpu_budget_gib = usable_host_gib(cpu_memory_gib)
        plan.loading_host_gib = loading_host_bytes(shape, config, model_config) / GIB
    else:
        plan.parts_gib, plan.cpu_parts_gib = _distributed_parts(shape, config, tokens)
        plan.counted = True
    if config.train.nodes > 1:
        from .traffic import plan_traffic

        plan.traffic = plan_traffic(config, shape.params, shape.trained_params(config.train.tuner, config.lora.rank))
    if budget is not None:  # a GPU of gpu_memory_gib
        _against_budget(plan, shape, config, tokens, budget, means)
    return plan


def _against_budget(
    plan: MemoryPlan, shape: ModelShape, config: RunConfig, tokens: int, budget: float, means: MemoryMeans | None
) -> None:
    """The plan on a GPU of `budget` usable GiB: the longest length that fits and the fixes."""
    plan.budget_gib = budget
    longest = _longest(shape, config, budget) or 0
    if plan.cpu_budget_gib is not None:  # and the machine's RAM holds its offloaded checkpoints
        longest = min(longest, _host_longest(config, plan))
    prompt = longest - completion_tokens(config)  # grpo: + completion
    plan.longest_max_length = prompt if prompt > 0 else None
    if completion_tokens(config):
        plan.fixes.append(f"--max-completion-length {max(1, completion_tokens(config) // 2)}")
    if plan.longest_max_length:
        plan.fixes.append(
            f"--set data.pack_length={plan.longest_max_length}"
            if config.data.packing
            else f"--max-length {plan.longest_max_length}"
        )
    loading = plan.loading_host_gib + plan.host_gib - plan.cpu_total_gib  # with the process
    if plan.cpu_budget_gib is not None and loading > plan.cpu_budget_gib:
        plan.fixes.append(
            f"a machine with {math.ceil(loading / HOST_SHARE)} GiB of RAM or more (the 16-bit weights pass "
            f"through CPU memory while the model loads)"
        )
    elif plan.cpu_fits is False and CHECKPOINTS_PART in plan.cpu_parts_gib:
        plan.fixes.append("--set train.offload_checkpoints=false (checkpoints on the GPU, not in RAM)")
    if config.model.quantization == "none" and config.train.tuner in ("lora", "dora"):
        plan.fixes.append("--quantization nf4 (QLoRA)")
    if config.train.tuner == "full" and config.train.engine != "deepspeed-zero3-offload":
        plan.fixes.append("more --gpus with --engine deepspeed-zero3 (or -zero3-offload)")
    if micro_batch_rows(config) > 1:
        plan.fixes.append("--micro-batch-size 1 with a larger --grad-accum")
    if plan.kept:
        plan.fixes.insert(0, "fewer train.uncheckpointed_layers")
    if means is not None and config.train.gradient_checkpointing:  # one GPU, an adapter
        plan.room_for_layers = _room_for_layers(shape, config, tokens, means, budget)


def loading_host_bytes(shape: ModelShape, config: RunConfig, model_config: dict) -> float:
    """What QLoRA holds in CPU memory while it loads (models/load.py): an MXFP4 checkpoint read
    de-quantized, every weight in 16 bits; a mixture of experts, its 16-bit experts beside the
    rest (its linear layers quantized by bitsandbytes there), unless its experts stream from the
    files onto the GPU (architecture.streams_experts). Elsewhere the weights load onto the GPU: 0."""
    if config.model.quantization != "nf4" or streams_experts(model_config):
        return 0
    if is_mxfp4(model_config):
        return shape.params * 2
    experts = shape.layers * shape.layer_experts
    if not experts:
        return 0
    return experts * 2 + (shape.linear_params - experts) * NF4_BYTES_PER_WEIGHT + shape.other_params * 2


def _host_longest(config: RunConfig, plan: MemoryPlan) -> int:
    """The longest row whose offloaded checkpoints, with the rest of the host memory, fit the
    machine's RAM (cpu_budget_gib); a multiple of 256."""
    assert plan.cpu_budget_gib is not None
    checkpoints = plan.cpu_parts_gib.get(CHECKPOINTS_PART, 0.0)
    fixed = plan.host_gib - checkpoints
    loading = plan.loading_host_gib + plan.host_gib - plan.cpu_total_gib  # with the process
    if max(fixed, loading) > plan.cpu_budget_gib:  # at any length
        return 0
    if not checkpoints:
        return MAX_PLANNED_LENGTH
    per_row_token = checkpoints / plan.tokens_per_micro_batch * micro_batch_rows(config)  # linear in tokens
    return max(0, int((plan.cpu_budget_gib - fixed) / per_row_token) // 256 * 256)


def row_length(config: RunConfig) -> int:
    """Tokens in one row of a micro-batch: a sample (max_length) or a packed row."""
    if config.data.packing:
        return config.data.pack_length or config.data.max_length * config.train.micro_batch_size
    return config.data.max_length + completion_tokens(config)


def completion_tokens(config: RunConfig) -> int:
    """--task grpo: the sampled completion after each prompt (data.max_length bounds the prompt)."""
    return config.grpo.max_completion_length if config.train.task == "grpo" else 0


def micro_batch_rows(config: RunConfig) -> int:
    """Rows in a micro-batch: packed rows go one at a time; a preference sample is two rows of
    one forward pass (the chosen and the rejected sequence; KTO: the answer and the mismatched
    answer of its KL estimate)."""
    rows = 1 if config.data.packing else config.train.micro_batch_size
    return rows * sequences_per_sample(config)


def sequences_per_sample(config: RunConfig) -> int:
    """Sequences the model reads per training sample: 2 for pairs and KTO, else 1."""
    return 2 if config.train.task in PAIRED_TASKS + ("kto",) else 1


def _reference_bytes(shape: ModelShape, tokens: int) -> float:
    """dpo, kto: the reference forward runs without gradients while the policy's checkpoints
    are held; it keeps one layer's tensors live at a time, about 4 hidden-sized and 2
    intermediate-sized bf16 tensors a token (residual, norm, attention output; gate, up).
    Counted, not fitted."""
    return tokens * 2 * (4 * shape.hidden + 2 * shape.intermediate)


def _means(shape: ModelShape, config: RunConfig, tokens: int, budget_gib: float | None = None) -> MemoryMeans:
    row = max(1, tokens // micro_batch_rows(config))
    return choose_memory_means(config, on_gpu=True, tied_embeddings=shape.tied, row_tokens=row, budget_gib=budget_gib)


def _checkpoint_bytes(shape: ModelShape, tokens: int) -> float:
    return tokens * shape.layers * shape.hidden * 2


def _no_checkpoint_bytes(shape: ModelShape, tokens: int) -> float:
    """Without gradient checkpointing every layer keeps its activations for the backward pass:
    about 14 hidden-sized and 4 intermediate-sized bf16 tensors a token (norm inputs and
    outputs, q/k/v/o, the LoRA dropout copies; gate, up, their product). Counted, not fitted: it
    errs on the safe side (plan against the measured peak: docs/benchmarks.md)."""
    return tokens * shape.layers * 2 * (14 * shape.hidden + 4 * shape.intermediate)


def _kept_layer_bytes(shape: ModelShape, tokens: int, fast: bool) -> float:
    """A layer that is not recomputed keeps its activations for the backward pass: on the fast
    LoRA path (models/fast_lora) gate and up and about 4 hidden-sized bf16 tensors a token (the
    inputs of the norms and projections, the attention's output), checked against runs with
    layers kept (docs/benchmarks-history.md); on peft's path
    _no_checkpoint_bytes' count."""
    if not fast:
        return _no_checkpoint_bytes(shape, tokens) / shape.layers
    return tokens * 2 * (4 * shape.hidden + 2 * shape.intermediate)


def usable_gib(gpu_memory_gib: float | None) -> float | None:
    """What a run may plan with on a GPU of this size: less the CUDA context. None: no GPU."""
    return gpu_memory_gib - CONTEXT_GIB if gpu_memory_gib else None


def _parts(shape: ModelShape, config: RunConfig, tokens: int, means: MemoryMeans | None = None) -> dict:
    weight_bytes = 2 if config.model.quantization == "none" else NF4_BYTES_PER_WEIGHT
    if config.model.dtype == "fp32":
        weight_bytes = 4
    means = means or _means(shape, config, tokens)
    tuner = config.train.tuner
    adapter = shape.trained_params(tuner, config.lora.rank)
    if config.lora.experts:  # the fused experts' adapters, and one layer's experts with their delta
        adapter += shape.expert_lora_per_rank * config.lora.rank
    hidden_bytes, intermediate_bytes = working_terms(shape, config, tokens, means)
    hidden_scale, intermediate_scale = fast_lora_scales(config)
    working = hidden_bytes * hidden_scale + intermediate_bytes * intermediate_scale
    other = shape.other_params - (shape.vocab * shape.hidden if means.embedding_on_cpu else 0)
    weights = "weights" + (" (input embedding in CPU memory)" if means.embedding_on_cpu else "")
    parts = {
        weights: (shape.linear_params * weight_bytes + other * 2) / GIB,
        adapter_state_part(tuner): adapter * 16 / GIB,
        "activation checkpoints": 0.0 if means.offload_checkpoints else _checkpoint_bytes(shape, tokens) / GIB,
        "recomputed layer + fused loss (fitted)": working / GIB,
        ALLOCATOR_PART: FIT_CONSTANT_GIB,
    }
    fused_experts = shape.liger_experts and config.model.kernels != "none" and resolve_liger_experts(config)
    # through liger's fused MoE: layer_kind_parts' copy; through transformers' experts in low rank: none
    if (
        config.lora.experts
        and not fused_experts
        and not expert_lora_rank_grouped(config.lora.rank, 4 if config.model.dtype == "fp32" else 2)
    ):
        parts["one layer's experts with their LoRA delta (counted)"] = 2 * shape.layer_experts * 2 / GIB
    dequantized = dequantized_mlp_bytes(shape, config)
    if dequantized:
        parts[DEQUANTIZED_PART] = FIT_FAST_NF4_MLP_COPIES * dequantized / GIB
    kept = min(means.uncheckpointed_layers, shape.layers)
    if kept:  # their checkpoints are not made; their activations are kept instead
        parts["activation checkpoints"] *= (shape.layers - kept) / shape.layers
        parts[f"{kept} layers kept, not recomputed (fitted)"] = (
            _kept_layer_bytes(shape, tokens, resolve_fast_lora(config)) * kept / GIB
        )
    if not config.train.gradient_checkpointing:
        del parts["activation checkpoints"]
        parts["activations of every layer (no checkpointing; counted)"] = _no_checkpoint_bytes(shape, tokens) / GIB
    if tuner == "dora":
        parts.update(
            {
                name: b / GIB
                for name, b in dora_parts(
                    shape.linears,
                    shape.layers,
                    tokens,
                    config.train.gradient_checkpointing,
                    4 if config.model.dtype == "fp32" else 2,
                    weight_bytes < 2,
                ).items()
            }
        )
    if config.train.task in REFERENCE_TASKS:
        parts["reference forward, no gradients (counted)"] = _reference_bytes(shape, tokens) / GIB
    if config.data.packing and config.data.packed_attention in ("mask", "auto", "positions"):
        # segments and varlen attend from the samples' lengths: no [tokens x tokens] mask;
        # auto counts as mask unless resolved first (training/plan.settle_packed_attention: the plan
        # API resolves it as a CUDA GPU runs it)
        parts["attention mask of a packed row (counted)"] = tokens * tokens * PACKED_MASK_BYTES_PER_PAIR / GIB
    kinds = layer_kind_parts(shape, tokens, weight_bytes < 2, fused_experts)
    parts.update({name: b / GIB for name, b in kinds.items()})
    if config.train.task != "grpo" and (  # grpo: TRL's fused LM head, in tiles
        not shape.fused_loss
        or config.model.kernels == "none"
        or wants_trainable_tokens(config.lora.trainable_tokens, config.train.tuner, config.model.name)
    ):
        parts["full logits for the loss (estimate)"] = tokens * shape.vocab * UNFUSED_LOSS_BYTES_PER_LOGIT / GIB
    if config.train.task == "grpo":
        held = (weights, adapter_state_part(tuner), ALLOCATOR_PART, DEQUANTIZED_PART)  # kept through generation
        step = sum(v for k, v in parts.items() if k not in held)
        parts.update(generation_part(shape, config, tokens // micro_batch_rows(config), step))
    return parts


def working_terms(shape: ModelShape, config: RunConfig, tokens: int, means: MemoryMeans) -> tuple[float, float]:
    """The recomputed layer's fitted working memory in bytes as peft's path holds it: (the
    per-hidden term, the per-intermediate term, over a chunk's tokens where the MLP runs in
    chunks). fast_lora_scales says what the fast path holds instead."""
    per_hidden = FIT_BYTES_PER_TOKEN_PER_HIDDEN + (
        FIT_16BIT_BYTES_PER_TOKEN_PER_HIDDEN if config.model.quantization == "none" else 0
    )
    mlp_tokens = tokens
    if means.mlp_chunk_tokens:
        mlp_tokens = means.mlp_chunk_tokens * micro_batch_rows(config)
    return (tokens * per_hidden * shape.hidden, mlp_tokens * FIT_BYTES_PER_TOKEN_PER_INTERMEDIATE * shape.intermediate)


def fast_lora_scales(config: RunConfig) -> tuple[float, float]:
    """The factors of the per-hidden and per-intermediate working terms: the fast LoRA path's
    where the run takes it, 1 for peft's."""
    if resolve_fast_lora(config):
        return FIT_FAST_HIDDEN_SCALE, FIT_FAST_INTERMEDIATE_SCALE
    return 1.0, 1.0


def dequantized_mlp_bytes(shape: ModelShape, config: RunConfig) -> float:
    """One decoder layer's MLP weights in bf16 (gate, up, down) where the fast LoRA path runs
    on a 4-bit base and dequantizes them for its products; 0 elsewhere (peft's path: part of
    the fitted terms above)."""
    if config.model.quantization == "none" or not resolve_fast_lora(config):
        return 0.0
    return 3 * shape.hidden * shape.intermediate * 2


def _method(config: RunConfig) -> str:
    if config.train.tuner == "full":
        return "full fine-tuning (bf16 + fp32 AdamW)"
    name = ADAPTER_NAMES[config.train.tuner]
    return f"Q{name} nf4" if config.model.quantization == "nf4" else f"16-bit {name}"


def _single_gpu_lora(config: RunConfig) -> bool:
    """The measured, fitted case: an adapter on one GPU without an engine (fitted on LoRA runs;
    DoRA's extra terms are counted)."""
    t = config.train
    return world_size_of(t) == 1 and engine_of(t) == "ddp" and trains_adapter(t)


def _distributed_parts(shape: ModelShape, config: RunConfig, tokens: int) -> tuple[dict, dict]:
    """Per-GPU parts and CPU (offload) parts for N GPUs and an engine (engines.engine_parts over
    the single-GPU parts)."""
    return engine_parts(shape, config, _parts(shape, config, tokens))


def _longest(shape: ModelShape, config: RunConfig, budget_gib: float) -> int | None:
    if not _single_gpu_lora(config):
        fixed = _distributed_parts(shape, config, 0)[0]
        per_token = sum(_distributed_parts(shape, config, 1)[0].values()) - sum(fixed.values())
        room = budget_gib - sum(fixed.values())
        if room <= 0 or per_token <= 0:
            return None
        return int(room / per_token / config.train.micro_batch_size) // 256 * 256 or None
    mbs = micro_batch_rows(config)

    def fits(length: int) -> bool:
        means = _means(shape, config, length * mbs, budget_gib)
        return sum(_parts(shape, config, length * mbs, means).values()) <= budget_gib

    low, high = 0, MAX_PLANNED_LENGTH // 256  # multiples of 256; the peak grows with the length
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 256) else (low, middle - 1)
    return low * 256 or None
