"""Would vLLM load a compressed-tensors export with the WNA16 (Marlin) scheme? Asked of every
w4a16 and awq export (use/export.py), whose report records the answer.

``vllm_wna16_problems(config)`` takes a model ``config.json`` dict (as written by
llm-compressor into an export folder) and returns the reasons vLLM would *not* load it
with ``CompressedTensorsWNA16`` on its Linear layers; an empty list means it would.
vLLM is not importable here, so every rule below is a hand-written mirror of the vLLM
source it names. Standard library only.

vLLM source read (github.com/vllm-project/vllm, via a stored code index; the index
gives commits, not dates -- 055e47c is a 2026 tree: it imports ``vllm.backends.*`` and
``vllm.foundation.*``):

* ``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py``
  @ 055e47c28003156421365af985d676fc921cb075 -- ``CompressedTensorsConfig.from_config``,
  ``_parse_sparsity_config``, ``_quantization_scheme_map_from_config``,
  ``_is_nvfp4_format`` / ``_is_mxfp4`` / ``_is_mxfp8``, ``_is_wNa16_group_channel``,
  ``_get_scheme_from_parts``, ``get_quant_method``, ``get_scheme_dict``,
  ``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``.
  Cross-read: the same file @ 008014e8503b206a8ae3eb9d17fd46b48b8d2606 and
  @ be696453ee1bf3b7a2f652cc457b340d5a20c88c (older: dispatch also required
  ``num_bits in WNA16_SUPPORTED_BITS``), and @ 004dadbe (oldest: required ``symmetric``).
* ``.../compressed_tensors/schemes/compressed_tensors_wNa16.py`` @ 055e47c --
  ``WNA16_SUPPORTED_TYPES_MAP`` (2..8 bits), ``WNA16_ZP_SUPPORTED_TYPES_MAP`` (4, 8),
  ``CompressedTensorsWNA16.__init__`` / ``create_weights``. Older trees
  (e.g. @ 519b90d4648d4455d32d0fc10b4734ba2ba324e1) map only {4, 8}.
* ``.../compressed_tensors/utils.py`` @ 008014e -- ``is_activation_quantization_format``,
  ``should_ignore_layer``, ``find_matched_target``, ``_is_equal_or_regex_match``,
  ``_match_fused_layer`` (not stored at 055e47c; 008014e is the closest stored version).
* ``vllm/model_executor/kernels/linear/mixed_precision/marlin.py`` and
  ``vllm/model_executor/layers/quantization/utils/marlin_utils.py`` @ 055e47c --
  ``MarlinLinearKernel.can_implement``, ``query_marlin_supported_quant_types``,
  ``MARLIN_SUPPORTED_GROUP_SIZES``, ``verify_marlin_supports_shape``.
* ``vllm/model_executor/models/qwen2.py`` @ 055e47c -- Linear layer names/classes,
  ``packed_modules_mapping``, ``lm_head`` as ``ParallelLMHead``.
* ``vllm/config/model.py`` @ 0052a5b818980ce8a0477706aaf9f75bd5af72cd
  (``ModelConfig._parse_quant_hf_config`` / ``_verify_quantization``) and
  ``vllm/transformers_utils/model_arch_config_convertor.py`` @ ee92a6f
  (``_normalize_quantization_config``): where the quant config is read and how
  ``quant_method`` is normalised. ``vllm/model_executor/layers/quantization/__init__.py``
  @ 0034007 maps ``"compressed-tensors"`` -> ``CompressedTensorsConfig``.
* compressed-tensors ``src/compressed_tensors/quantization/quant_args.py``
  @ 02012432e80a3d85355fe1019c24f80da277aaa1 -- ``QuantizationArgs`` validation, which
  vLLM runs on every group's ``weights`` (``QuantizationArgs.model_validate``).

Not checkable from config.json, so not checked: the GPU (WNA16 and Marlin need compute
capability >= 7.5, CUDA; ``_check_scheme_supported`` / ``MarlinLinearKernel``), the
compressed-tensors version installed next to vLLM, and which mixed-precision kernel
``choose_mp_linear_kernel`` picks on a given GPU (Marlin is one candidate; the Marlin
rules below say whether Marlin *can* take each layer).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

from .vllm_schemes import (
    ACTIVATION_QUANTIZATION_FORMATS,
    GPTQ_MARLIN_MIN_THREAD_K,
    GPTQ_MARLIN_MIN_THREAD_N,
    marlin_type_problems,
    scheme_problems,
    validate_quant_args,
)

# The rules below mirror vLLM at commit 055e47c28003156421365af985d676fc921cb075.


# models/qwen2.py @055e47c Qwen2ForCausalLM.packed_modules_mapping
QWEN2_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# model types whose vLLM decoder has the Qwen2 Linear layout simulated below
QWEN2_LAYOUT_MODEL_TYPES = ("qwen2",)


# ---------------------------------------------------------------------------------------
# vLLM helpers, mirrored
# ---------------------------------------------------------------------------------------


def _is_equal_or_regex_match(value: str, target: str, check_contains: bool = False) -> bool:
    # utils.py @008014e _is_equal_or_regex_match ("re:" prefix -> re.match; class names
    # are compared case-insensitively by substring when check_contains)
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if check_contains:
        return target.lower() in value.lower()
    return target == value


def _check_equal_or_regex_match(layer_name: str, targets) -> bool:
    # utils.py @008014e check_equal_or_regex_match
    return any(_is_equal_or_regex_match(layer_name, t) for t in targets)


def _should_ignore_layer(layer_name: str, ignore, fused_mapping) -> bool:
    """utils.py @008014e should_ignore_layer; raises ValueError like vLLM does when the
    shards of a fused layer (q/k/v, gate/up) are not all ignored or all kept."""
    proj_name = layer_name.split(".")[-1]
    if proj_name in fused_mapping and layer_name not in ignore:
        result = None
        for shard in fused_mapping[proj_name]:
            shard_ignored = _check_equal_or_regex_match(layer_name.replace(proj_name, shard), ignore)
            if result is None:
                result = shard_ignored
            elif shard_ignored != result:
                raise ValueError(
                    f"Found a different quantization schemes for {fused_mapping[proj_name]} "
                    f"in {layer_name}. vLLM requires all to use the same scheme."
                )
        return bool(result)
    return _check_equal_or_regex_match(layer_name, ignore)


def _find_matched_target(layer_name: str, class_name: str, targets, fused_mapping):
    # utils.py @008014e find_matched_target: layer name (exact / re:), then the vLLM
    # module class name (substring, case-insensitive), then the fused components.
    for t in targets:
        if _is_equal_or_regex_match(layer_name, t):
            return t
    for t in targets:
        if _is_equal_or_regex_match(class_name, t, check_contains=True):
            return t
    # utils.py @008014e _match_fused_layer ("all" components must match; first one wins)
    fused = next((k for k in fused_mapping if layer_name.endswith(k)), None)
    if fused is None:
        return None
    matches = []
    for unfused in fused_mapping[fused]:
        path = layer_name.replace(fused, unfused)
        matches.append(next((t for t in targets if _is_equal_or_regex_match(path, t)), None))
    return matches[0] if all(matches) else None


def _qwen2_linear_layers(cfg: dict, tp: int):
    """models/qwen2.py @055e47c: the vLLM Linear layers of Qwen2ForCausalLM as
    (name, class, full input size, input per partition, output per partition)."""
    n = cfg.get("num_hidden_layers") or 1
    given = [cfg.get(key) for key in ("hidden_size", "intermediate_size", "num_attention_heads")]
    given.append(cfg.get("num_key_value_heads") or given[2])
    hidden, inter, heads, kv = (x if isinstance(x, int) else 0 for x in given)
    shapes: dict | None = None
    if min(hidden, inter, heads, kv) > 0:
        head_dim = hidden // heads  # Qwen2Attention.head_dim
        kv_pp = max(1, kv // tp)  # replicated when kv < tp
        shapes = {
            # QKVParallelLinear(hidden, head_dim, heads, kv): column parallel
            "self_attn.qkv_proj": ("QKVParallelLinear", hidden, hidden, (heads // tp + 2 * kv_pp) * head_dim),
            # RowParallelLinear(heads * head_dim, hidden): input split
            "self_attn.o_proj": ("RowParallelLinear", heads * head_dim, heads * head_dim // tp, hidden),
            # MergedColumnParallelLinear(hidden, [inter] * 2): output split
            "mlp.gate_up_proj": ("MergedColumnParallelLinear", hidden, hidden, 2 * inter // tp),
            # RowParallelLinear(inter, hidden)
            "mlp.down_proj": ("RowParallelLinear", inter, inter // tp, hidden),
        }
    classes = {
        "self_attn.qkv_proj": "QKVParallelLinear",
        "self_attn.o_proj": "RowParallelLinear",
        "mlp.gate_up_proj": "MergedColumnParallelLinear",
        "mlp.down_proj": "RowParallelLinear",
    }
    for i in range(n):
        for suffix, cls in classes.items():
            dims = shapes[suffix][1:] if shapes else None
            yield f"model.layers.{i}.{suffix}", cls, dims


def _find_quant_config(config: dict):
    # config/model.py @0052a5b ModelConfig._parse_quant_hf_config and
    # model_arch_config_convertor.py @ee92a6f _normalize_quantization_config:
    # hf_config.quantization_config, else "compression_config", else text_config's.
    if "quant_method" in config and "config_groups" in config:
        return config, "(given dict)"  # a bare quantization_config was passed
    for key in ("quantization_config", "compression_config"):
        if config.get(key) is not None:
            return config[key], key
    text = config.get("text_config") or {}
    for key in ("quantization_config", "compression_config"):
        if isinstance(text, dict) and text.get(key) is not None:
            return text[key], f"text_config.{key}"
    return None, None


# ---------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------


@dataclass
class _Wna16Check:
    """The state one ``vllm_wna16_problems`` call shares between its phases, which run in
    vLLM's own order and append to ``problems`` in that order."""

    qcfg: dict
    strict: bool
    tensor_parallel_size: int
    problems: list[str] = field(default_factory=list)
    target_map: OrderedDict[str, dict] = field(default_factory=OrderedDict)
    group_args: dict[str, dict | None] = field(default_factory=dict)
    checked_groups: set[str] = field(default_factory=set)
    layer_msgs: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)
    ignore: list = field(default_factory=list)
    top_format: object = None

    def check_header(self) -> None:
        qcfg, problems = self.qcfg, self.problems
        # config/model.py @0052a5b _verify_quantization: quant_method lower-cased,
        # "compressed_tensors" -> "compressed-tensors"; quantization/__init__.py maps it to
        # CompressedTensorsConfig.
        method = str(qcfg.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
        if method != "compressed-tensors":
            problems.append(
                f"quant_method={qcfg.get('quant_method')!r}; CompressedTensorsConfig is "
                "only used for 'compressed-tensors' (_verify_quantization)"
            )

        # compressed_tensors.py @055e47c _parse_sparsity_config: a sparsity config with
        # targets raises DeprecationWarning ("Sparsity support has been removed").
        sparsity = qcfg.get("sparsity_config")
        if sparsity and (sparsity.get("targets") if isinstance(sparsity, dict) else True):
            problems.append(
                "sparsity_config: has targets; vLLM @055e47c raises DeprecationWarning "
                "in _parse_sparsity_config (older vLLM used it for 2:4 kernels)"
            )

        self.check_kv_cache_scheme()

        self.top_format = qcfg.get("format")
        ignore = qcfg.get("ignore") or []
        if not isinstance(ignore, list):
            problems.append(f"ignore: must be a list, got {ignore!r}")
            ignore = []
        self.ignore = ignore

    def check_kv_cache_scheme(self) -> None:
        # CompressedTensorsKVCacheMethod.validate_kv_cache_scheme (@055e47c), run for every
        # Attention layer when kv_cache_scheme is set.
        problems = self.problems
        kv = self.qcfg.get("kv_cache_scheme")
        if kv is not None:
            if not isinstance(kv, dict):
                problems.append(f"kv_cache_scheme: not a dict: {kv!r}")
            else:
                if kv.get("type") != "float" or kv.get("num_bits") != 8:
                    problems.append(
                        "kv_cache_scheme: only num_bits=8, type=float is supported "
                        "(validate_kv_cache_scheme NotImplementedError)"
                    )
                if str(kv.get("strategy")).lower() not in ("tensor", "attn_head"):
                    problems.append("kv_cache_scheme: strategy must be 'tensor' or 'attn_head'")
                if not kv.get("symmetric"):
                    problems.append("kv_cache_scheme: must be symmetric")

    def read_groups(self) -> None:
        # compressed_tensors.py @055e47c from_config: drop groups whose only target ends in
        # "Attention"; then _quantization_scheme_map_from_config builds {target: scheme} in
        # order (a later group re-using a target overwrites it in place).
        groups = self.qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            self.problems.append(
                "config_groups: missing or empty; no Linear layer gets a scheme "
                "(vLLM builds them all unquantized, but the checkpoint is packed)"
            )
            groups = {}
        for name, group in groups.items():
            self.read_group(name, group)

    def read_group(self, name, group) -> None:
        problems = self.problems
        gwhere = f"config_groups.{name}"
        if not isinstance(group, dict):
            problems.append(f"{gwhere}: not a dict")
            return
        targets = group.get("targets")
        if not isinstance(targets, list):
            problems.append(
                f"{gwhere}.targets: must be a list ('for target in targets' in "
                f"_quantization_scheme_map_from_config), got {targets!r}"
            )
            return
        if len(targets) == 1 and isinstance(targets[0], str) and targets[0].endswith("Attention"):
            return  # from_config: "Skipping CompressedTensors config group for ...Attention"
        w, errs = validate_quant_args(group.get("weights"), f"{gwhere}.weights")
        problems.extend(errs)
        self.group_args[name] = w
        fmt = group.get("format") if group.get("format") is not None else self.top_format
        inputs = group.get("input_activations")
        # _quantization_scheme_map_from_config: with an activation-quantization format
        # or any input_activations, input_quant is set -- or, when input_activations is
        # empty, vLLM asserts weights.type == FLOAT.
        if fmt in ACTIVATION_QUANTIZATION_FORMATS or inputs:
            if not inputs:
                if w is not None and w["type"] != "float":
                    problems.append(
                        f"{gwhere}: format {fmt!r} with no input_activations and int "
                        "weights -> AssertionError in _quantization_scheme_map_from_config"
                    )
            else:
                problems.append(
                    f"{gwhere}.input_activations: set ({inputs!r}); WNA16 needs "
                    "input_quant is None (_is_wNa16_group_channel)"
                )
        if self.strict and group.get("output_activations"):
            problems.append(
                f"{gwhere}.output_activations: [strict] set; W4A16 has none "
                "(vLLM @055e47c ignores it for WNA16, older vLLM ignores it entirely)"
            )
        for t in targets:
            if not isinstance(t, str):
                problems.append(f"{gwhere}.targets: non-string target {t!r}")
                continue
            self.target_map[t] = {"group": name, "format": fmt, "inputs": inputs}

    # Per-group scheme selection (only for groups some Linear layer would use).
    def scheme_for(self, group_name: str, fmt) -> list[str]:
        w = self.group_args.get(group_name)
        gwhere = f"config_groups.{group_name}"
        if w is None:
            return []  # validation problems already reported
        out = scheme_problems(w, None, fmt, gwhere)
        if not out:
            out = marlin_type_problems(w, gwhere)
            if self.strict and w["type"] != "int":
                out.append(
                    f"{gwhere}.weights: [strict] type={w['type']!r}; WNA16 decodes "
                    "weights as integers (uint4b8/uint8b128), vLLM does not check type"
                )
        return out

    def per_layer(self, msg_template: str, idx: int) -> None:
        self.layer_msgs.setdefault(msg_template, []).append(idx)

    def simulate_qwen2(self, arch_cfg: dict) -> None:
        wna16_layers = 0
        for layer_name, cls, dims in _qwen2_linear_layers(arch_cfg, self.tensor_parallel_size):
            if self.check_layer(layer_name, cls, dims):
                wna16_layers += 1
        if wna16_layers == 0 and not any("config_groups" in p for p in self.problems):
            self.problems.append("no decoder Linear layer would get CompressedTensorsWNA16")

    def check_layer(self, layer_name: str, cls: str, dims) -> bool:
        """One Qwen2 Linear layer as vLLM builds it; True when it gets WNA16."""
        idx = int(layer_name.split(".")[2])
        generic = re.sub(r"layers\.\d+\.", "layers.*.", layer_name)
        # compressed_tensors.py @055e47c get_scheme_dict -> should_ignore_layer
        try:
            if _should_ignore_layer(layer_name, self.ignore, QWEN2_PACKED_MODULES):
                return False  # unquantized in vLLM and (same ignore list) in the checkpoint
        except ValueError as e:
            self.per_layer(
                f"{generic}: ignore covers only some of its shards -> ValueError: {e}".replace(layer_name, generic),
                idx,
            )
            return False
        target = _find_matched_target(layer_name, cls, list(self.target_map), QWEN2_PACKED_MODULES)
        if target is None:
            # @055e47c: no scheme -> UnquantizedLinearMethod; before 008014e
            # find_matched_target raised "Unable to find matching target".
            self.per_layer(
                f"{generic} ({cls}): not ignored and matched by no target -> "
                "unquantized in vLLM (older vLLM: ValueError)",
                idx,
            )
            return False
        entry = self.target_map[target]
        gname = entry["group"]
        if gname not in self.checked_groups:
            self.checked_groups.add(gname)
            self.problems.extend(self.scheme_for(gname, entry["format"]))
        w = self.group_args.get(gname)
        if w is None or self.scheme_for(gname, entry["format"]):
            return False
        if dims is not None:
            self.check_layer_shapes(generic, idx, dims, w)
        return True

    def check_layer_shapes(self, generic: str, idx: int, dims, w: dict) -> None:
        tp = self.tensor_parallel_size
        in_full, in_pp, out_pp = dims
        group = -1 if w["group_size"] is None else w["group_size"]
        has_g_idx = w["actorder"] == "group"  # actorder == ActivationOrdering.GROUP
        # CompressedTensorsWNA16.create_weights: scales are partitioned unless
        # marlin_repeat_scales_on_all_ranks(has_g_idx, group, row_parallel) ->
        # verify_group_size_divides_partition(input_size_per_partition, group)
        row_parallel = in_full != in_pp
        repeat = has_g_idx or (group == -1 and row_parallel)
        g_eff = in_full if group == -1 else group
        if not repeat and in_pp % g_eff:
            self.per_layer(
                f"{generic}: input size per partition {in_pp} not divisible by "
                f"group_size {g_eff} (verify_group_size_divides_partition, tp={tp})",
                idx,
            )
        # MarlinLinearKernel.can_implement @055e47c: act-order keeps the strict shape
        # check; otherwise only a group straddling the TP shard is rejected (tiles pad).
        strict_shape = has_g_idx or self.strict
        if strict_shape:
            tag = "[marlin]" if has_g_idx else "[marlin][strict]"
            if out_pp % GPTQ_MARLIN_MIN_THREAD_N:
                self.per_layer(
                    f"{generic}: {tag} output size per partition {out_pp} not divisible "
                    f"by {GPTQ_MARLIN_MIN_THREAD_N} (verify_marlin_supports_shape)",
                    idx,
                )
            if in_pp % GPTQ_MARLIN_MIN_THREAD_K:
                self.per_layer(
                    f"{generic}: {tag} input size per partition {in_pp} not divisible "
                    f"by {GPTQ_MARLIN_MIN_THREAD_K} (verify_marlin_supports_shape)",
                    idx,
                )
        if group != -1 and group < in_full and in_pp % group:
            self.per_layer(
                f"{generic}: [marlin] input size per partition {in_pp} not divisible "
                f"by group_size {group} (MarlinLinearKernel.can_implement, tp={tp})",
                idx,
            )

    def check_lm_head(self) -> None:
        # lm_head: vLLM builds ParallelLMHead; get_quant_method @055e47c quantizes it only
        # when a target matches the *name* (class "ParallelLMHead" has no "linear" in it,
        # so "Linear" does not match it). llm-compressor matches torch.nn.Linear, so a
        # "Linear" target quantizes the HF lm_head unless ignored -> weights do not load.
        lm_ignored = _check_equal_or_regex_match("lm_head", self.ignore)
        if not lm_ignored:
            by_name = _find_matched_target("lm_head", "ParallelLMHead", list(self.target_map), {})
            by_class = any(t == "Linear" for t in self.target_map)
            if by_class and not by_name:
                self.problems.append(
                    "ignore: 'lm_head' missing while target 'Linear' quantizes the HF "
                    "nn.Linear lm_head; vLLM's ParallelLMHead does not match 'Linear' "
                    "and expects an unquantized lm_head.weight -> load fails"
                )
            elif by_name:
                self.problems.append(
                    "ignore: 'lm_head' missing and a target names it; only vLLM "
                    ">= 008014e quantizes ParallelLMHead (older: load fails)"
                )

    def check_without_layout(self) -> None:
        # No layout to simulate: judge every group that has targets.
        for gname in self.group_args:
            fmt = next((e["format"] for e in self.target_map.values() if e["group"] == gname), self.top_format)
            self.problems.extend(self.scheme_for(gname, fmt))
        ignore = self.ignore
        if ignore is not None and not _check_equal_or_regex_match("lm_head", ignore) and "Linear" in self.target_map:
            self.problems.append(
                "ignore: 'lm_head' missing while target 'Linear' quantizes the HF "
                "lm_head; vLLM's ParallelLMHead does not match 'Linear' -> load fails"
            )

    def finish(self) -> list[str]:
        problems = self.problems
        for msg, idxs in self.layer_msgs.items():
            shown = f"layers {idxs[0]}..{idxs[-1]} ({len(idxs)} layers)" if len(idxs) > 1 else f"layer {idxs[0]}"
            problems.append(f"{msg} [{shown}]")

        qcfg = self.qcfg
        if self.strict and qcfg.get("quantization_status", "compressed") != "compressed":
            problems.append(
                f"quantization_status={qcfg.get('quantization_status')!r}: [strict] an "
                "export should be 'compressed' (packed weights)"
            )
        return problems


def vllm_wna16_problems(config: dict, *, tensor_parallel_size: int = 1, strict: bool = False) -> list[str]:
    """Reasons vLLM would not load ``config`` (a config.json dict, or a bare
    quantization_config) with CompressedTensorsWNA16 on its Linear layers. [] = accepted.

    Messages tagged ``[marlin]`` are about the Marlin kernel only (vLLM may pick another
    mixed-precision kernel on some GPUs). ``strict=True`` adds checks vLLM itself does not
    make (tagged ``[strict]``): int weight type, ``quantization_status == "compressed"``,
    no output_activations, and the pre-padding Marlin shape rule (out % 64, in % 128)
    that vLLM releases before tile padding enforced.
    """
    qcfg, where = _find_quant_config(config)
    if qcfg is None:
        return [
            "quantization_config: none found (quantization_config / compression_config / "
            "text_config); vLLM loads the model unquantized (ModelConfig._verify_quantization)"
        ]
    if not isinstance(qcfg, dict):
        return [f"{where}: not a dict: {qcfg!r}"]

    check = _Wna16Check(qcfg, strict, tensor_parallel_size)
    check.check_header()
    check.read_groups()
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    arch_cfg = config if config.get("hidden_size") else (config.get("text_config") or config)
    if model_type in QWEN2_LAYOUT_MODEL_TYPES:
        check.simulate_qwen2(arch_cfg)
        check.check_lm_head()
    else:
        check.check_without_layout()
    return check.finish()
