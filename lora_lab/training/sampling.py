"""--task grpo's sampling: every completion is drawn with noise of its own, so the completions of
a step do not depend on how many sequences are generated at once; when sampling runs out of GPU
memory, the generation batch is halved for the rest of the run and gives the same completions.

Each next token is drawn by the Gumbel-max trick from the scores transformers' sampling would
draw from (after its temperature, top-k, top-p and min-p warpers, SAMPLING_WARPERS):
argmax(scores + g), g = -log(-log(u)), which is a draw from softmax(scores). u is uniform noise
of the whole generation batch at this position, from a generator seeded with the step's key and
the position; a sequence reads its own row of it, whether it is generated with the others or in
a part of the batch. generate itself then runs greedy over scores that leave only the drawn
token, and draws nothing from the process's random state.

What stays the same across parts: the noise and the draws. The logits themselves are computed
by the same kernels on fewer rows; where a kernel's result for a row depends on the number of
rows (some GPU matrix products do), a near-tie can go the other way.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..device import release_memory
from ..log import get_logger

log = get_logger()

TINY = 1e-20
"""Uniform noise below this is read as this (-log(-log(u)) stays finite)."""


def sampling_key(*parts) -> int:
    """A 63-bit seed from the parts (the run's seed, the step, ...): the same on every machine
    and Python (not hash(), which Python salts for strings)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


SAMPLING_WARPERS = ("temperature", "top_k", "top_p", "min_p")
"""The generation config's sampling settings the draw applies (transformers' own warpers, in
transformers' order); another one set (typical_p, epsilon_cutoff, ...) is refused."""


def sampling_processors(config, rows_total: int, key: int):
    """(a greedy copy of the sampling generation config, the processors that draw in its place:
    transformers' warpers of the config, then row_noise_sampler)."""
    import copy

    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    greedy = copy.deepcopy(config)
    unsupported = [
        name
        for name, neutral in (("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("top_h", None))
        if getattr(config, name, neutral) not in (None, neutral)
    ]
    if unsupported or (config.num_beams or 1) > 1:
        raise ValueError(f"--task grpo samples with {', '.join(SAMPLING_WARPERS)} only; got {unsupported or 'beams'}")
    warpers: list = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(config.min_p))
    greedy.do_sample = False
    for name in SAMPLING_WARPERS:
        setattr(greedy, name, None)
    return greedy, [*warpers, row_noise_sampler(rows_total, key)]


def row_noise_sampler(rows_total: int, key: int):
    """A transformers LogitsProcessor drawing each row's next token with its own row of noise
    (the module docstring); `offset` is the first row of the part being generated."""
    import torch
    from transformers import LogitsProcessor

    class RowNoiseSampler(LogitsProcessor):
        def __init__(self):
            self.offset = 0
            self.generators: dict[Any, torch.Generator] = {}

        def __call__(self, input_ids, scores):
            device = scores.device
            generator = self.generators.get(device) or self.generators.setdefault(device, torch.Generator(device))
            generator.manual_seed(sampling_key(key, input_ids.shape[1]))
            noise = torch.rand((rows_total, scores.shape[1]), generator=generator, device=device)
            uniform = noise[self.offset : self.offset + scores.shape[0]].clamp_(min=TINY)
            drawn = (scores.float() - uniform.log_().neg_().log_()).argmax(dim=-1, keepdim=True)
            return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)

    return RowNoiseSampler()


class PartedGeneration:
    """The trainer's generate for one run: all sequences at once, or `sequences` at a time once
    sampling ran out of GPU memory (halved again while it does; not below one)."""

    def __init__(self) -> None:
        self.sequences: int | None = None

    def generate(self, generate, key: int, input_ids, attention_mask=None, **kwargs):
        """`generate` (a model's own) over input_ids with kwargs' generation_config, drawn with
        sampling_processors where it samples; in parts of the batch where memory says so."""
        import torch
        from transformers import LogitsProcessorList

        total, config = input_ids.shape[0], kwargs["generation_config"]
        sampler = None
        if config.do_sample:
            kwargs["generation_config"], processors = sampling_processors(config, total, key)
            sampler = processors[-1]
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), *processors])
        while True:
            at_once = min(self.sequences or total, total)
            try:
                parts = []
                for start in range(0, total, at_once):
                    rows = slice(start, start + at_once)
                    if sampler is not None:
                        sampler.offset = start
                    mask = None if attention_mask is None else attention_mask[rows]
                    parts.append(generate(input_ids=input_ids[rows], attention_mask=mask, **kwargs))
                return _joined(parts, _pad_id(config))
            except torch.OutOfMemoryError:
                if at_once == 1 or sampler is None:
                    raise
                parts = []
                release_memory()
                self.sequences = at_once // 2
                log.warning(
                    f"sampling {at_once} completions at once ran out of GPU memory; sampling {self.sequences} at a "
                    "time from now on (the same completions: each is drawn with its own noise)"
                )


def _pad_id(config) -> int:
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        eos = getattr(config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else eos
    return int(pad or 0)


def _joined(parts: list, pad_id: int):
    """The parts' sequences in one tensor, the shorter parts (all their sequences ended) padded
    with pad_id as generate pads a sequence that ended."""
    import torch

    if len(parts) == 1:
        return parts[0]
    longest = max(p.shape[1] for p in parts)
    padded = [torch.nn.functional.pad(p, (0, longest - p.shape[1]), value=pad_id) for p in parts]
    return torch.cat(padded)
