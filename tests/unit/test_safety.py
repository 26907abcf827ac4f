"""The non-finite guard's decisions, the fp16 advice, and torch.load's use across lora_lab."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lora_lab
from lora_lab.errors import ModelError, TrainingError
from lora_lab.models.load import check_remote_code
from lora_lab.training.callbacks import NonFiniteGuard, nonfinite_message


def model_with_gradient(value: float):
    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.tensor([[1.0, value]])
    model.bias.grad = torch.tensor([0.5])
    return model


def pre_optimizer_step(guard, model, fp16=False, global_step=6, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=1.0)
    guard.on_pre_optimizer_step(
        SimpleNamespace(fp16=fp16, world_size=1),
        SimpleNamespace(global_step=global_step),
        None,
        model=model,
        optimizer=optimizer,
    )


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_gradient_stops_the_run_by_default(tmp_path, value):
    guard = NonFiniteGuard("stop", "bf16", tmp_path)
    with pytest.raises(
        TrainingError,
        match=r"step 7: the gradient norm is (inf|nan)\. The "
        r"update was not applied",
    ):
        pre_optimizer_step(guard, model_with_gradient(value))


def test_skip_removes_the_gradient_so_the_optimizer_changes_nothing(tmp_path, capsys):
    guard = NonFiniteGuard("skip", "bf16", tmp_path)
    model = model_with_gradient(float("nan"))
    pre_optimizer_step(guard, model)
    assert model.weight.grad is None and model.bias.grad is None
    assert guard.skipped_steps == [7] and "update skipped" in capsys.readouterr().out
    finite = model_with_gradient(2.0)
    pre_optimizer_step(guard, finite)
    assert finite.weight.grad is not None and guard.skipped_steps == [7]


def test_the_trainers_clipped_norm_is_the_one_checked_once(tmp_path):
    guard = NonFiniteGuard("stop", "bf16", tmp_path)
    guard.clipped_norm = torch.tensor(float("nan"))  # what LoraLabMixin._clip_grad_norm hands
    with pytest.raises(TrainingError, match="the gradient norm is nan"):
        pre_optimizer_step(guard, model_with_gradient(1.0))
    assert guard.clipped_norm is None  # read once: the next step computes or gets its own
    pre_optimizer_step(guard, model_with_gradient(1.0))


def test_a_nan_loss_is_caught_even_with_finite_gradients(tmp_path):
    guard = NonFiniteGuard("stop", "fp32", tmp_path)
    guard.note_loss(torch.tensor(float("nan")))
    with pytest.raises(TrainingError, match="step 7: the loss is nan"):
        pre_optimizer_step(guard, model_with_gradient(1.0))


def test_with_fp16_the_loss_scaler_handles_overflowing_gradients(tmp_path):
    guard = NonFiniteGuard("stop", "fp16", tmp_path)
    pre_optimizer_step(guard, model_with_gradient(float("inf")), fp16=True)  # scaler skips it
    guard.note_loss(torch.tensor(float("inf")))
    with pytest.raises(TrainingError, match=r"fp16 overflow.*--dtype bf16"):
        pre_optimizer_step(guard, model_with_gradient(1.0), fp16=True)


def fused_step(guard, model, global_step=6):
    """One optimizer step of fused AdamW with the guard's hook before it; the optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    pre_optimizer_step(guard, model, global_step=global_step, optimizer=optimizer)
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_fused_adamw_skips_the_update_itself_and_the_verdict_is_read_later(tmp_path, policy, capsys):
    guard = NonFiniteGuard(policy, "bf16", tmp_path)
    model = model_with_gradient(float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = fused_step(guard, model)  # the host has not looked: no error, no warning yet
    assert guard.skipped_steps == [] and "skipped" not in capsys.readouterr().out
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(
        float(state["step"]) == 0 and not state["exp_avg"].any() for state in optimizer.state.values()
    )  # as if the step never ran
    if policy == "stop":
        with pytest.raises(TrainingError, match="step 7: the gradient norm is nan"):
            guard.settle()
    else:
        guard.settle()
        assert guard.skipped_steps == [7] and "update skipped" in capsys.readouterr().out
    guard.settle()  # read once
    assert guard.skipped_steps == ([] if policy == "stop" else [7])


def test_a_finite_step_updates_exactly_as_fused_adamw_alone(tmp_path):
    guarded, alone = model_with_gradient(2.0), model_with_gradient(2.0)
    alone.load_state_dict(guarded.state_dict())
    guard = NonFiniteGuard("stop", "bf16", tmp_path)
    guard.note_loss(torch.tensor(1.5))
    fused_step(guard, guarded)
    torch.optim.AdamW(alone.parameters(), lr=0.1, fused=True).step()
    assert all(torch.equal(a, b) for a, b in zip(guarded.parameters(), alone.parameters()))
    assert not torch.equal(guarded.weight, model_with_gradient(2.0).weight)  # it did train


def test_the_next_step_reads_the_verdict_before_its_own_update(tmp_path):
    guard = NonFiniteGuard("stop", "fp32", tmp_path)
    guard.note_loss(torch.tensor(float("inf")))
    fused_step(guard, model_with_gradient(1.0), global_step=6)
    with pytest.raises(TrainingError, match="step 7: the loss is inf"):
        pre_optimizer_step(
            guard,
            model_with_gradient(1.0),
            global_step=7,
            optimizer=torch.optim.AdamW(model_with_gradient(1.0).parameters(), fused=True),
        )


def test_the_advice_depends_on_precision(tmp_path):
    assert "--dtype bf16" in nonfinite_message(3, "the loss is nan", "fp16", tmp_path)
    assert "--lr" in nonfinite_message(3, "the loss is nan", "bf16", tmp_path)


def test_every_torch_load_in_lora_lab_is_weights_only():
    calls = []
    for path in Path(lora_lab.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                calls.append((path.name, keywords.get("weights_only")))
    assert calls and all(value == "True" for _, value in calls), calls


def test_remote_code_needs_the_flag(tmp_path):
    (tmp_path / "config.json").write_text('{"auto_map": {"AutoModel": "x.Model"}}')
    with pytest.raises(ModelError, match="ships its own Python code.*--trust-remote-code"):
        check_remote_code(str(tmp_path), trust_remote_code=False)
    check_remote_code(str(tmp_path), trust_remote_code=True)


def test_a_w4a16_folder_without_its_library_is_refused_with_the_install(tmp_path, monkeypatch):
    import importlib.util
    import json

    from lora_lab.errors import ModelError
    from lora_lab.models.load import check_quantized_folder

    find_spec = importlib.util.find_spec  # make test installs it: act as if it were not
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors" else find_spec(name, *a)
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "quantization_config": {"quant_method": "compressed-tensors"}})
    )
    with pytest.raises(ModelError, match="pip install compressed-tensors"):
        check_quantized_folder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    check_quantized_folder(str(tmp_path))  # a plain folder passes
