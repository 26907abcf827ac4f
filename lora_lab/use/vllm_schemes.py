"""vLLM's rules for one compressed-tensors quantization scheme, mirrored from its source (the
commits are named in vllm_rules.py, which applies them to a whole config.json): the fields
compressed-tensors' QuantizationArgs accepts, the WNA16 scheme's conditions, and which
weight types Marlin serves."""

from __future__ import annotations

# compressed-tensors CompressionFormat values, as compared in vLLM.
PACK_QUANTIZED = "pack-quantized"
# utils.py @008014e is_activation_quantization_format: _ACTIVATION_QUANTIZATION_FORMATS
ACTIVATION_QUANTIZATION_FORMATS = (
    "naive-quantized",
    "int-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
)
# schemes/compressed_tensors_wNa16.py @055e47c: WNA16_SUPPORTED_TYPES_MAP keys (older: 4, 8)
WNA16_SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
# schemes/compressed_tensors_wNa16.py @055e47c: WNA16_ZP_SUPPORTED_TYPES_MAP keys
WNA16_ZP_SUPPORTED_BITS = (4, 8)
# marlin_utils.py @055e47c query_marlin_supported_quant_types (capability >= 75, CUDA):
# no zero point -> uint4b8, uint8b128 (4/8-bit symmetric); zero point -> uint4 only.
MARLIN_BITS_SYMMETRIC = (4, 8)
MARLIN_BITS_ZERO_POINT = (4,)
# marlin_utils.py @055e47c
MARLIN_SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
GPTQ_MARLIN_MIN_THREAD_N = 64
GPTQ_MARLIN_MIN_THREAD_K = 128
# compressed-tensors quant_args.py @0201243: QuantizationArgs fields (model_config extra="forbid")
QUANT_ARGS_FIELDS = frozenset(
    {
        "num_bits",
        "type",
        "symmetric",
        "group_size",
        "strategy",
        "block_structure",
        "dynamic",
        "actorder",
        "scale_dtype",
        "zp_dtype",
        "observer",
        "observer_kwargs",
    }
)
QUANT_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
ACTORDER_VALUES = {"group": "group", "weight": "weight", "dynamic": "group", "static": "weight"}


def validate_quant_args(args, where: str):
    """compressed-tensors quant_args.py @0201243 QuantizationArgs validation, which vLLM
    runs on every group's weights (_quantization_scheme_map_from_config ->
    QuantizationArgs.model_validate). Returns (normalised args or None, problems)."""
    if not isinstance(args, dict):
        return None, [
            f"{where}: must be a dict of QuantizationArgs, got {args!r} "
            "(QuantizationArgs.model_validate fails in from_config)"
        ]
    problems = []
    # quant_args.py: model_config = ConfigDict(extra="forbid")
    extra = sorted(set(args) - QUANT_ARGS_FIELDS)
    if extra:
        problems.append(
            f"{where}: unknown QuantizationArgs field(s) {extra} (extra='forbid' -> pydantic ValidationError)"
        )
    a = dict(
        num_bits=8,
        type="int",
        symmetric=True,
        group_size=None,
        strategy=None,
        block_structure=None,
        dynamic=False,
        actorder=None,
        scale_dtype=None,
    )
    a.update({k: v for k, v in args.items() if k in a})
    # validate_type / validate_strategy / validate_actorder / validate_dynamic (lower-cased enums)
    if isinstance(a["type"], str):
        a["type"] = a["type"].lower()
    if a["type"] not in ("int", "float"):
        problems.append(f"{where}: type={args.get('type')!r} is not 'int' or 'float'")
    if isinstance(a["strategy"], str):
        a["strategy"] = a["strategy"].lower()
    if a["strategy"] is not None and a["strategy"] not in QUANT_STRATEGIES:
        problems.append(f"{where}: strategy={args.get('strategy')!r} is not a QuantizationStrategy")
    if isinstance(a["actorder"], bool):
        a["actorder"] = "group" if a["actorder"] else None
    elif isinstance(a["actorder"], str):
        if a["actorder"].lower() not in ACTORDER_VALUES:
            problems.append(f"{where}: actorder={args.get('actorder')!r} is not an ActivationOrdering")
        a["actorder"] = ACTORDER_VALUES.get(a["actorder"].lower())  # aliases: dynamic->group
    if isinstance(a["dynamic"], str):
        if a["dynamic"].lower() != "local":
            problems.append(f"{where}: dynamic={args.get('dynamic')!r} is not a bool or 'local'")
        a["dynamic"] = a["dynamic"].lower()
    if not isinstance(a["num_bits"], int) or isinstance(a["num_bits"], bool):
        problems.append(f"{where}: num_bits={a['num_bits']!r} is not an int")
    gs, strategy = a["group_size"], a["strategy"]
    if gs is not None and (not isinstance(gs, int) or gs < -1):  # validate_group
        problems.append(f"{where}: invalid group_size {gs!r} (> 0 for 'group', -1 for 'channel')")
        return None, problems
    # validate_model_after: infer strategy
    if strategy is None:
        strategy = "tensor" if gs is None else ("group" if gs > 0 else "channel")
        a["strategy"] = strategy
    if strategy == "token" and not a["dynamic"]:
        problems.append(f"{where}: static 'token' quantization is invalid (needs dynamic=True)")
    if strategy in ("group", "tensor_group") and (gs is None or gs <= 0):
        problems.append(f"{where}: strategy {strategy!r} requires a positive group_size")
    if gs is not None and gs > 0 and strategy not in ("group", "tensor_group"):
        problems.append(f"{where}: group_size={gs} requires strategy 'group'")
    if (strategy == "block") != (a["block_structure"] is not None):
        problems.append(f"{where}: block strategy and block_structure must come together")
    if a["actorder"] == "group" and strategy not in ("group", "tensor_group"):
        problems.append(f"{where}: actorder 'group' needs strategy 'group' or 'tensor_group'")
    if a["dynamic"] and strategy not in ("token", "tensor", "tensor_group", "group"):
        problems.append(f"{where}: dynamic quantization needs strategy token/tensor/tensor_group/group")
    return (None if problems else a), problems


