"""Training samples as the Trainer reads them, and the collators that batch them."""

from __future__ import annotations

from collections.abc import Sequence

from .encode import IGNORE_INDEX


class SupervisedDataset:
    """Encoded samples (or packed rows, fields=PACKED_FIELDS) as the Trainer expects them: a
    list of dicts."""

    def __init__(self, samples: Sequence, fields: tuple = ("input_ids", "labels")):
        self.samples, self.fields = samples, fields

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        sample = self.samples[index]
        return {field: getattr(sample, field) for field in self.fields}


PACKED_FIELDS = ("input_ids", "labels", "lengths")


class PadCollator:
    """Right-pads a micro-batch to its longest sample; padding never carries loss."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        batch: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
        for f in features:
            pad = longest - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


class PackedCollator:
    """One packed row per micro-batch: position ids restart at every sample and a block-diagonal
    causal mask keeps each sample's attention inside the sample (attention "mask", for sdpa;
    "segments" or "varlen": the sample lengths and their cumulative sums instead, for
    models/attention.py; "positions", for the model's own attention implementation: the position
    ids alone, from which transformers builds each layer's mask in the form its attention reads)."""

    def __init__(self, pad_token_id: int, attention: str = "mask"):
        self.pad_token_id, self.attention = pad_token_id, attention
        self.padded = PadCollator(pad_token_id)

    def __call__(self, features: list) -> dict:
        import torch

        if "lengths" not in features[0]:
            return self.padded(features)  # evaluation batches are not packed
        if len(features) != 1:
            raise ValueError("packed rows are collated one per micro-batch")
        row = features[0]
        ids, labels, lengths = row["input_ids"], row["labels"], row["lengths"]
        if not ids:  # the last step of an epoch may leave a row without samples
            ids, labels, lengths = [self.pad_token_id], [IGNORE_INDEX], [1]
        batch = {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        }
        if len(lengths) == 1 or self.attention == "positions":  # one sample: plain causal attention
            return batch
        if self.attention in ("segments", "varlen"):
            ends = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return {
                **batch,
                "packed_lengths": list(lengths),
                "packed_cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), ends]),
            }
        sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        causal = torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool))
        mask = (sample[:, None] == sample[None, :]) & causal
        return {**batch, "attention_mask": mask[None, None]}
