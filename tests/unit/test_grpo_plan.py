"""--task grpo in the memory planner (planning/generation.py): the generation cache it counts
equals the one transformers' generate builds on tiny models of each layer kind, and a grpo plan
counts prompt + completion, the generation batch, and refuses what does not fit with the fix."""

import pytest
import torch

from lora_lab.config import resolve_config
from lora_lab.errors import LoraLabError
from lora_lab.planning.choice import check_fits
from lora_lab.planning.generation import cache_bytes
from lora_lab.planning.memory import plan_memory
from lora_lab.planning.shape import ModelShape
from tests.support.families import tiny_family_config

SEQUENCES, PROMPT, COMPLETION = 3, 5, 7


def generated_cache(config):
    """The cache transformers' generate leaves after SEQUENCES sampled completions, in bytes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(2, config.vocab_size, (SEQUENCES, PROMPT))
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=COMPLETION,
        min_new_tokens=COMPLETION,
        do_sample=True,
        return_dict_in_generate=True,
    )
    tensors = {}
    for layer in out.past_key_values.layers:
        for value in vars(layer).values():
            for t in value.values() if isinstance(value, dict) else [value]:
                if torch.is_tensor(t) and t.dim() > 1:
                    tensors[id(t)] = t.numel() * t.element_size()
    return sum(tensors.values())


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("qwen3-0.6b", {}),  # full attention
        ("qwen3.5-0.8b", {}),  # Gated DeltaNet states beside full attention
        ("gpt-oss-20b", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}),
    ],
)
def test_the_counted_cache_is_what_generate_builds(name, overrides):
    config = tiny_family_config(name, vocab_size=256, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides)
    built = generated_cache(config)
    counted = cache_bytes(ModelShape.from_config(config.to_dict()), SEQUENCES, PROMPT + COMPLETION)
    # counted on the safe side by one token a layer: the last sampled token is never fed back, and
    # a sliding layer keeps its window less one
    assert built <= counted <= built * 1.2, (built, counted)


def grpo(preset="16gb", model="qwen2.5-7b", **sets):
    flags = {"data.datasets": ["p.jsonl"], "model.name": model, "train.task": "grpo", "grpo.rewards": ["format"]}
    return resolve_config(preset, flags={**flags, **sets})


def test_a_grpo_plan_counts_prompt_and_completion_and_the_generation_batch():
    config = grpo(**{"model.quantization": "nf4", "grpo.max_completion_length": 1024})
    plan = plan_memory(config, 16, longest_sample_tokens=300)
    assert plan.tokens_per_micro_batch == (300 + 1024) * config.train.micro_batch_size
    sequences = config.train.micro_batch_size * config.train.grad_accum
    generation = [v for k, v in plan.parts_gib.items() if k.startswith(f"generation of {sequences} sequences")]
    assert generation and generation[0] > 0
    longer = plan_memory(grpo(**{"model.quantization": "nf4", "grpo.max_completion_length": 2048}), 16, 300)
    assert longer.total_gib > plan.total_gib


def test_a_grpo_run_that_does_not_fit_is_refused_with_the_completion_fix():
    config = grpo(**{"model.quantization": "nf4", "grpo.max_completion_length": 8192, "train.grad_accum": "64"})
    with pytest.raises(LoraLabError, match=r"--max-completion-length 8192.*--max-completion-length 4096"):
        check_fits(config, 16, longest_sample_tokens=500)


def test_a_grpo_run_keeps_its_checkpoints_on_the_gpu_where_the_plan_fits_without_the_host():
    """offload_checkpoints auto: an SFT run on a GPU offloads; a grpo run (many short completions,
    whose copies cost more than they save) only where the plan does not fit without it."""
    config = grpo(**{"model.quantization": "nf4"})
    fits = plan_memory(config, 16, longest_sample_tokens=94)
    assert "layer checkpoints in CPU memory" not in fits.means and "input embedding in CPU memory" in fits.means
    long = grpo(**{"model.quantization": "nf4", "grpo.max_completion_length": 4096, "train.grad_accum": "32"})
    assert "layer checkpoints in CPU memory" in plan_memory(long, 16, longest_sample_tokens=2000).means
    sft = resolve_config("16gb", flags={"data.datasets": ["d.jsonl"], "model.name": "qwen2.5-7b"})
    assert "layer checkpoints in CPU memory" in plan_memory(sft, 16, longest_sample_tokens=94).means


def test_lora_lab_plan_reads_grpo_prompt_rows_as_the_run_does(tmp_path):
    import json

    from click.testing import CliRunner

    from lora_lab.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": " ".join(["word"] * 64)}]}) + "\n")
    args = ["plan", "--preset", "16gb", "--model", "qwen2.5-7b", "--data", str(data), "--task", "grpo"]
    result = CliRunner().invoke(main, [*args, "--reward", "length", "--gpu-memory", "16"])
    assert result.exit_code == 0, result.output
    assert "longest encoded prompt in the data: 93 tokens" in result.output
    assert "605 tokens per micro-batch" in result.output  # the prompt and grpo.max_completion_length 512
