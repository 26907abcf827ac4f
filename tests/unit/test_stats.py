"""Length statistics use the real chat template and count what each max_length would cut."""

from lora_lab.data.encode import encode_sample
from lora_lab.data.formats import Sample
from lora_lab.data.stats import length_stats, percentile


def _sample(words: int, index: int) -> Sample:
    return Sample(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": " ".join(["word"] * words)}], f"t:{index}"
    )


def test_lengths_match_the_encoder_and_counts_are_exact(tokenizer):
    samples = [_sample(words, i) for i, words in enumerate([10] * 90 + [600] * 9 + [3000])]
    stats = length_stats(tokenizer, samples)
    lengths = sorted(len(encode_sample(tokenizer, s, 10**9).input_ids) for s in samples)
    assert stats.count == 100 and stats.max == lengths[-1]
    assert stats.p50 == lengths[49] and stats.p90 == lengths[89] and stats.p99 == lengths[98]
    assert stats.over == {512: 10, 1024: 1, 2048: 1, 4096: 0}
    assert stats.recommended_max_length == 1024  # p99 is a 600-word sample: ~630 tokens
    assert "recommended --max-length 1024" in stats.table()


def test_percentile_is_nearest_rank():
    assert percentile([1, 2, 3, 4], 0.5) == 2 and percentile([5], 0.99) == 5
