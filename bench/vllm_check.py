"""vLLM's own config and LoRA checks on lora-lab folders, next to lora-lab's static verdict.

Runs with the python of a throwaway environment that has vLLM installed without its
dependencies (vLLM is no requirement of lora-lab; see docs/using-a-model.md), e.g.

    python -m venv --system-site-packages /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install --no-deps vllm==0.33.0 compressed-tensors==0.17.0 \
        xgrammar==0.2.8 apache-tvm-ffi==0.1.11 cbor2 pyzmq oss-harmony openai pybase64 msgspec \
        uvloop prometheus_client partial_json_parser llguidance einops
    /tmp/vllm-venv/bin/python bench/vllm_check.py --adapter RUN/adapter --adapter DORA/adapter \
        --merged RUN/merged --w4a16 RUN/export-w4a16 --out results.jsonl

Prints one JSON object per folder and check: which vLLM function ran, its verdict (ok, or the
exception it raised), and lora-lab's verdict for the same folder (lora_lab.planning.serving for
adapters and merged folders, lora_lab/use/vllm_rules.py for the w4a16 export). No GPU is needed: only
vLLM's config parsers and its adapter loader on CPU run; no model is built in vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The LinearBase layers of vLLM's Qwen2 (vllm/model_executor/models/qwen2.py: QKVParallelLinear
# qkv_proj, RowParallelLinear o_proj and down_proj, MergedColumnParallelLinear gate_up_proj):
# what vllm.lora.utils.get_supported_lora_modules returns for a built Qwen2ForCausalLM. Building
# the model needs a device, so this list is read from the source; the packed names come from
# vLLM's class at run time.
QWEN2_SUPPORTED_LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _verdict(fn):
    try:
        detail = fn()
        return {"verdict": "ok", **({"detail": detail} if detail else {})}
    except Exception as error:  # vLLM's refusal is the measurement
        return {
            "verdict": "refused",
            "error": f"{type(error).__name__}: {error}",
            "raised_at": traceback.extract_tb(error.__traceback__)[-1].filename.split("site-packages/")[-1],
        }


def lora_lab_adapter_verdict(adapter: Path, base: str, merged: Path) -> dict:
    from lora_lab.planning.serving import vllm_commands
    from lora_lab.use.merge import adapter_kind_of

    config = json.loads((adapter / "adapter_config.json").read_text())
    result = SimpleNamespace(
        output_dir=merged,
        base_model=base,
        adapter_dir=adapter,
        lora_rank=config.get("r"),
        adapter_kind=adapter_kind_of(config),
        target_modules=sorted(config.get("target_modules") or []),
    )
    serving = vllm_commands(result)
    return {
        "serves_adapter": "adapter" in serving["commands"],
        "adapter_command": serving["commands"].get("adapter"),
        "warnings": serving["warnings"],
    }


def check_adapter(adapter: Path, base: str, merged: Path) -> list[dict]:
    from vllm.config.lora import LoRAConfig
    from vllm.lora import lora_model
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    base_config = json.loads((Path(base) / "config.json").read_text())
    ours = lora_lab_adapter_verdict(adapter, base, merged)
    rank = int(ours["adapter_command"].split("--max-lora-rank ")[1]) if ours["serves_adapter"] else 16
    rows = []
    helper = {}

    def peft():
        helper["h"] = PEFTHelper.from_local_dir(str(adapter), base_config.get("max_position_embeddings"))
        helper["h"].validate_legal(LoRAConfig(max_lora_rank=rank))
        return {"r": helper["h"].r, "max_lora_rank": rank}

    rows.append(
        {
            "check": "vllm.lora.peft_helper.PEFTHelper.from_local_dir + validate_legal("
            f"LoRAConfig(max_lora_rank={rank}))",
            **_verdict(peft),
        }
    )
    if "h" in helper:
        packed = Qwen2ForCausalLM.packed_modules_mapping
        expected = {n for m in QWEN2_SUPPORTED_LORA_MODULES for n in packed.get(m, [m])}

        def load():
            # vLLM pins the CPU copy of the tensors where an accelerator exists; pinning is
            # no check and needs one, so it is off here.
            lora_model.PIN_MEMORY = False
            model = LoRAModel.from_local_checkpoint(
                str(adapter), expected, helper["h"], device="cpu", model_vocab_size=base_config["vocab_size"]
            )
            return {"modules_loaded": len(model.loras), "expected_lora_modules": sorted(expected)}

        rows.append(
            {
                "check": "vllm.lora.lora_model.LoRAModel.from_local_checkpoint(device='cpu',"
                " expected_lora_modules from Qwen2ForCausalLM, PIN_MEMORY off)",
                **_verdict(load),
            }
        )
    return [{"folder": str(adapter), "kind": "adapter", **row, "lora_lab": ours} for row in rows]


def check_model_folder(folder: Path, kind: str) -> list[dict]:
    from vllm.config import ModelConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    rows = []
    state = {}

    def hf_config():
        state["config"] = get_config(str(folder), trust_remote_code=False)
        return {"architectures": state["config"].architectures, "model_type": state["config"].model_type}

    rows.append({"check": "vllm.transformers_utils.config.get_config", **_verdict(hf_config)})

    def model_config():
        config = ModelConfig(model=str(folder), tokenizer=str(folder))
        state["model_config"] = config
        info, arch = ModelRegistry.inspect_model_cls(config.architectures, config)
        return {
            "architecture": arch,
            "is_text_generation_model": info.is_text_generation_model,
            "supports_lora": info.supports_lora,
            "quantization": config.quantization,
            "max_model_len": config.max_model_len,
        }

    rows.append(
        {"check": "vllm.config.ModelConfig(model=folder) + ModelRegistry.inspect_model_cls", **_verdict(model_config)}
    )
    raw = json.loads((folder / "config.json").read_text())
    if kind == "w4a16":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        def quant():
            parsed = CompressedTensorsConfig.from_config(raw["quantization_config"])
            schemes = {}
            for target, scheme in parsed.target_scheme_map.items():
                weights = scheme.get("weights")
                schemes[target] = {
                    "num_bits": weights.num_bits,
                    "group_size": weights.group_size,
                    "symmetric": weights.symmetric,
                    "format": scheme.get("format"),
                }
            linear = parsed.target_scheme_map.get("Linear")
            scheme = (
                parsed._get_scheme_from_parts(
                    weight_quant=linear["weights"],
                    input_quant=linear.get("input_activations"),
                    format=linear.get("format"),
                    layer_name="model.layers.0.self_attn.q_proj",
                )
                if linear
                else None
            )
            return {
                "target_scheme_map": schemes,
                "ignore": parsed.ignore,
                "scheme_for_linear": type(scheme).__name__ if scheme else None,
            }

        rows.append({"check": "vllm CompressedTensorsConfig.from_config + _get_scheme_from_parts", **_verdict(quant)})
        from lora_lab.use.vllm_rules import vllm_wna16_problems

        ours = {"vllm_wna16_problems": vllm_wna16_problems(raw)}
    else:
        from lora_lab.registry import family_of

        family = family_of(raw.get("model_type"))
        ours = {
            "family": family.name,
            "serves_merged": True,
            "vllm_lora_modules": sorted(family.vllm_lora_modules or []),
        }
    return [{"folder": str(folder), "kind": kind, **row, "lora_lab": ours} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", action="append", default=[], type=Path)
    parser.add_argument("--merged", type=Path)
    parser.add_argument("--w4a16", type=Path)
    parser.add_argument("--base", required=True, help="The base model folder of the adapters.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import typing

    import vllm
    from vllm.config.lora import MaxLoRARanks
    from vllm.platforms import current_platform

    from lora_lab.planning.serving import VLLM_MAX_LORA_RANKS

    ranks = list(typing.get_args(MaxLoRARanks))
    rows = [
        {
            "header": True,
            "vllm": vllm.__version__,
            "python": sys.version.split()[0],
            "command": "python " + " ".join(sys.argv),
            "platform": type(current_platform).__name__,
            "max_lora_ranks": {
                "vllm.config.lora.MaxLoRARanks": ranks,
                "lora_lab VLLM_MAX_LORA_RANKS": list(VLLM_MAX_LORA_RANKS),
                "agree": ranks == list(VLLM_MAX_LORA_RANKS),
            },
        }
    ]
    for adapter in args.adapter:
        rows += check_adapter(adapter, args.base, args.merged or adapter.parent / "merged")
    if args.merged:
        rows += check_model_folder(args.merged, "merged")
    if args.w4a16:
        rows += check_model_folder(args.w4a16, "w4a16")
    lines = [json.dumps(row) for row in rows]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
