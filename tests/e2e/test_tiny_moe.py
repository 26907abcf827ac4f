"""Tiny random mixture-of-experts models (the published config.json of Qwen3-30B-A3B, gpt-oss-20b
and Qwen3.5-35B-A3B shrunk to 2 or 4 layers of width 64 and 8 experts, on the real Qwen2.5
tokenizer) train through `lora-lab run` on the CPU: QLoRA holds their fused experts in 4 bits,
the adapter covers the attention (and Qwen3.5's shared expert), never a router, and loads with
peft."""

from __future__ import annotations

import json
import math
import os

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.families import tiny_family_config
from tests.support.tiny import TOKENIZER_DIR, write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
GATED_DELTANET = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
# config file -> (overrides, the LoRA target modules of all-linear)
MODELS = {
    "qwen3-30b-a3b": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), ATTENTION),
    "gpt-oss-20b": (
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            experts_per_token=2,
            intermediate_size=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            quantization_config=None,
            # gpt-oss's YaRN with its correction range rounded, which is all llama.cpp does
            # (use/gguf_export.py rope_caveat): the GGUF then checks the rest of the model
            rope_scaling=dict(
                rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096
            )
            | {"truncate": True},
            max_position_embeddings=131072,
            vocab_size=151936,
            eos_token_id=151645,
            pad_token_id=151643,
        ),
        ATTENTION,
    ),
    "qwen3.5-35b-a3b": (
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            vocab_size=151936,
            eos_token_id=151645,
        ),
        ATTENTION | GATED_DELTANET | {"gate_proj", "up_proj", "down_proj"},  # the shared expert's
    ),
}


SLOW_DECAY = math.log(0.25)
"""A_log of the tiny Qwen3.5-MoE's Gated DeltaNet layers. Its random init (A up to 16, with
projections of range 0.3) gives per-token log-decays down to -61, whose in-chunk sums (355-684)
transformers' chunked delta rule subtracts in fp32, which costs 2e-5 of relative precision a layer:
base + adapter and the fp32 merge then differ by 1.1e-3, all of it rounding (in float64 they agree
to 7e-13), above merge's 1e-3 rule. A of 0.25 (a quarter of the log-decay the projections
ask for) keeps the sums small."""


