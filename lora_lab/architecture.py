"""The architecture arithmetic of a model's config.json, with nothing else: each decoder layer's
kind and linear layers, the experts of a mixture of experts, and the parameter count. The one
place that knows how a family's config.json values become weights (the memory planner's
planning/shape.py, the presets' size classes and the loader read it)."""

from __future__ import annotations

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
"""The config.json keys that count a mixture-of-experts model's experts (Qwen3-MoE and Qwen3.5-MoE;
gpt-oss and Mixtral)."""


def expert_count(config: dict) -> int:
    """How many experts each MoE layer of a model with this config.json has (0: a dense model)."""
    text = config.get("text_config")
    shape = {**config, **text} if isinstance(text, dict) else config
    return max([int(shape.get(key) or 0) for key in EXPERT_COUNT_KEYS])


def is_mxfp4(config: dict) -> bool:
    """A checkpoint published in MXFP4 under its own quantization config (gpt-oss)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def streams_experts(config: dict) -> bool:
    """Whether QLoRA training reads this mixture of experts' experts from the checkpoint files
    only when it quantizes them, a layer at a time (models/expert_loading.py): a config.json whose
    experts take their width from moe_intermediate_size (Qwen3-MoE, a Qwen3.5-MoE language model),
    not MXFP4 (gpt-oss) and not a vision-language checkpoint's. The loader also needs one tensor
    per expert in the files (the published layout); fused expert tensors load with the rest."""
    return bool(expert_count(config) and config.get("moe_intermediate_size") and not is_mxfp4(config))


def expert_shape(config: dict) -> tuple[int, int, int]:
    """(experts, experts a token is routed to, expert width) of a mixture-of-experts layer; every
    decoder layer of the families lora-lab knows is one."""
    experts = expert_count(config)
    routed = config.get("num_experts_per_tok") or config.get("experts_per_token") or config.get("top_k_experts") or 0
    return experts, routed, config.get("moe_intermediate_size") or config["intermediate_size"]


def dense_mlp_beside_experts(config: dict) -> bool:
    """Gemma 4's mixture of experts keeps a dense MLP beside its experts in every layer."""
    return is_gemma4(config)


def is_gemma4(config: dict) -> bool:
    return str(config.get("model_type", "")).startswith("gemma4")


def expert_params(config: dict) -> int:
    """Every layer's fused experts (gate and up, down; gpt-oss's biases) and router: the
    parameters beside the linear layers of a mixture of experts (0 for a dense model)."""
    experts, _, width = expert_shape(config)
    if not experts:
        return 0
    h = config["hidden_size"]
    biases = experts * (2 * width + h) + experts if config.get("model_type") == "gpt_oss" else 0
    shared_gate = h if config.get("shared_expert_intermediate_size") else 0  # a router of the shared expert
    gemma4 = h + experts + 3 * h if is_gemma4(config) else 0  # the router's scales, the block's 3 norms
    return config["num_hidden_layers"] * (experts * 3 * h * width + experts * h + biases + shared_gate + gemma4)


def _mlp_linears(config: dict) -> list[tuple[int, int]]:
    """(in, out) of a layer's MLP linear layers: gate, up, down; a mixture of experts has none
    but its shared expert's (Qwen3.5-MoE; the shared expert's one-wide gate is a router, counted
    with the experts)."""
    h = config["hidden_size"]
    if not expert_count(config) or dense_mlp_beside_experts(config):
        i = config["intermediate_size"]
        return [(h, i), (h, i), (i, h)]
    shared = config.get("shared_expert_intermediate_size") or 0
    return [(h, shared), (h, shared), (shared, h)] if shared else []


def _attention_widths(config: dict) -> tuple[int, int]:
    """(query width, key/value width): from head_dim where the config gives it (Qwen3, Gemma 3:
    wider than hidden / heads)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads * head_dim, config.get("num_key_value_heads", heads) * head_dim


def layer_types(config: dict) -> list[str]:
    """Each decoder layer's kind: config.json's layer_types (Qwen3.5: linear_attention and
    full_attention; Gemma 3: sliding_attention and full_attention), else full attention."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])[:n]
    if config.get("model_type") in ("qwen3_5_text", "qwen3_5"):  # transformers' default layout
        every = config.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def has_linear_attention(config: dict) -> bool:
    return "linear_attention" in layer_types(config)


