"""lora.trainable_tokens: a base checkpoint whose turn-end row was never trained learns to stop."""

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lora_lab.cli import main
from tests.support.tiny import build_tiny_qwen2, write_jsonl

IM_START, IM_END = 151644, 151645


def untrained_turn_tokens(folder: Path) -> Path:
    """The tiny Qwen2 with the rows of <|im_start|> and <|im_end|> zeroed, as a base
    checkpoint leaves them (tied embeddings: the output head shares them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.get_input_embeddings().weight[[IM_START, IM_END]] = 0
    model.save_pretrained(folder)
    return folder


def train(model_dir: Path, out: Path, trainable: str) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Orbit."}]}
    ]
    data = write_jsonl(out / "d.jsonl", rows)
    result = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "run",
                "--model",
                model_dir,
                "--data",
                f"{data}#8",
                "--max-steps",
                40,
                "--lr",
                "1e-2",
                "--lora-rank",
                16,
                "--lora-dropout",
                0,
                "--output-dir",
                out,
                "--run-name",
                trainable,
                "--set",
                f"lora.trainable_tokens={trainable}",
                "--set",
                "train.lr_scheduler=constant",
            )
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out / trainable


def trained_reply(base: Path) -> list:
    """The ids the template gives the trained reply, through its <|im_end|>."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    turns = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Orbit."}]
    ids = [
        tokenizer.apply_chat_template(t, add_generation_prompt=g, tokenize=True, return_dict=True)["input_ids"]
        for t, g in ((turns[:1], True), (turns, False))
    ]
    answer = ids[1][len(ids[0]) :]
    return answer[: answer.index(IM_END) + 1]


def reply(base: Path, run: Path) -> list:
    """Greedy reply of base + adapter to the trained question, up to 12 tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter").eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    return model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=IM_END)[
        0, prompt.shape[1] :
    ].tolist()


def test_the_turn_end_row_trains_and_only_then_the_model_stops(tmp_path):
    base = untrained_turn_tokens(build_tiny_qwen2(tmp_path / "base"))
    with_rows = train(base, tmp_path, "true")
    weights = load_file(with_rows / "adapter" / "adapter_model.safetensors")
    rows = [k for k in weights if "trainable_tokens" in k]
    assert rows and all(weights[k].shape[0] == 2 for k in rows), sorted(weights)
    # the zeroed row trained: the turn ends where the trained reply's does (the tiny model's
    # answer itself need not be word for word)
    answer, expected = reply(base, with_rows), trained_reply(base)
    assert len(answer) == len(expected) and answer[-1] == IM_END, (answer, expected)

    without = train(base, tmp_path, "false")
    weights = load_file(without / "adapter" / "adapter_model.safetensors")
    assert not [k for k in weights if "trainable_tokens" in k]
    assert IM_END not in reply(base, without)  # LoRA alone: a zero row's logit stays 0
