"""Serving arithmetic: the vLLM command for a model folder and the memory flags that fit it on a
card of each tier (pure arithmetic, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import LoraLabError
from ..registry import family_of, model_config_of
from .memory import TIERS_GIB

HEADROOM_GIB = 1
"""Card memory left outside vLLM: the desktop and the driver (a "12 GB" card reports a little
less than 12 GiB). --gpu-memory-utilization = min(0.95, (card - 1 GiB) / card), 2 decimals down."""


SERVING_OVERHEAD_MIB = 1536
"""Inside vLLM's share, besides weights and KV cache (an estimate, not measured here): the CUDA
context and cuBLAS workspaces (~0.5 GiB), the activations of the profiling forward pass over a
2048-token prefill chunk (~0.3 GiB for 7B), the sampler's logits (~0.2 GiB) and CUDA graphs
(~0.5 GiB)."""


CONTEXT_LADDER = (32768, 16384, 8192, 4096, 2048, 1024, 512)


MIN_FULL_LENGTH_SEQS = 16
"""--max-model-len is the longest rung of CONTEXT_LADDER (up to the model's
max_position_embeddings) at which this many sequences fit in the KV cache at full length, so that
a chat server takes requests concurrently; where not even 16 x 512 tokens fit, the longest rung
at which one sequence fits (a single-user server). --max-num-seqs is then how many sequences fit
at that length, at most vLLM's default of 256."""


VLLM_DEFAULT_MAX_NUM_SEQS = 256


KV_CACHE_DTYPE_BYTES = 2  # bf16 / fp16 KV cache, vLLM's default


@dataclass
class ServingPlan:
    tier: str
    card_gib: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    kv_formula: str
    tokens_in_kv_cache: int
    max_model_len: int | None
    max_num_seqs: int | None

    @property
    def fits(self) -> bool:
        return self.max_model_len is not None

    def flags(self) -> str:
        return (
            f"--max-model-len {self.max_model_len} --max-num-seqs {self.max_num_seqs} "
            f"--gpu-memory-utilization {self.gpu_memory_utilization:.2f}"
        )

    def arithmetic(self) -> list[str]:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        lines = [
            f"vLLM budget on a {self.card_gib} GB card: {self.card_gib} GiB x "
            f"{self.gpu_memory_utilization:.2f} = {gib(self.budget_bytes)}",
            f"  - weights {gib(self.weights_bytes)} ({self.weights_bytes:,} bytes of safetensors)",
            f"  - overhead {gib(self.overhead_bytes)} (CUDA context, profiling activations, "
            f"sampler, CUDA graphs; estimated)",
            f"  = KV cache {gib(self.kv_cache_bytes)}",
            f"KV cache per token: {self.kv_formula} = {self.kv_bytes_per_token:,} bytes",
        ]
        if not self.fits:
            room = max(0, self.tokens_in_kv_cache)
            lines.append(
                f"does not fit: the KV cache has room for {room:,} tokens, fewer than "
                f"one {CONTEXT_LADDER[-1]}-token sequence. Use a 4-bit export or a "
                f"larger card."
            )
            return lines
        assert self.max_model_len is not None and self.max_num_seqs is not None  # both set where it fits
        used = self.kv_bytes_per_token * self.max_model_len * self.max_num_seqs
        lines.append(
            f"{self.kv_bytes_per_token:,} bytes x {self.max_model_len} tokens x "
            f"{self.max_num_seqs} sequences = {gib(used)} <= {gib(self.kv_cache_bytes)} "
            f"({self.tokens_in_kv_cache:,} tokens fit; every sequence can be full "
            f"length at once; shorter ones leave room for more)"
        )
        return lines


def kv_bytes_per_token(model_config: dict) -> tuple[int, str]:
    layers = model_config["num_hidden_layers"]
    kv_heads = model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    formula = (
        f"2 (K and V) x {layers} layers x {kv_heads} KV heads x {head_dim} head dim x {KV_CACHE_DTYPE_BYTES} bytes"
    )
    return 2 * layers * kv_heads * head_dim * KV_CACHE_DTYPE_BYTES, formula


