"""How a config field is declared: its default with the help text, choices and bounds that
`lora-lab run --help`, the checks and docs/configuration.md read."""

from __future__ import annotations

from dataclasses import field


def spec_field(
    default, help: str, choices: tuple | None = None, minimum: float | None = None, maximum: float | None = None
):
    """A config field with its help text (shown by `lora-lab run --help` and in errors)."""
    kwargs = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(metadata={"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}, **kwargs)
