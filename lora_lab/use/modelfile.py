"""An Ollama Modelfile for an exported GGUF: the TEMPLATE of the chat template's family, the
system prompt training used, and a `stop` parameter per end-of-turn token, all read from the
model's own tokenizer.

Ollama renders TEMPLATE (Go template syntax) once per turn with .System, .Prompt and .Response;
for the turn being generated it stops at {{ .Response }}. The table below holds, per family, the
Go form of the chat template and the markers that delimit its system block.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..log import get_logger

log = get_logger()


@dataclass(frozen=True)
class TemplateFamily:
    name: str
    marker: str
    """Text every chat template of the family writes (how the family is recognised)."""
    system_start: str
    system_end: str
    template: str
    """Ollama TEMPLATE: Go template syntax over .System, .Prompt and .Response."""


TEMPLATE_FAMILIES = (
    TemplateFamily(
        name="chatml",
        marker="<|im_start|>",
        system_start="<|im_start|>system\n",
        system_end="<|im_end|>",
        template=(
            "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
            "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
            "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n"
        ),
    ),
)
"""ChatML covers Qwen2 / Qwen2.5 and SmolLM2 (the templates that write <|im_start|>)."""

_PROBE = "lora-lab-probe"


def template_family(tokenizer) -> TemplateFamily | None:
    template = tokenizer.chat_template or ""
    return next((f for f in TEMPLATE_FAMILIES if f.marker in template), None)


def end_of_turn_tokens(tokenizer, generation_eos_ids=()) -> list[str]:
    """The special token the chat template writes right after an assistant reply, then the
    tokenizer's eos and generation_config.json's eos tokens: where generation must stop."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}], tokenize=False
    )
    after = text[text.rindex(_PROBE) + len(_PROBE) :]
    special = sorted(
        (
            t
            for t in tokenizer.all_special_tokens
            + [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
            if t
        ),
        key=len,
        reverse=True,
    )
    found = [next((t for t in special if after.lstrip().startswith(t)), None)]
    found.append(tokenizer.eos_token)
    found += [tokenizer.convert_ids_to_tokens(int(i)) for i in generation_eos_ids]
    return list(dict.fromkeys(t for t in found if t))


def stop_ids(tokenizer, model) -> list[int]:
    """The ids generation stops at: end_of_turn_tokens with the model's generation_config eos."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in end_of_turn_tokens(tokenizer, eos)]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def default_system_prompt(tokenizer, family: TemplateFamily) -> str | None:
    """The system text the chat template writes for a conversation that has none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}], tokenize=False)
    if not text.startswith(family.system_start):
        return None
    return text[len(family.system_start) : text.index(family.system_end)]


def _quoted(text: str) -> str:
    if '"""' in text:
        raise ValueError(f"cannot quote {text[:40]!r} in a Modelfile (it holds triple quotes)")
    return f'"""{text}"""'


def modelfile_text(tokenizer, gguf_name: str, system: str | None = None, generation_eos_ids=()) -> str:
    """The Modelfile for `gguf_name` beside it. system: the run's data.system (None: the chat
    template's own default)."""
    family = template_family(tokenizer)
    lines = [f"FROM ./{gguf_name}", ""]
    if family is None:
        log.warning(
            "no Ollama TEMPLATE is known for this chat template; the Modelfile leaves "
            "TEMPLATE out, so Ollama chooses one from the GGUF's tokenizer.chat_template"
        )
    else:
        lines += [f"TEMPLATE {_quoted(family.template)}", ""]
        system = system if system is not None else default_system_prompt(tokenizer, family)
        if system:
            lines += [f"SYSTEM {_quoted(system)}", ""]
    for token in end_of_turn_tokens(tokenizer, generation_eos_ids):
        lines.append(f'PARAMETER stop "{token}"')
    return "\n".join(lines) + "\n"


def write_modelfile(folder: Path, tokenizer, gguf_name: str, system: str | None = None, generation_eos_ids=()) -> Path:
    path = Path(folder) / "Modelfile"
    path.write_text(modelfile_text(tokenizer, gguf_name, system, generation_eos_ids), encoding="utf-8")
    return path