def scheme_problems(w: dict, input_quant, fmt, where: str) -> list[str]:
    """compressed_tensors.py @055e47c _get_scheme_from_parts, for input_quant is None:
    reasons the weight args would not become CompressedTensorsWNA16."""
    problems = []
    float_t = w["type"] == "float"
    # _is_nvfp4_format(weight) -> CompressedTensorsW4A4Fp4(use_a16=True), checked first
    if w["strategy"] == "tensor_group" and float_t and w["num_bits"] == 4 and w["group_size"] == 16 and w["symmetric"]:
        return [f"{where}: weights are NVFP4 (float/tensor_group/4-bit/g16) -> CompressedTensorsW4A4Fp4, not WNA16"]
    # _is_mxfp4(weight) -> CompressedTensorsW4A4Mxfp4
    if w["strategy"] == "group" and float_t and w["num_bits"] == 4 and w["group_size"] == 32 and w["symmetric"]:
        return [f"{where}: weights are MXFP4 (float/group/4-bit/g32) -> CompressedTensorsW4A4Mxfp4, not WNA16"]
    # _is_mxfp8(weight) -> CompressedTensorsW8A8Mxfp8
    if (
        w["strategy"] == "group"
        and float_t
        and w["num_bits"] == 8
        and w["group_size"] == 32
        and w["symmetric"]
        and w["scale_dtype"] in ("torch.uint8", "uint8")
    ):
        return [
            f"{where}: weights are MXFP8 (float/group/8-bit/g32/uint8 scales) -> CompressedTensorsW8A8Mxfp8, not WNA16"
        ]
    # (_is_fp8_w4a8_sm90, _is_wNa8o8_int, _is_wNaM_int all need input_quant, here None)
    # _is_wNa16_group_channel: strategy channel|group, input_quant is None, not dynamic
    if w["strategy"] not in ("channel", "group"):
        problems.append(
            f"{where}: weights.strategy={w['strategy']!r}; WNA16 needs 'group' or 'channel' (_is_wNa16_group_channel)"
        )
    if w["dynamic"]:
        problems.append(
            f"{where}: weights.dynamic={w['dynamic']!r}; WNA16 needs static weights (_is_wNa16_group_channel)"
        )
    # ... and format == CompressionFormat.pack_quantized.value
    if fmt != PACK_QUANTIZED:
        problems.append(
            f"{where}: format={fmt!r}; WNA16 is only chosen for {PACK_QUANTIZED!r} (_get_scheme_from_parts)"
        )
    if problems:
        if w["type"] == "int":  # every non-WNA16 branch left needs float weights or inputs
            problems.append(
                f"{where}: no other scheme matches -> NotImplementedError "
                "'No compressed-tensors compatible scheme was found'"
            )
        return problems
    # CompressedTensorsWNA16.__init__ (schemes/compressed_tensors_wNa16.py @055e47c)
    if w["group_size"] in (None, -1) and w["strategy"] != "channel":
        problems.append(
            f"{where}: no group size and strategy is not 'channel' (CompressedTensorsWNA16.__init__ ValueError)"
        )
    if w["num_bits"] not in WNA16_SUPPORTED_BITS:
        problems.append(
            f"{where}: num_bits={w['num_bits']} not in WNA16_SUPPORTED_TYPES_MAP "
            f"{list(WNA16_SUPPORTED_BITS)} (CompressedTensorsWNA16.__init__ ValueError; "
            "releases before 055e47c: only 4, 8)"
        )
    elif not w["symmetric"] and w["num_bits"] not in WNA16_ZP_SUPPORTED_BITS:
        problems.append(
            f"{where}: asymmetric num_bits={w['num_bits']} not in "
            f"WNA16_ZP_SUPPORTED_TYPES_MAP {list(WNA16_ZP_SUPPORTED_BITS)}"
        )
    return problems


def marlin_type_problems(w: dict, where: str) -> list[str]:
    # kernels/linear/mixed_precision/marlin.py @055e47c MarlinLinearKernel.can_implement
    problems = []
    ok_bits = MARLIN_BITS_SYMMETRIC if w["symmetric"] else MARLIN_BITS_ZERO_POINT
    if w["num_bits"] not in ok_bits:
        problems.append(
            f"{where}: [marlin] {w['num_bits']}-bit {'symmetric' if w['symmetric'] else 'zero-point'} "
            f"weights are not a Marlin quant type (query_marlin_supported_quant_types: "
            "uint4b8/uint8b128 symmetric, uint4 with zero point)"
        )
    group = -1 if w["group_size"] is None else w["group_size"]
    if group not in MARLIN_SUPPORTED_GROUP_SIZES:
        problems.append(
            f"{where}: [marlin] group_size={group} not in "
            f"MARLIN_SUPPORTED_GROUP_SIZES {list(MARLIN_SUPPORTED_GROUP_SIZES)}"
        )
    return problems
