"""Preference and KTO rows: recognised, and refused with the command that trains them."""
from __future__ import annotations

from ..errors import DataError

PREFERENCE_KEYS = ("chosen", "rejected", "rejected_response")


def refuse_preference(row: dict, where: str) -> None:
    """Preference (DPO / ORPO / RM) and KTO rows are not supervised data: say what trains them."""
    keys = [k for k in PREFERENCE_KEYS if k in row]
    if keys:
        raise DataError(
            f"{where}: preference data ({' / '.join(f'`{k}`' for k in keys)}: a better and a worse "
            f"answer, for DPO, ORPO or reward modelling). lora-lab trains supervised "
            f"fine-tuning only and has no preference command; train it with ms-swift "
            f"(`swift rlhf --rlhf_type dpo --dataset FILE`) or LLaMA-Factory (`stage: dpo`, "
            f"`ranking: true` in dataset_info.json). To fine-tune on the chosen answers alone, "
            f"write them as messages rows.")
    if isinstance(row.get("label"), bool) or "kto_tag" in row:
        raise DataError(
            f"{where}: KTO data (a `label` true/false per answer: false marks an answer NOT to "
            f"learn). lora-lab trains supervised fine-tuning only and would learn the bad "
            f"answers too; train it with ms-swift (`swift rlhf --rlhf_type kto --dataset FILE`) "
            f"or LLaMA-Factory (`stage: kto`), or keep only the `label: true` rows and drop the "
            f"`label` field.")
