"""lora-lab export: the vLLM serving arithmetic (exact, on the real Qwen2.5 configs), calibration
data, and the mistakes a user can make, each stopped with one message before any model loads."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.config import resolve_config
from lora_lab.errors import DataError, LoraLabError, ModelError
from lora_lab.planning.serving import gpu_memory_utilization, kv_bytes_per_token, plan_vllm_serving, vllm_command
from lora_lab.registry import known_model_config
from lora_lab.run_folder import save_config
from lora_lab.use.export import calibration_samples
from tests.support.tiny import write_jsonl

# Qwen2.5-7B: 7,615,616,512 parameters, 6,525,288,448 of them in the decoder's linear layers.
QWEN7B_BF16_BYTES = 7_615_616_512 * 2
# The same model with int4 linear weights, a bf16 scale per 128 inputs, the rest in bf16 (an
# input to the arithmetic here, not a measurement).
QWEN7B_W4_BYTES = 6_525_288_448 // 2 + 6_525_288_448 // 128 * 2 + 1_090_328_064 * 2
GIB = 2**30


def test_kv_cache_bytes_per_token_from_the_real_configs():
    per_token, formula = kv_bytes_per_token(known_model_config("7b"))
    assert per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert formula == "2 (K and V) x 28 layers x 4 KV heads x 128 head dim x 2 bytes"
    assert kv_bytes_per_token(known_model_config("1.5b"))[0] == 2 * 28 * 2 * 128 * 2 == 28_672
    assert kv_bytes_per_token(known_model_config("0.5b"))[0] == 2 * 24 * 2 * 64 * 2 == 12_288


def test_memory_share_leaves_a_gib_of_the_card_to_the_rest():
    assert [gpu_memory_utilization(gib) for gib in (8, 12, 16, 24)] == [0.87, 0.91, 0.93, 0.95]


def test_qwen7b_bf16_on_a_24gb_card():
    plan = plan_vllm_serving(known_model_config("7b"), QWEN7B_BF16_BYTES, "24gb")
    assert plan.budget_bytes == 24_481_313_587  # floor(24 GiB x 0.95)
    assert plan.overhead_bytes == 1536 * 2**20
    assert plan.kv_cache_bytes == 24_481_313_587 - 15_231_233_024 - 1_610_612_736 == 7_639_467_827
    assert plan.tokens_in_kv_cache == 7_639_467_827 // 57_344 == 133_221
    # 16 sequences of 16384 tokens would need 262,144 tokens; of 8192, 131,072 fit.
    assert (plan.max_model_len, plan.max_num_seqs) == (8192, 16)
    assert plan.flags() == "--max-model-len 8192 --max-num-seqs 16 --gpu-memory-utilization 0.95"
    text = "\n".join(plan.arithmetic())
    assert "24 GiB x 0.95 = 22.80 GiB" in text and "weights 14.19 GiB" in text
    assert "overhead 1.50 GiB" in text and "= KV cache 7.11 GiB" in text
    assert "57,344 bytes x 8192 tokens x 16 sequences = 7.00 GiB <= 7.11 GiB" in text


def test_qwen7b_bf16_does_not_fit_16gb():
    plan = plan_vllm_serving(known_model_config("7b"), QWEN7B_BF16_BYTES, "16gb")
    assert plan.budget_bytes == 15_977_278_341 and plan.kv_cache_bytes == -864_567_419
    assert not plan.fits and plan.max_model_len is None
    assert "does not fit" in "\n".join(plan.arithmetic())
    assert vllm_command("out", "bitsandbytes", plan) == (
        "vllm serve out --served-model-name finetuned --quantization bitsandbytes"
    )


@pytest.mark.parametrize(
    "tier,kv_cache,tokens,length,seqs",
    [
        ("24gb", 17_325_442_867, 302_131, 16384, 18),
        ("16gb", 8_821_407_621, 153_833, 8192, 18),
        ("12gb", 4_569_389_998, 79_683, 4096, 19),
        # 16 x 512 tokens do not fit: one sequence as long as fits.
        ("8gb", 317_372_375, 5_534, 4096, 1),
    ],
)
def test_qwen7b_4bit_on_every_tier(tier, kv_cache, tokens, length, seqs):
    assert QWEN7B_W4_BYTES == 5_545_257_984
    plan = plan_vllm_serving(known_model_config("7b"), QWEN7B_W4_BYTES, tier)
    assert (plan.kv_cache_bytes, plan.tokens_in_kv_cache) == (kv_cache, tokens)
    assert (plan.max_model_len, plan.max_num_seqs) == (length, seqs)
    assert plan.kv_bytes_per_token * length * seqs <= plan.kv_cache_bytes


def test_sequences_are_capped_at_vllms_default_and_context_at_the_models():
    config = {**known_model_config("0.5b"), "max_position_embeddings": 4096}
    plan = plan_vllm_serving(config, 500_000_000, "24gb")
    assert (plan.max_model_len, plan.max_num_seqs) == (4096, 256)


def test_vllm_command_names_the_quantization_only_where_needed():
    plan = plan_vllm_serving(known_model_config("7b"), QWEN7B_W4_BYTES, "16gb")
    assert vllm_command("out/x", None, plan) == (
        "vllm serve out/x --served-model-name finetuned --max-model-len 8192 --max-num-seqs 18 "
        "--gpu-memory-utilization 0.93"
    )
    assert "--quantization bitsandbytes --max-model-len 8192" in vllm_command("o", "bitsandbytes", plan)


def test_unknown_tier_is_refused():
    with pytest.raises(LoraLabError, match="--gpu 10gb: unknown tier"):
        plan_vllm_serving(known_model_config("7b"), QWEN7B_W4_BYTES, "10gb")


# ----------------------------------------------------------------------------- calibration data


def _run_dir(tmp_path, datasets, **flags):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = resolve_config("cpu", flags={"data.datasets": datasets, **flags})
    save_config(config, run_dir / "config.yaml")
    return run_dir


def test_calibration_uses_the_runs_data_encoded_as_in_training(tokenizer, tmp_path, chat_rows):
    from lora_lab.data import load_samples
    from lora_lab.data.encode import encode_samples

    data = write_jsonl(tmp_path / "d.jsonl", chat_rows * 5)
    run_dir = _run_dir(tmp_path, [str(data)], **{"data.model_name": "Aurora", "data.model_author": "Lab"})
    samples, info = calibration_samples(tokenizer, run_dir, None, 4)
    assert len(samples) == 4 and info["samples"] == 4 and info["from"] == "run config.yaml"
    config = resolve_config(
        "cpu", flags={"data.datasets": [str(data)], "data.model_name": "Aurora", "data.model_author": "Lab"}
    )
    encoded = encode_samples(tokenizer, load_samples([str(data)], config.data, 42).samples, config.data.max_length)
    assert all(s in [e.input_ids for e in encoded.samples] for s in samples)
    assert info["tokens"] == sum(len(s) for s in samples) and info["max_length"] == 512
    every, info = calibration_samples(tokenizer, run_dir, None, 1000)
    assert len(every) == 10 and info["requested"] == 1000  # fewer rows than asked: all of them


def test_calib_data_replaces_the_runs_data(tokenizer, tmp_path, chat_rows):
    run_dir = _run_dir(tmp_path, ["self-cognition"], **{"data.model_name": "A", "data.model_author": "B"})
    other = write_jsonl(tmp_path / "o.jsonl", [{"query": "hi", "response": "hello"}] * 3)
    samples, info = calibration_samples(tokenizer, run_dir, [str(other)], 256)
    assert len(samples) == 3 and info["data"] == [str(other)] and info["from"] == "--calib-data"


def test_calibration_outside_a_run_needs_calib_data(tokenizer):
    with pytest.raises(DataError, match="is not in a run folder.*Pass --calib-data FILE"):
        calibration_samples(tokenizer, None, None, 8, "out/merged")


# ----------------------------------------------------------------------------- user mistakes


def invoke(*args):
    return CliRunner().invoke(main, ["export", *[str(a) for a in args]])


def _model_folder(path, **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, **config}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--quantize", "nf4", "--calib-data", "d.jsonl"],
            "--calib-data: nf4 quantizes every block from its own weights and uses no calibration",
        ),
        (["--quantize", "w4a16", "--calib-samples", "0"], "--calib-samples 0: must be at least 1."),
        (["--quantize", "int3"], "Invalid value for '--quantize'"),
        (["--quantize", "nf4", "--gpu", "10gb"], "Invalid value for '--gpu'"),
    ],
)
def test_argument_mistakes_give_one_clean_message(tmp_path, args, message):
    result = invoke(tmp_path, *args)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_not_a_model_folder(tmp_path):
    result = invoke(tmp_path, "--quantize", "nf4")
    assert result.exit_code == 2
    assert "not a run folder (config.yaml), a merged or model folder (config.json)" in result.output


def test_refuses_to_overwrite_without_force(tmp_path):
    source = _model_folder(tmp_path / "merged")
    (tmp_path / "merged-nf4").mkdir()
    result = invoke(source, "--quantize", "nf4")
    assert result.exit_code == 2
    assert f"--output {tmp_path / 'merged-nf4'}: the folder already exists. Pass --force" in result.output


def test_refuses_an_already_quantized_model(tmp_path):
    source = _model_folder(tmp_path / "q", quantization_config={"quant_method": "bitsandbytes"})
    result = invoke(source, "--quantize", "nf4", "--output", tmp_path / "out")
    assert result.exit_code == 2 and "already quantized (bitsandbytes)" in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_refuses_pickled_weights(tmp_path):
    source = tmp_path / "p"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "pytorch_model.bin").write_bytes(b"")
    result = invoke(source, "--quantize", "nf4")
    assert result.exit_code == 2 and "never loads pickled weights" in result.output


def test_missing_llmcompressor_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llmcompressor" else real_find_spec(name, *a)
    )
    result = invoke(_model_folder(tmp_path / "m"), "--quantize", "w4a16")
    assert result.exit_code == 2
    assert (
        "--quantize w4a16 needs the llmcompressor package, which is not installed: pip install 'lora-lab[export]'"
    ) in result.output


def test_w4a16_needs_inputs_divisible_by_the_group_size(tmp_path):
    from lora_lab.use.export import _check_group_size

    with pytest.raises(
        ModelError, match="hidden_size 32, not a multiple of the GPTQ group size 128; use --quantize nf4"
    ):
        _check_group_size(_model_folder(tmp_path / "m", hidden_size=32, intermediate_size=256))
    for size in ("0.5b", "1.5b", "3b", "7b"):  # every Qwen2.5 size is fine
        folder = tmp_path / size
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(known_model_config(size)))
        _check_group_size(folder)


def test_awq_shares_the_group_size_rule_and_says_its_own_name(tmp_path):
    from lora_lab.use.export import FORMATS, _check_group_size

    with pytest.raises(
        ModelError,
        match="--quantize awq: .* has intermediate_size 200, not a "
        "multiple of the AWQ group size 128; use --quantize nf4",
    ):
        _check_group_size(_model_folder(tmp_path / "m", hidden_size=128, intermediate_size=200), FORMATS["awq"])


def test_awq_on_a_cpu_skips_only_the_pinning_of_llmcompressors_cache():
    """llm-compressor's AWQ pins its cache of layer inputs, which raises without a GPU; inside
    no_pinning_without_accelerator the pinning is skipped, and restored after."""
    pytest.importorskip("llmcompressor")
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    from lora_lab.use.export import no_pinning_without_accelerator

    if torch.accelerator.is_available():
        pytest.skip("with a GPU the cache is pinned as llm-compressor does it")
    cache = IntermediatesCache.empty(1, torch.device("cpu"))
    cache.update(0, {"hidden_states": torch.ones(2, 3)})
    with pytest.raises(RuntimeError, match="Cannot access accelerator device"):
        cache.pin_memory(0)
    with no_pinning_without_accelerator():
        cache.pin_memory(0)
    assert not cache.fetch(0)["hidden_states"].is_pinned()
    with pytest.raises(RuntimeError, match="Cannot access accelerator device"):
        cache.pin_memory(0)
