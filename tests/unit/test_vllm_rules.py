"""lora-lab's mirror of vLLM's loader rules for compressed-tensors WNA16 exports
(lora_lab/use/vllm_rules.py): the config llm-compressor writes for lora-lab's recipe is
accepted, and each change vLLM refuses is refused."""

from __future__ import annotations

import copy

import pytest

from lora_lab.use.vllm_rules import vllm_wna16_problems

# quantization_config: the group and top-level fields verbatim from
# RedHatAI/Qwen3.5-9B-quantized.w4a16 config.json (llm-compressor GPTQ W4A16, written by
# compressed-tensors 0.14.1.a20260325), with its VL-specific ignore list cut down to
# ["lm_head"] -- what lora-lab's recipe GPTQModifier(targets="Linear", scheme="W4A16",
# ignore=["lm_head"]) writes (tests/e2e/test_export_tiny.py asserts it).
# Model fields: Qwen/Qwen2.5-0.5B-Instruct config.json.
EXAMPLE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": "static",
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 128,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": None,
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                    "zp_dtype": None,
                },
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.14.1.a20260325",
    },
}


def mutated(fn):
    cfg = copy.deepcopy(EXAMPLE)
    fn(cfg["quantization_config"])
    return cfg


BROKEN = {
    "no lm_head ignore": mutated(lambda q: q.update(ignore=[])),
    "format naive-quantized": mutated(
        lambda q: (q.update(format="naive-quantized"), q["config_groups"]["group_0"].pop("format"))
    ),
    "format pack_quantized (underscore)": mutated(
        lambda q: q["config_groups"]["group_0"].update(format="pack_quantized")
    ),
    "group_size 256": mutated(lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=256)),
    "3-bit": mutated(lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3)),
    "tensor strategy": mutated(
        lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor", group_size=None, actorder=None)
    ),
    "input activations": mutated(
        lambda q: q["config_groups"]["group_0"].update(
            input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
        )
    ),
    "q_proj-only ignore": mutated(lambda q: q.update(ignore=["lm_head", "model.layers.0.self_attn.q_proj"])),
    "quant_method gptq": mutated(lambda q: q.update(quant_method="gptq")),
}


def test_the_llm_compressor_w4a16_config_is_accepted():
    assert vllm_wna16_problems(EXAMPLE) == []
    assert vllm_wna16_problems(EXAMPLE, strict=True) == []


@pytest.mark.parametrize("change", sorted(BROKEN))
def test_each_change_vllm_refuses_is_refused(change):
    assert vllm_wna16_problems(BROKEN[change]) != []
