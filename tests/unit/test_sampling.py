"""--task grpo's sampling (training/sampling.py): each completion drawn with its own noise, so a
generation batch sampled whole or in parts gives the same tokens; out of GPU memory, the batch is
halved until it fits and stays so; the draws follow the warped softmax."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lora_lab.training.sampling import PartedGeneration, row_noise_sampler, sampling_processors
from tests.support.tiny import build_tiny_qwen2

CONFIG = GenerationConfig(do_sample=True, temperature=0.9, max_new_tokens=8, pad_token_id=0, eos_token_id=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path_factory.mktemp("tiny")))


def prompts(rows: int = 8):
    ids = torch.randint(0, 1000, (rows, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    return ids, mask


def test_the_batch_in_parts_samples_the_same_completions_and_another_key_others(tiny):
    ids, mask = prompts()
    parted = PartedGeneration()
    whole = parted.generate(tiny.generate, 7, ids, attention_mask=mask, generation_config=CONFIG)
    parted.sequences = 3  # parts of 3, 3 and 2
    assert torch.equal(parted.generate(tiny.generate, 7, ids, attention_mask=mask, generation_config=CONFIG), whole)
    other = parted.generate(tiny.generate, 8, ids, attention_mask=mask, generation_config=CONFIG)
    assert not torch.equal(other, whole)
    assert whole.shape == (8, 13)


def test_out_of_memory_halves_the_batch_until_it_fits_and_keeps_it_halved(tiny, capsys):
    ids, mask = prompts()
    asked = []

    def generate(input_ids, **kwargs):
        asked.append(input_ids.shape[0])
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return tiny.generate(input_ids=input_ids, **kwargs)

    expected = PartedGeneration().generate(tiny.generate, 7, ids, attention_mask=mask, generation_config=CONFIG)
    parted = PartedGeneration()
    got = parted.generate(generate, 7, ids, attention_mask=mask, generation_config=CONFIG)
    assert torch.equal(got, expected)
    assert asked == [8, 4, 2, 2, 2, 2] and parted.sequences == 2
    assert "sampling 8 completions at once ran out of GPU memory; sampling 4 at a time" in capsys.readouterr().out
    asked.clear()
    parted.generate(generate, 7, ids, attention_mask=mask, generation_config=CONFIG)
    assert asked == [2, 2, 2, 2]  # the next step starts where the last one fitted


def test_out_of_memory_with_one_sequence_at_a_time_is_raised(tiny):
    def generate(input_ids, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    ids, mask = prompts(2)
    with pytest.raises(torch.OutOfMemoryError):
        PartedGeneration().generate(generate, 7, ids, attention_mask=mask, generation_config=CONFIG)


def test_the_draws_follow_the_softmax_of_the_warped_scores():
    rows = 20000
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    scores = probs.log().expand(rows, 4).clone()
    ids = torch.zeros((rows, 3), dtype=torch.long)

    def frequencies(processors):
        out = scores
        for processor in processors:
            out = processor(ids, out)
        assert torch.all((out == 0).sum(dim=1) == 1) and torch.all((out == 0) | (out == float("-inf")))
        return torch.bincount(out.argmax(dim=1), minlength=4).float() / rows

    assert torch.allclose(frequencies([row_noise_sampler(rows, 1)]), probs, atol=0.015)
    sharper = probs**2 / (probs**2).sum()  # temperature 0.5
    _, processors = sampling_processors(GenerationConfig(do_sample=True, temperature=0.5), rows, 2)
    assert torch.allclose(frequencies(processors), sharper, atol=0.015)
    _, processors = sampling_processors(GenerationConfig(do_sample=True, top_k=1), rows, 3)
    assert torch.equal(frequencies(processors), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_a_sampling_setting_the_draw_does_not_apply_is_refused():
    greedy, _ = sampling_processors(GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9), 2, 1)
    assert not greedy.do_sample and greedy.temperature is None and greedy.top_p is None
    with pytest.raises(ValueError, match="typical_p"):
        sampling_processors(GenerationConfig(do_sample=True, typical_p=0.5), 2, 1)