def build_tiny_moe(folder, config_name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = tiny_family_config(config_name, **MODELS[config_name][0])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        if hasattr(module, "A_log"):  # Gated DeltaNet: see SLOW_DECAY
            module.A_log.data.fill_(SLOW_DECAY)
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    return folder


def train_tiny_moe(out, name: str, preset: str = "cpu", repeats: int = 4):
    """A tiny `name` model in out/model, then 4 QLoRA steps of `lora-lab run --preset PRESET`:
    (model folder, run folder, what the run printed)."""
    model_dir = build_tiny_moe(out / "model", name)
    data = write_jsonl(out / "rows.jsonl", ROWS)
    args = ["run", "--preset", preset, "--model", model_dir, "--data", f"{data}#{repeats}", "--max-steps", 4]
    args += ["--lr", "1e-2", "--lora-rank", 4, "--max-length", 64, "--quantization", "nf4"]
    args += ["--output-dir", out, "--run-name", "r", "--seed", 3]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return model_dir, out / "r", result.output


@pytest.fixture(scope="module", params=list(MODELS))
def moe_run(request, tmp_path_factory):
    """(config name, model folder, run folder, output) after 4 QLoRA steps."""
    name = request.param
    model_dir, run_dir, output = train_tiny_moe(tmp_path_factory.mktemp(name), name)
    return name, model_dir, run_dir, output


def test_qlora_trains_the_attention_of_a_moe_with_its_experts_in_4_bits(moe_run):
    name, _, run_dir, _ = moe_run
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == MODELS[name][1]
    events = [json.loads(line) for line in (run_dir / "logs" / "train_log.jsonl").read_text().splitlines()]
    trained = [e for e in events if "loss" in e]
    assert trained, events
    # the routers' load-balancing loss is logged with each training loss (not trained on: weight 0)
    assert all(e["aux_loss"] > 0 for e in trained), trained


def test_the_loaded_qlora_model_holds_its_experts_in_4_bits(moe_run):
    from lora_lab.config import ModelArgs
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model
    from lora_lab.models.moe import expert_bytes

    _, model_dir, _, _ = moe_run
    model = load_base_model(
        ModelArgs(name=str(model_dir), quantization="nf4", attn_implementation="eager"),
        choose_precision("fp32"),
        LoadOptions(for_training=False),
    )
    held = expert_bytes(model)
    assert held["16-bit"] == 0 and held["nf4"] > 0


def test_the_adapter_loads_with_peft_and_changes_the_logits(moe_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, model_dir, run_dir, _ = moe_run
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, run_dir / "adapter")(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-4


def test_gpt_oss_runs_eager_attention_on_the_cpu(moe_run):
    name, _, run_dir, output = moe_run
    if name != "gpt-oss-20b":
        pytest.skip("gpt-oss alone needs another attention than sdpa")
    assert "model.attn_implementation: eager (gpt_oss: sdpa has no attention sinks)" in output
    assert "attn_implementation: eager" in (run_dir / "config.yaml").read_text()


def test_merge_gives_the_logits_of_the_base_with_its_adapter(moe_run, tmp_path):
    """The adapter is merged into the 16-bit base (its experts as they are, fused): the merged
    folder computes what the base with the adapter computes. (The tiny Qwen3.5-MoE's fp32 merge
    misses merge's own 1e-3 logit rule by a little: left out until that is understood.)"""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_lab.use.merge import merge_adapter

    name, model_dir, run_dir, _ = moe_run
    merged = merge_adapter(run_dir, output=tmp_path / "merged", dtype="fp32").output_dir
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    attention = {"attn_implementation": "eager"} if name == "gpt-oss-20b" else {}
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attention)
        expected = PeftModel.from_pretrained(base, run_dir / "adapter")(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **attention)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_load_balancing_loss_weighs_in_with_its_setting(moe_run):
    """model.router_aux_loss_coef: the loss a training model returns is its cross-entropy plus the
    weight times the routers' load-balancing loss (0 by default: logged, not trained on)."""
    import torch

    from lora_lab.config import ModelArgs
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model

    _, model_dir, _, _ = moe_run
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    losses = []
    for weight in (0.0, 0.25):
        args = ModelArgs(name=str(model_dir), attn_implementation="eager", router_aux_loss_coef=weight, kernels="none")
        model = load_base_model(args, choose_precision("fp32"), LoadOptions(fused_loss=False))
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        losses.append((float(out.loss), float(out.aux_loss)))
    (plain, aux), (weighed, same_aux) = losses
    assert aux == pytest.approx(same_aux) and aux > 0
    assert weighed == pytest.approx(plain + 0.25 * aux, rel=1e-5)


GGUF_ANSWERS = {"qwen3-30b-a3b": 3, "gpt-oss-20b": 2}
"""Check answers the f16 GGUF gives as the run does. gpt-oss's third differs where fp32's
top-2 experts are within 0.01: f16 weights flip the router there (transformers with the same
weights rounded to f16 does the same)."""


def test_a_moe_run_exports_to_gguf_and_every_copy_answers_as_it(moe_run):
    """llama.cpp's converter takes Qwen3-MoE's experts: the f16 GGUF of the QLoRA run and its fp32
    merge pass `lora-lab check` (same template, answers, stops and next tokens)."""
    name, _, run_dir, _ = moe_run
    if name not in GGUF_ANSWERS:
        pytest.skip("llama.cpp's converter takes Qwen3-MoE and gpt-oss (docs/families.md)")
    if name == "gpt-oss-20b" and not os.environ.get("LORA_LAB_SLOW"):
        pytest.skip("gpt-oss's GGUF: over a minute of CPU; LORA_LAB_SLOW=1 runs it (Qwen3-MoE's runs here)")
    for args in (["merge", run_dir, "--dtype", "fp32"], ["export", run_dir, "--format", "gguf"]):
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["check", str(run_dir)])
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "parity_report.json").read_text())
    assert [(f["form"], f["passed"], f["answers_equal"]) for f in report["forms"]] == [
        ("merged", True, 3),
        ("gguf-f16", True, GGUF_ANSWERS[name]),
    ]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-35b-a3b", "gpt-oss-20b"])
