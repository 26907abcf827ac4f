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

SET_ENTRY = re.compile(r"([a-z_]+\.[a-z_0-9]+)=.*")
"""A --set line of the form: section.key=value."""
PAGE_SETTABLE = frozenset(
    ["model." + k for k in ("dtype", "quantization", "attn_implementation", "embedding_on_cpu", "fast_lora")]
    + ["model." + k for k in ("fast_lora_chunk_tokens", "cudnn_attention")]
    + ["lora." + k for k in ("rank", "alpha", "dropout", "target_modules", "trainable_tokens", "use_rslora", "init")]
    + ["data." + k for k in ("val_ratio", "format", "max_length", "packing", "packed_attention", "pack_length")]
    + ["data." + k for k in ("truncation", "system", "enable_thinking", "model_name", "model_author", "num_proc")]
    + ["train." + k for k in ("task", "pref_beta", "dpo_loss", "simpo_gamma", "tuner", "micro_batch_size")]
    + ["train." + k for k in ("grad_accum", "lr", "epochs", "max_steps", "loraplus_lr_ratio", "warmup_ratio")]
    + ["train." + k for k in ("neftune_noise_alpha", "lr_scheduler", "weight_decay", "max_grad_norm", "seed")]
    + ["train." + k for k in ("gradient_checkpointing", "offload_checkpoints", "uncheckpointed_layers")]
    + ["train." + k for k in ("offload_copy_stream", "expandable_segments", "mlp_chunk_tokens", "logging_steps")]
    + ["train." + k for k in ("save_steps", "eval_steps", "save_total_limit", "save_only_model", "on_nonfinite")]
    + ["train.oom_retry"]
)
"""The config keys the extra-settings box may set: numbers and switches of the training itself.
Keys that load code (trust_remote_code, kernels), name files or folders (model, data, output,
resume, from_run), reach other hosts (nodes, addresses, report_to) or turn a safety check off
are form fields with their own checks, or are not settable from the page (docs/ui.md)."""
FORCED_SETS = ("model.trust_remote_code=false",)
"""Appended to every run the page starts: a run from the page never runs a model's own code."""
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
"""A run name from the page: one folder name, no separator, not . or .., no leading dot."""


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
        for entry in entries:
            key = SET_ENTRY.fullmatch(entry).group(1)  # type: ignore[union-attr]
            if key not in PAGE_SETTABLE:
                raise LoraLabError(
                    f"extra settings: {key} cannot be set from the page (it loads code, names a file or "
                    f"folder, reaches another host or turns a check off); use the form's fields, or "
                    f"`lora-lab run --set {key}=...` in a terminal."
                )
        return entries

    def check_text(self) -> None:
        """No field holds a control character (a newline would forge console lines)."""
        fields = {"model": self.model, "run name": self.run_name, "output folder": self.output_dir}
        fields.update({flag: str(v) for flag, v in self.flags().items() if not isinstance(v, list)})
        fields.update({f"data line {i + 1}": d for i, d in enumerate(self.data)})
        fields.update({f"extra setting {i + 1}": d for i, d in enumerate(self.sets)})
        for what, value in fields.items():
            if CONTROL.search(value):
                raise LoraLabError(f"{what}: holds a control character (newline, tab, escape); remove it.")


CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
    for entry in [*form.set_entries(), *FORCED_SETS]:
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
        *[a for entry in FORCED_SETS for a in ("--set", entry)],
    ]


# ----------------------------------------------------------------------------- allowed folders


class AllowedFolders:
    """The folders the page may read and write: those given with --allow (default: the folder
    it was started in). A path outside them is refused, after symbolic links are followed."""

    def __init__(self, folders: list, refused: list | None = None):
        self.folders = [Path(f).expanduser().resolve() for f in folders]
        self.refused = [Path(f).expanduser().resolve() for f in refused or []]
        """Folders inside an allowed one that the page still never uses (gradio's upload folder)."""

    def contains(self, path: str | Path) -> bool:
        resolved = Path(path).expanduser().resolve()
        inside = lambda folders: any(resolved == f or f in resolved.parents for f in folders)  # noqa: E731
        return inside(self.folders) and not inside(self.refused)

    def check(self, path: str | Path, what: str) -> Path:
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
        from ..data.reading import parse_spec

        path, _ = parse_spec(spec)  # exactly as `lora-lab run` splits PATH#N
        self.check(path, "data")
        if not Path(path).expanduser().is_file():
            raise LoraLabError(f"data: {path} is not a file.")
        return spec.strip()

    def check_form(self, form: RunForm) -> None:
        form.check_text()
        form.set_entries()
        form.model = self.check_model(form.model)
        form.data = [self.check_data(d) for d in form.data if d.strip()]
        output = self.check(form.output_dir or "output", "output folder")
        if form.run_name.strip():
            if not RUN_NAME.fullmatch(form.run_name.strip()) or form.run_name.strip() in (".", ".."):
                raise LoraLabError(
                    f"run name: {form.run_name.strip()!r} is not a plain folder name (letters, digits, . _ + -; "
                    f"no / and no leading dot)."
                )
            self.check(output / form.run_name.strip(), "run folder")

    def check_saved_run(self, run_dir: Path) -> None:
        """A run folder's own config.yaml, before the page resumes, chats with, merges or exports
        it: no model code, and its model and data inside the allowed folders (a planted
        config.yaml must not widen what the form allows)."""
        from ..data.reading import parse_spec
        from ..run_folder import load_saved_config
        from ..run_folder.names import CONFIG_FILE

        config = load_saved_config(Path(run_dir) / CONFIG_FILE)
        where = f"{Path(run_dir).name}/{CONFIG_FILE}"
        if config.model.trust_remote_code:
            raise LoraLabError(
                f"{where} has model.trust_remote_code: true; the page never runs a model's own code. "
                f"Use the command line (lora-lab chat/merge/export/run --resume) if you trust it."
            )
        for key in ("from_run", "main_address"):
            if getattr(config.train, key, None):
                raise LoraLabError(f"{where} sets train.{key}; the page does not use such runs. Use the command line.")
        if [r for r in config.train.report_to or [] if str(r).lower() not in ("none", "tensorboard")]:
            raise LoraLabError(f"{where} reports to {config.train.report_to}; the page sends nothing out.")
        if int(getattr(config.train, "nodes", 1) or 1) > 1:
            raise LoraLabError(f"{where} runs on several nodes; the page does not. Use the command line.")
        self.check_model(config.model.name)
        for spec in [*config.data.datasets, *config.data.val_data]:
            self.check(parse_spec(str(spec))[0], f"{where}: data")


# ----------------------------------------------------------------------------- access token


def reachable_from_elsewhere(host: str) -> bool:
    """Whether other machines can reach a page bound to `host` (then it never runs without a token)."""
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
    return given is not None and bool(given) and hmac.compare_digest(given.encode(), expected.encode())
