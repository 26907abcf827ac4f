"""What the page's form becomes, with nothing imported from gradio: the argument list of
`lora-lab run`, the folders a path may name, and the access token.

The page never builds a shell string: a run is `sys.executable -m lora_lab run` with one list
entry per flag and value, so no form field is ever read by a shell."""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LoraLabError
from ..run_folder import RunFolder

SET_ENTRY = re.compile(r"[a-z_]+\.[a-z_0-9]+=.*")
"""A --set line of the form: section.key=value."""
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class RunForm:
    """The Settings tab's values; an empty value leaves the preset's (or the default) in place."""

    model: str
    data: list
    preset: str = "auto"
    lora_rank: str = ""
    lora_alpha: str = ""
    max_length: str = ""
    micro_batch_size: str = ""
    grad_accum: str = ""
    lr: str = ""
    epochs: str = ""
    max_steps: str = ""
    qlora: bool = False
    output_dir: str = "output"
    run_name: str = ""
    sets: list = field(default_factory=list)
    """Extra KEY=VALUE lines, each passed as --set KEY=VALUE."""

    def flags(self) -> dict:
        """The named flags of `lora-lab run` that are given, as {flag: value} (data: a list)."""
        knobs = {
            "--lora-rank": self.lora_rank,
            "--lora-alpha": self.lora_alpha,
            "--max-length": self.max_length,
            "--micro-batch-size": self.micro_batch_size,
            "--grad-accum": self.grad_accum,
            "--lr": self.lr,
            "--epochs": self.epochs,
            "--max-steps": self.max_steps,
            "--output-dir": self.output_dir,
            "--run-name": self.run_name,
        }
        given = {"--model": self.model.strip(), "--data": [d.strip() for d in self.data if d.strip()]}
        given.update({flag: str(value).strip() for flag, value in knobs.items() if str(value).strip()})
        if self.qlora:
            given["--quantization"] = "nf4"
        return given

    def set_entries(self) -> list[str]:
        entries = [line.strip() for line in self.sets if line.strip()]
        bad = [e for e in entries if not SET_ENTRY.fullmatch(e)]
        if bad:
            raise LoraLabError(
                f"extra settings: {bad[0]!r} is not KEY=VALUE with a config key "
                f"such as train.weight_decay=0.01 (docs/configuration.md)."
            )
        return entries


def run_arguments(form: RunForm, preset: str) -> list[str]:
    """The command of a run from the form: [python, -m, lora_lab, run, --flag, value, ...].
    `preset` is the form's preset with auto already settled (lora_lab.choose_preset)."""
    if not form.model.strip():
        raise LoraLabError("model: choose a model (an alias such as qwen2.5-0.5b, a model folder or a .gguf file).")
    flags = form.flags()
    if not flags["--data"]:
        raise LoraLabError("data: give at least one data file.")
    argv = [sys.executable, "-m", "lora_lab", "run", "--preset", preset]
    for flag, value in flags.items():
        for one in value if isinstance(value, list) else [value]:
            argv += [flag, one]
    for entry in form.set_entries():
        argv += ["--set", entry]
    return argv


def resume_arguments(run_dir: Path) -> list[str]:
    """Continue a run from its newest complete checkpoint with its own saved config."""
    run_dir = Path(run_dir)
    return [
        sys.executable,
        "-m",
        "lora_lab",
        "run",
        "--config",
        str(RunFolder(run_dir).config),
        "--resume",
        str(run_dir),
    ]


# ----------------------------------------------------------------------------- allowed folders


class AllowedFolders:
    """The folders the page may read and write: those given with --allow (default: the folder
    it was started in). A path outside them is refused, after symbolic links are followed."""

    def __init__(self, folders: list):
        self.folders = [Path(f).expanduser().resolve() for f in folders]

    def contains(self, path: str | Path) -> bool:
        resolved = Path(path).expanduser().resolve()
        return any(resolved == f or f in resolved.parents for f in self.folders)

    def check(self, path: str, what: str) -> Path:
        """The path, if inside an allowed folder; else a LoraLabError naming the field."""
        if not str(path).strip():
            raise LoraLabError(f"{what}: empty path.")
        if not self.contains(path):
            raise LoraLabError(
                f"{what}: {path} is outside the folders this page may use "
                f"({', '.join(map(str, self.folders))}); start `lora-lab ui` "
                f"with --allow DIR to add one."
            )
        return Path(path).expanduser().resolve()

    def check_model(self, spec: str) -> str:
        """A model is an alias or hub id (left as it is) unless it names a path: an existing
        file or folder, or one written as a path (/, ./, ~, .gguf), which must be allowed."""
        spec = spec.strip()
        looks_like_path = (
            spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or Path(spec).expanduser().exists()
        )
        if looks_like_path:
            self.check(spec, "model")
        return spec

    def check_data(self, spec: str) -> str:
        """A data entry: a file inside the allowed folders, with an optional #N repeat count
        or #FRACTION sample (docs/data.md)."""
        path = spec.strip().split("#", 1)[0]
        self.check(path, "data")
        if not Path(path).expanduser().is_file():
            raise LoraLabError(f"data: {path} is not a file.")
        return spec.strip()

    def check_form(self, form: RunForm) -> None:
        form.model = self.check_model(form.model)
        form.data = [self.check_data(d) for d in form.data if d.strip()]
        self.check(form.output_dir or "output", "output folder")


# ----------------------------------------------------------------------------- access token


def needs_token(host: str) -> bool:
    """A page reachable from another machine asks for a token; one bound to loopback does not."""
    if host in LOCAL_HOSTS:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: assume it can be reached from elsewhere


def new_token() -> str:
    return secrets.token_urlsafe(24)


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so the answer time says nothing about the token."""
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())
