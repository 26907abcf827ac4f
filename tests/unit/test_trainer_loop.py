"""The Trainer loop's per-step Python, listed once (training/trainer.py): the same model mode,
the same clipped norm and the same cleared gradients as transformers' own walks."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

from lora_lab.training.callbacks import NonFiniteGuard
from lora_lab.training.trainer import LoraLabTrainer, train_mode_kept


def tiny_peft_model():
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return get_peft_model(
        Qwen2ForCausalLM(config), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )


def test_train_mode_is_walked_once_and_again_after_a_root_eval():
    model = tiny_peft_model()
    model.eval()
    with train_mode_kept(model):
        model.train()
    assert all(m.training for m in model.modules())  # the first call walked
    inner = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    inner.eval()
    with train_mode_kept(model):
        model.train()
    assert not inner.training  # no walk while the root kept its mode
    model.eval()  # as evaluation does
    with train_mode_kept(model):
        model.train()
    assert all(m.training for m in model.modules())
    assert "train" not in model.__dict__  # the shortcut lives only inside the block


def test_listed_clipping_and_zero_grad_equal_the_trainers_walks(tmp_path):
    model = tiny_peft_model()
    ids = torch.randint(0, 128, (2, 16))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_grad_norm=0.5,
        max_steps=1,
        save_strategy="no",
        per_device_train_batch_size=2,
    )
    trainer = LoraLabTrainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in ids],
        guard=NonFiniteGuard("stop", "fp32", tmp_path),
    )
    model(input_ids=ids, labels=ids).loss.backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = trainer._clip_grad_norm(model)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected]))
    assert torch.allclose(norm, total, rtol=1e-6)
    assert trainer.guard.clipped_norm is norm
    clipped = [g * min(1.0, 0.5 / (total.item() + 1e-6)) for g in expected]
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected) and all(torch.allclose(a, b) for a, b in zip(got, clipped))
    assert trainer.floating_point_ops({"input_ids": ids}) == 6 * ids.numel() * model.num_parameters(
        exclude_embeddings=True
    )
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer.train()  # one optimizer step through the Trainer's own loop
    assert "zero_grad" in model.__dict__  # the loop's model.zero_grad() was the listed one
    assert all(p.grad is None for p in model.parameters())
    after = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