def gpu_memory_utilization(card_gib: int) -> float:
    return min(95, (card_gib - HEADROOM_GIB) * 100 // card_gib) / 100


def plan_vllm_serving(model_config: dict, weights: int, tier: str) -> ServingPlan:
    """--max-model-len, --max-num-seqs and --gpu-memory-utilization for a card of `tier`, from
    the model's config.json and the weights' size in bytes. Pure arithmetic, no GPU needed."""
    if tier not in TIERS_GIB:
        raise LoraLabError(f"--gpu {tier}: unknown tier; choose one of {', '.join(TIERS_GIB)}.")
    card = TIERS_GIB[tier]
    utilization = gpu_memory_utilization(card)
    budget = card * 2**30 * round(utilization * 100) // 100
    overhead = SERVING_OVERHEAD_MIB * 2**20
    kv_cache = budget - weights - overhead
    per_token, formula = kv_bytes_per_token(model_config)
    tokens = kv_cache // per_token
    ladder = [n for n in CONTEXT_LADDER if n <= model_config.get("max_position_embeddings", CONTEXT_LADDER[0])]
    length = next(
        (n for n in ladder if tokens // n >= MIN_FULL_LENGTH_SEQS), next((n for n in ladder if tokens // n >= 1), None)
    )
    seqs = min(VLLM_DEFAULT_MAX_NUM_SEQS, tokens // length) if length else None
    return ServingPlan(
        tier=tier,
        card_gib=card,
        gpu_memory_utilization=utilization,
        budget_bytes=budget,
        weights_bytes=weights,
        overhead_bytes=overhead,
        kv_cache_bytes=kv_cache,
        kv_bytes_per_token=per_token,
        kv_formula=formula,
        tokens_in_kv_cache=tokens,
        max_model_len=length,
        max_num_seqs=seqs,
    )


def vllm_command(
    folder: Path | str, quantization: str | None = None, plan: ServingPlan | None = None, name: str = "finetuned"
) -> str:
    """`vllm serve` for a model folder; --quantization only where vLLM needs to be told."""
    command = f"vllm serve {folder} --served-model-name {name}"
    if quantization:
        command += f" --quantization {quantization}"
    if plan is not None and plan.fits:
        command += f" {plan.flags()}"
    return command


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_UNSERVED_ADAPTERS = {
    "dora": 'vLLM does not serve DoRA adapters (its PEFTHelper refuses use_dora: "vLLM does not '
    'yet support DoRA"): serve the merged folder.',
    "ia3": "vLLM serves LoRA adapters only, not IA3: serve the merged folder.",
    "experts": "the adapter also adapts the fused experts (lora.experts: peft target_parameters), which "
    "vLLM's LoRA loading reads differently from release to release, and has dropped without a word "
    "(vllm-project/vllm#41384): serve the merged folder, whose experts carry the delta.",
}
"""Adapter kinds (use.merge.adapter_kind_of) vLLM is not handed with --enable-lora. rsLoRA
(scaling alpha / sqrt(r), PEFTHelper) and PiSSA / OLoRA adapters converted to plain LoRA
(adapter/ of a lora.init pissa or olora run) load as LoRA. A mixture of experts' adapter without
lora.experts (attention, shared experts) is a plain LoRA, held to the family's vLLM modules."""


def vllm_lora_rank(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM offers that holds `rank` (None: above its largest)."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)


def _model_type(result) -> str | None:
    """The merged model's model_type: its folder's config.json, else the base model's."""
    import json

    path = Path(result.output_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else model_config_of(result.base_model)
    return (config or {}).get("model_type")


def vllm_commands(result, name: str = "finetuned") -> dict:
    """The `vllm serve` commands for a merge (use.merge.MergeResult): the merged folder, and the
    adapter on its base where vLLM can load it."""
    commands = {"merged": vllm_command(result.output_dir, name=name)}
    kind = result.adapter_kind
    if kind in VLLM_UNSERVED_ADAPTERS:
        return {"commands": commands, "warnings": [VLLM_UNSERVED_ADAPTERS[kind]]}
    rank = vllm_lora_rank(result.lora_rank)
    warnings = []
    if rank is None:
        warnings.append(
            f"LoRA rank {result.lora_rank} is above vLLM's largest --max-lora-rank "
            f"({VLLM_MAX_LORA_RANKS[-1]}): serve the merged folder."
        )
    else:
        commands["adapter"] = (
            f"vllm serve {result.base_model} --enable-lora --lora-modules "
            f"{name}={result.adapter_dir} --max-lora-rank {rank}"
        )
    family = family_of(_model_type(result))
    if family.vllm_lora_modules is None:
        warnings.append(
            f"vLLM's LoRA support for {family.name} is not known here: if the "
            f"adapter does not load, serve the merged folder."
        )
    else:
        unsupported = sorted(set(result.target_modules) - family.vllm_lora_modules)
        if unsupported:
            warnings.append(
                f"the adapter also trains {', '.join(unsupported)}, which vLLM's "
                f"LoRA support for {family.name} does not load: serve the merged "
                f"folder."
            )
    return {"commands": commands, "warnings": warnings}
