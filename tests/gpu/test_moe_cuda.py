"""Mixture-of-experts QLoRA on a CUDA GPU (models/moe.py): tiny Qwen3-MoE, gpt-oss and
Qwen3.5-MoE with their experts in 4 bits compute what their de-quantized values compute through
transformers' grouped_mm, and `lora-lab run --quantization nf4` trains each of them on the GPU
(liger's kernels where the family has them, gpt-oss on flex_attention with its sinks), its
experts held in 4 bits on the GPU. `make test-gpu`."""

import copy
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_4_bit_experts_compute_their_values_on_cuda(model_type):
    from lora_lab.models.moe import expert_bytes, quantize_experts
    from tests.unit.test_moe import tiny_moe, with_plain_experts

    model = tiny_moe(model_type)
    reference = copy.deepcopy(model)
    quantize_experts(model, "cuda")
    model.cuda()
    assert expert_bytes(model)["16-bit"] == 0
    reference = with_plain_experts(model, reference.cuda())
    ids = torch.randint(0, 256, (2, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("rank", [4, 8])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_lora_on_4_bit_experts_gets_the_gradients_of_the_plain_experts_on_cuda(model_type, rank):
    """lora.experts on QLoRA's 4-bit experts through transformers' grouped_mm on the GPU: the
    gradients of LoRA on the same values held as plain tensors (tests/unit/test_moe.py); rank 8
    in low rank on the grouped products, rank 4 as a delta on the tensors."""
    from tests.unit.test_moe import assert_lora_gradients_equal

    assert_lora_gradients_equal(model_type, experts=True, device="cuda", rank=rank)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_in_low_rank_computes_what_peft_computes_on_cuda(model_type):
    """The experts' LoRA in low rank on torch's grouped products on the GPU gives peft's logits
    and gradients without building a delta of the experts' size (tests/unit/test_moe.py)."""
    from tests.unit.test_moe import test_expert_lora_in_low_rank_computes_what_peft_computes_without_building_a_delta

    test_expert_lora_in_low_rank_computes_what_peft_computes_without_building_a_delta(model_type, device="cuda")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b"])
def test_lora_lab_run_trains_a_moe_qlora_on_the_gpu(name, tmp_path):
    from tests.e2e.test_tiny_moe import train_tiny_moe

    model_dir, _, output = train_tiny_moe(tmp_path, name, preset="24gb", repeats=16)
    print(output[-3000:])
    lines = (tmp_path / "r" / "logs" / "train_log.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]
    assert losses and all(loss == loss and loss < 20 for loss in losses), losses
    from lora_lab.config import ModelArgs
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model
    from lora_lab.models.moe import expert_bytes, expert_modules

    args = ModelArgs(name=str(model_dir), quantization="nf4", attn_implementation="eager")
    loaded = load_base_model(args, choose_precision("bf16"), LoadOptions(for_training=False))
    assert expert_bytes(loaded)["16-bit"] == 0
    assert {p.device.type for _, m in expert_modules(loaded) for p in m.parametrizations.parameters()} == {"cuda"}
    if name == "gpt-oss-20b":
        assert "attn_implementation: flex_attention" in (tmp_path / "r" / "config.yaml").read_text()


def test_gpt_oss_qlora_trains_from_its_mxfp4_checkpoint_on_the_gpu(tmp_path):
    """The published gpt-oss layout (experts in MXFP4 under its own quantization config), read
    de-quantized and held in nf4 on the GPU: linear layers at load, experts once their adapters
    are attached (lora.experts); flex_attention with the sinks; the loss stays finite."""
    from tests.e2e.test_gpt_oss_mxfp4 import train_with_expert_lora, write_mxfp4_gpt_oss

    train_with_expert_lora(write_mxfp4_gpt_oss(tmp_path / "model"), tmp_path, "24gb", repeats=16, steps=4)
    lines = (tmp_path / "r" / "logs" / "train_log.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]
    assert losses and all(loss == loss and loss < 20 for loss in losses), losses


@pytest.mark.parametrize("liger_experts", [True, False])
def test_model_liger_experts_picks_the_kernel_that_runs_the_experts(liger_experts):
    """Qwen3-MoE with the liger kernels: its experts become liger's fused MoE (LigerExperts) by
    default, and stay transformers' own with model.liger_experts false. liger binds its forward
    and its name to the model's own experts modules (their class stays), so the name is read."""
    from lora_lab.models.kernels import apply_kernels, restored_kernel_patches
    from tests.unit.test_moe import tiny_moe

    model = tiny_moe("qwen3_moe").cuda()
    with restored_kernel_patches("liger", "qwen3_moe"):  # liger rebinds the modeling module's classes
        assert apply_kernels(model, "liger", liger_experts=liger_experts) == "liger"
    kinds = {module._get_name() for module in model.modules() if type(module).__name__.endswith("Experts")}
    assert kinds == ({"LigerExperts"} if liger_experts else {"Qwen3MoeExperts"})


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_a_streamed_qlora_load_computes_what_the_whole_load_does_on_cuda(name, tmp_path):
    """models/expert_loading.py on the GPU: the experts read from the files onto the GPU and
    quantized there give the loss and LoRA gradients of the load that reads them at once."""
    from tests.e2e.test_tiny_moe import (
        test_qlora_training_reads_one_tensor_per_expert_checkpoints_only_when_it_quantizes_them as check,
    )

    check(name, tmp_path)