def linear_attention_widths(config: dict) -> tuple[int, int, int]:
    """A Gated DeltaNet layer's (key width, value width, value heads): q and k are key-wide,
    v and the output gate value-wide; the recurrent state is value heads x key dim x value dim."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return nk * config["linear_key_head_dim"], nv * config["linear_value_head_dim"], nv


def decoder_linear_shapes(config: dict) -> list[list[tuple[int, int]]]:
    """(in, out) of each linear of every decoder layer, by the layer's kind: a linear-attention
    layer has in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj where a full-attention
    one has q/k/v/o (Qwen3.5's q_proj twice as wide: the query and its output gate)."""
    if is_gemma4(config):
        return _gemma4_layers(config)
    if not has_linear_attention(config):
        return [linear_shapes(config)] * config["num_hidden_layers"]
    h = config["hidden_size"]
    mlp = _mlp_linears(config)
    key, value, heads = linear_attention_widths(config)
    linear = [(h, 2 * key + value), (h, value), (h, heads), (h, heads), (value, h)]
    q, kv = _attention_widths(config)
    gate = 2 if config.get("attn_output_gate", True) else 1
    full = [(h, gate * q), (h, kv), (h, kv), (q, h)]
    return [(linear if kind == "linear_attention" else full) + mlp for kind in layer_types(config)]


def _linear_attention_extras(config: dict) -> int:
    """Parameters of a hybrid model beside its linears and embeddings: every layer's two norms,
    a full-attention layer's q and k norms, a linear-attention layer's depthwise conv (no bias),
    dt_bias, A_log and gated norm."""
    h = config["hidden_size"]
    key, value, heads = linear_attention_widths(config)
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    conv = (2 * key + value) * config["linear_conv_kernel_dim"]
    per_kind = {"linear_attention": conv + 2 * heads + config["linear_value_head_dim"], "full_attention": 2 * head_dim}
    return sum(2 * h + per_kind.get(kind, 0) for kind in layer_types(config)) + h


def cache_widths(config: dict) -> tuple[int, int, int, int]:
    """What generation caches, by layer kind: (values a token keeps in the full-attention layers'
    keys and values, in the sliding-window layers', their window in tokens (0: none), bytes a
    sequence keeps in the linear-attention layers' states: the recurrent state in fp32 and the
    conv's last kernel-width inputs in bf16, as transformers' cache holds them). Gemma 4's full
    layers have their own head width; its layers that share another's keys are counted as their
    own (the safe side)."""
    _, kv = _attention_widths(config)
    full_kv = kv
    kinds = layer_types(config)
    if is_gemma4(config) and "full_attention" in kinds:
        full_kv = config["num_key_value_heads"] * gemma4_head_dim(config, kinds.index("full_attention"))
    window = config.get("sliding_window") or 0
    state = 0
    if "linear_attention" in kinds:
        key, value, heads = linear_attention_widths(config)
        per_layer = heads * config["linear_key_head_dim"] * config["linear_value_head_dim"] * 4
        per_layer += (2 * key + value) * config["linear_conv_kernel_dim"] * 2
        state = kinds.count("linear_attention") * per_layer
    sliding = kinds.count("sliding_attention") if window else 0
    full = len(kinds) - kinds.count("linear_attention") - sliding
    return 2 * full_kv * full, 2 * kv * sliding, window, state


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer; q/k/v and gate/up fused where the
    family fuses them (Phi-3). A hybrid model (decoder_linear_shapes) gives its linear-attention
    layer's, the MLP's output projection last."""
    if has_linear_attention(config) or is_gemma4(config):
        return decoder_linear_shapes(config)[0]
    h = config["hidden_size"]
    q, kv = _attention_widths(config)
    if config.get("model_type") == "phi3":
        i = config["intermediate_size"]
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), *_mlp_linears(config)]


def parameter_count(config: dict) -> int:
    """Every parameter of the model config.json describes: linears, embedding, the output head
    unless tied, two norms a layer and the final one, q/k/v biases where the family has them
    (Qwen2)."""
    h, n, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    if is_gemma4(config):
        linears = sum(a * b for layer in _gemma4_layers(config) for a, b in layer)
        return linears + vocab * h + _gemma4_extras(config) + expert_params(config)
    if has_linear_attention(config):
        head = 0 if config.get("tie_word_embeddings") else vocab * h
        linears = sum(a * b for layer in decoder_linear_shapes(config) for a, b in layer)
        return linears + vocab * h + head + _linear_attention_extras(config) + expert_params(config)
    q, kv = _attention_widths(config)
    biased = config.get("model_type") == "qwen2" or config.get("attention_bias")
    biases = q + 2 * kv if biased else 0
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    linears = n * sum(a * b for a, b in linear_shapes(config))
    return linears + vocab * h + head + n * (biases + 2 * h) + h + expert_params(config)


def gemma4_head_dim(config: dict, index: int) -> int:
    """The head width of Gemma 4's layer `index`: a full-attention layer's global_head_dim (512
    where the config names none), a sliding layer's head_dim. transformers 5.25 and later save
    the full layers' width as a per-layer override instead (per_layer_config: {"1": {"head_dim":
    512}}), which wins where present."""
    override = ((config.get("per_layer_config") or {}).get(str(index)) or {}).get("head_dim")
    if override:
        return override
    return (
        (config.get("global_head_dim") or 512)
        if layer_types(config)[index] == "full_attention"
        else config["head_dim"]
    )


def _gemma4_layers(config: dict) -> list[list[tuple[int, int]]]:
    """Gemma 4's decoder layers: a full-attention layer's heads are global_head_dim wide (and
    num_global_key_value_heads many, where attention_k_eq_v, which also drops its v_proj: v is
    k); the last num_kv_shared_layers layers reuse an earlier layer's keys and values (no k_proj,
    v_proj) and, with use_double_wide_mlp, have an MLP twice as wide; a per-layer input (PLE) adds
    a gate and a projection; the MLP's output projection last."""
    h, n, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    shared_from = n - (config.get("num_kv_shared_layers") or 0)
    k_eq_v = bool(config.get("attention_k_eq_v"))
    ple = config.get("hidden_size_per_layer_input") or 0
    layers = []
    for index, kind in enumerate(layer_types(config)):
        full = kind == "full_attention"
        head_dim = gemma4_head_dim(config, index)
        kv = config["num_key_value_heads"]
        if full and k_eq_v and config.get("num_global_key_value_heads"):
            kv = config["num_global_key_value_heads"]
        shared = index >= shared_from
        attention = [(h, heads * head_dim)]
        attention += [] if shared else [(h, kv * head_dim)] + ([] if full and k_eq_v else [(h, kv * head_dim)])
        attention += [(heads * head_dim, h)]
        width = config["intermediate_size"] * (2 if config.get("use_double_wide_mlp") and shared else 1)
        per_layer_input = [(h, ple), (ple, h)] if ple else []
        layers.append(attention + per_layer_input + [(h, width), (h, width), (width, h)])
    return layers


def _gemma4_extras(config: dict) -> int:
    """Gemma 4's parameters beside its decoder linears, embedding and experts: the per-layer
    input (PLE) table, its projection and norm, each layer's four norms (and its PLE norm), the
    q and k norms, the final norm."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    ple = config.get("hidden_size_per_layer_input") or 0
    table = config.get("vocab_size_per_layer_input", config["vocab_size"]) * n * ple + h * n * ple + ple if ple else 0
    shared_from = n - (config.get("num_kv_shared_layers") or 0)
    norms = 0
    for index in range(n):
        head_dim = gemma4_head_dim(config, index)
        norms += 4 * h + (h if ple else 0) + head_dim + (head_dim if index < shared_from else 0)
    return table + norms + h
