"""Preference and KTO rows met by a supervised (--task sft) run: refused, naming the task that
trains them (pairs.py reads them for --task dpo / orpo / simpo / kto)."""

from __future__ import annotations

from ..errors import DataError

PREFERENCE_KEYS = ("chosen", "rejected", "rejected_response")


def refuse_preference(row: dict, where: str) -> None:
    """Preference (DPO / ORPO / SimPO) and KTO rows are not supervised data: say what trains
    them."""
    keys = [k for k in PREFERENCE_KEYS if k in row]
    if keys:
        raise DataError(
            f"{where}: preference data ({' / '.join(f'`{k}`' for k in keys)}: a better and a worse "
            f"answer). Supervised fine-tuning (--task sft) would not learn the preference; train "
            f"it with `--task dpo` (or orpo, simpo; docs/preference.md). To fine-tune on the "
            f"chosen answers alone, write them as messages rows."
        )
    if isinstance(row.get("label"), bool) or "kto_tag" in row:
        raise DataError(
            f"{where}: KTO data (a `label` true/false per answer: false marks an answer NOT to "
            f"learn). Supervised fine-tuning (--task sft) would learn the bad answers too; train "
            f"it with `--task kto` (docs/preference.md), or keep only the `label: true` rows and "
            f"drop the `label` field."
        )