def test_qlora_training_reads_one_tensor_per_expert_checkpoints_only_when_it_quantizes_them(name, tmp_path):
    """models/expert_loading.py: from_pretrained leaves a one-tensor-per-expert checkpoint's experts
    in the files (stand-ins of one value each), adapted_experts_to reads them into place and
    quantizes them, and the model computes the loss and LoRA gradients (the experts' too) of the
    load that reads them all at once. gpt-oss's fused experts load as before."""
    import torch

    from lora_lab.config import LoraArgs, ModelArgs
    from lora_lab.models import load
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model, process_gpu
    from lora_lab.models.lora import LoraOptions, apply_lora, prepare_quantized_for_training
    from lora_lab.models.moe import adapted_experts_to, expert_bytes

    model_dir = build_tiny_moe(tmp_path / "model", name)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0)).to(process_gpu() or "cpu")

    def trained(streamed: bool, monkeypatch):
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            if not streamed:
                patch.setattr(load, "_streamed_experts", lambda *args: None)
            model = load_base_model(
                ModelArgs(name=str(model_dir), quantization="nf4", attn_implementation="eager"),
                choose_precision("fp32"),
                LoadOptions(kernels="none"),
            )
        held = expert_bytes(model)["16-bit"]
        model = apply_lora(
            prepare_quantized_for_training(model),
            LoraArgs(rank=4, alpha=8, dropout=0.0, experts=True),
            LoraOptions(gradient_checkpointing=True),
        )
        adapted_experts_to(model, process_gpu())  # tests/gpu/test_moe_cuda.py runs this on a GPU
        assert expert_bytes(model)["16-bit"] == 0
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return held, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    with pytest.MonkeyPatch.context() as monkeypatch:
        (streamed_held, streamed_loss, a), (held, loss, b) = trained(True, monkeypatch), trained(False, monkeypatch)
    assert held > 100_000
    if name == "gpt-oss-20b":
        assert streamed_held == held  # fused experts in the checkpoint: read at load, as before
    else:
        assert streamed_held <= 4 * 2 * 4  # one value a stand-in: 2 tensors a layer, at most 4 layers, fp32
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    exact = {"rtol": 0, "atol": 0} if ids.device.type == "cpu" else {}  # CUDA's backward sums in any order
    torch.testing.assert_close(streamed_loss, loss, **exact)
    for key in a:
        torch.testing.assert_close(a[key], b[key], **exact)


def test_a_checkpoint_missing_one_experts_weight_stops_naming_the_folder_layer_and_expert(tmp_path):
    """A streamed QLoRA load (models/expert_loading.py) reads the experts only when it quantizes
    them: a checkpoint without one expert's tensor stops there with what is missing and where."""
    from safetensors.torch import load_file, save_file

    from lora_lab.config import LoraArgs, ModelArgs
    from lora_lab.errors import ModelError
    from lora_lab.models.load import LoadOptions, choose_precision, load_base_model
    from lora_lab.models.lora import LoraOptions, apply_lora, prepare_quantized_for_training
    from lora_lab.models.moe import adapted_experts_to

    model_dir = build_tiny_moe(tmp_path / "model", "qwen3-30b-a3b")
    (file,) = model_dir.glob("*.safetensors")
    weights = load_file(file)
    gone = next(k for k in weights if k.endswith("layers.1.mlp.experts.2.up_proj.weight"))
    del weights[gone]
    save_file(weights, file, metadata={"format": "pt"})
    args = ModelArgs(name=str(model_dir), quantization="nf4", attn_implementation="eager")
    model = load_base_model(args, choose_precision("fp32"), LoadOptions(kernels="none"))
    lora = LoraArgs(rank=4, alpha=8, dropout=0.0, experts=True)
    model = apply_lora(prepare_quantized_for_training(model), lora, LoraOptions(gradient_checkpointing=True))
    with pytest.raises(ModelError, match=rf"--model {model_dir}: layer 1's expert 2 has no up_proj weight"):
        adapted_experts_to(model, None)
