"""{{NAME}} / {{AUTHOR}} in rows (LLaMA-Factory's identity.json form), filled from --model-name and
--model-author; a placeholder left unfilled is a warning naming the flag."""

from __future__ import annotations

import re

from .readers import Problem

PLACEHOLDER = re.compile(r"\{\{(name|author)\}\}", re.IGNORECASE)
FILL_KEYS = {"name": "model_name", "author": "model_author"}


def fill_placeholders(samples: list, fill: dict) -> list:
    """Replace {{NAME}} / {{AUTHOR}} (any case) from --model-name / --model-author; a row that
    keeps one (the value was not given) is a warning naming the flag."""
    warnings = []
    for sample in samples:
        left: set[str] = set()

        def replace(match, left=left):
            value = fill.get(FILL_KEYS[match.group(1).lower()])
            if value:
                return value
            left.add(match.group(0))
            return match.group(0)

        if sample.text is not None:
            sample.text = PLACEHOLDER.sub(replace, sample.text)
        for message in sample.messages:
            message["content"] = PLACEHOLDER.sub(replace, message["content"])
        if left:
            flags = " and ".join(sorted({"--" + FILL_KEYS[t[2:-2].lower()].replace("_", "-") for t in left}))
            warnings.append(
                Problem(
                    sample.origin,
                    f"placeholder {', '.join(sorted(left))} is "
                    f"not filled and would be trained literally; "
                    f"pass {flags}",
                )
            )
    return warnings
