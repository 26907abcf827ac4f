"""The run plan: everything a run derives from its config, settled once into one frozen value.

`plan_run(config)` takes what the user asked for (a frozen RunConfig) and settles the rest: the
`--from-run` parent and the LoRA shape it brings, the engine, the trained embedding rows, the
precision, the located model (its path and config.json, read once), the attention, the kernels,
the packed attention, the fast LoRA path, the gradient syncs, the run folder and the resume
point. Training, `lora-lab plan`, the UI and the launcher read the plan; nothing edits one. What
is learned later makes a new plan from the old one: the rows' length (`with_rows`: the memory
means), a resumed run's batch (training/run.resumed_plan), an out-of-memory retry
(training/oom.halved_plan). The settled config (`plan.config`) is what config.yaml
records, with where each value came from.

This module imports no torch: `lora_lab.plan` settles the plan of a GPU run on any machine
(`Target`), and only a run on this machine asks this machine (device.py, models/load.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import RunConfig, engine_of, world_size_of
from ..log import get_logger
from ..planning.memory import TIERS_GIB, MemoryMeans, choose_memory_means, usable_gib
from ..planning.policies import resolve_fast_lora, syncs_each_micro_batch
from ..registry import model_config_of, wants_trainable_tokens

log = get_logger()


@dataclass(frozen=True)
class Target:
    """The machine a plan is for: this one (`here`), or a GPU of gpu_gib (a plan made anywhere)."""

    gpu_gib: float | None
    cuda: bool
    bf16: bool = True
    liger: bool = False
    varlen: bool = False
    cpu_gib: float | None = None
    deepspeed: bool = True

    @classmethod
    def card(cls, gpu_gib: float | None) -> Target:
        """A CUDA GPU of gpu_gib with the installed packages, as `lora-lab plan` assumes."""
        liger = importlib.util.find_spec("liger_kernel") is not None
        return cls(gpu_gib=gpu_gib, cuda=True, liger=liger, varlen=torch_has_varlen())

    @classmethod
    def here(cls) -> Target:
        """This machine (imports torch)."""
        import torch

        from ..device import gpu_memory_gib, host_memory_gib
        from ..models.attention import flash_varlen
        from ..models.kernels import liger_available

        cuda = torch.cuda.is_available()
        return cls(
            gpu_gib=gpu_memory_gib(),
            cuda=cuda,
            bf16=cuda and torch.cuda.is_bf16_supported(),
            liger=liger_available(),
            varlen=cuda and flash_varlen() is not None,
            cpu_gib=host_memory_gib(),
            deepspeed=importlib.util.find_spec("deepspeed") is not None,
        )


@dataclass(frozen=True)
class LocatedModel:
    """The model of a run: what from_pretrained loads (a folder or a hub id) and its config.json,
    read once (empty when the planner does not know the model)."""

    spec: str
    path: str
    config_json: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_type(self) -> str | None:
        return self.config_json.get("model_type")

    @property
    def vocab_size(self) -> int | None:
        return self.config_json.get("vocab_size")

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config_json.get("tie_word_embeddings", False))


@dataclass(frozen=True)
class RunPlan:
    """One run, settled. `config` is the settled config (config.yaml); the rest is derived."""

    config: RunConfig
    model: LocatedModel
    precision: str
    kernels: str
    packed_attention: str
    fast_lora: bool
    sync_each_micro_batch: bool
    gpu_gib: float | None
    cpu_gib: float | None = None
    """The machine's RAM (Target.cpu_gib), which a one-GPU run's host memory is planned against."""
    run_dir: Path | None = None
    resume_from: Path | None = None
    from_run_adapter: Path | None = None
    row_tokens: int | None = None
    memory_means: MemoryMeans | None = None

    @property
    def folder(self) -> Path:
        """The run folder of a run's plan (`lora-lab plan`'s has none)."""
        if self.run_dir is None:
            raise ValueError("a plan made with for_run=False has no run folder")
        return self.run_dir

    @property
    def engine(self) -> str:
        return self.config.train.engine

    @property
    def world_size(self) -> int:
        return world_size_of(self.config.train)

    @property
    def planner_config(self) -> RunConfig:
        """The config as the memory planner counts it: packed attention as the run runs it."""
        data = dataclasses.replace(self.config.data, packed_attention=self.packed_attention)
        return dataclasses.replace(self.config, data=data)

    def with_rows(self, row_tokens: int) -> RunPlan:
        """The plan once the longest training row is known: the memory means settled for it."""
        means = None
        if self.config.train.tuner != "full":
            means = choose_memory_means(
                self.planner_config,
                on_gpu=self.gpu_gib is not None,
                tied_embeddings=self.model.tied_embeddings,
                row_tokens=row_tokens,
                budget_gib=usable_gib(self.gpu_gib),
            )
        return dataclasses.replace(self, row_tokens=row_tokens, memory_means=means)

    def with_config(self, config: RunConfig, **changes) -> RunPlan:
        """A new plan of a changed settled config (a resumed or retried batch), rows unknown again."""
        return dataclasses.replace(self, config=config, row_tokens=None, memory_means=None, **changes)

    def located(self) -> RunPlan:
        """The plan with its model located on this machine (a plan made with locate=False)."""
        return dataclasses.replace(self, model=locate_run_model(self.config))

    def describe(self) -> str:
        """The settled facts, one line."""
        parts = [
            f"engine {self.engine} x{self.world_size}",
            f"precision {self.precision}",
            f"kernels {self.kernels}",
            f"packed attention {self.packed_attention}",
            f"fast LoRA {'on' if self.fast_lora else 'off'}",
            f"micro-batch {self.config.train.micro_batch_size} x grad-accum {self.config.train.grad_accum}",
        ]
        return "plan: " + "; ".join(parts)


def plan_run(
    config: RunConfig, target: Target | None = None, for_run: bool = True, quiet: bool = False, locate: bool = True
) -> RunPlan:
    """Settle `config` into its plan, on this machine (target None) or for `target`.

    for_run: a run's plan (the model located, possibly fetched; the run folder and resume point
    fixed; quiet: no word on a fresh start). False: `lora-lab plan`'s, which touches neither the
    hub nor a run folder. locate False: a run folder but no model located (a dry-run launch for
    another machine)."""
    target = target or Target.here()
    config = settle_from_run(config)
    config = settle_engine(config, target)
    config = settle_trainable_tokens(config)
    config, precision = settle_precision(config, target)
    model = (
        locate_run_model(config)
        if for_run and locate
        else LocatedModel(config.model.name, config.model.name, known_config(config))
    )
    config = settle_attention(config, model, target)
    run_dir = resume_from = None
    if for_run:
        from ..run_folder import fix_run_dir, locate_run_dir
        from .checkpoint import resolve_resume

        run_dir = locate_run_dir(config)
        config = fix_run_dir(config, run_dir)
        resume_from = resolve_resume(config.train.resume, run_dir, quiet) if config.train.resume else None
    return RunPlan(
        config=config,
        model=model,
        precision=precision,
        kernels=settle_kernels(config.model.kernels, target),
        packed_attention=settle_packed_attention(
            config.data.packed_attention, target, config.model.attn_implementation
        ),
        fast_lora=resolve_fast_lora(config),
        sync_each_micro_batch=syncs_each_micro_batch(config.train),
        gpu_gib=target.gpu_gib if target.cuda else None,
        cpu_gib=target.cpu_gib if target.cuda else None,
        run_dir=run_dir,
        resume_from=resume_from,
        from_run_adapter=from_run_adapter(config),
    )


PLAN_FACTS = ("precision", "kernels", "packed_attention", "fast_lora", "sync_each_micro_batch", "gpu_gib", "cpu_gib")
"""The settled facts a plan file holds beside the settled config (paths are written as text)."""


def write_plan(plan: RunPlan, path: Path) -> None:
    """The plan as a file: the settled config as config.yaml has it (load_saved_config reads it)
    and a `plan:` section with the rest."""
    from ..run_folder import save_config

    save_config(plan.config, path)
    paths = {"run_dir": plan.run_dir, "resume_from": plan.resume_from, "from_run_adapter": plan.from_run_adapter}
    facts = {name: getattr(plan, name) for name in PLAN_FACTS}
    facts |= {name: str(value) if value is not None else None for name, value in paths.items()}
    facts |= {"model_path": plan.model.path, "model_config": dict(plan.model.config_json)}
    with open(path, "a", encoding="utf-8") as out:
        out.write(yaml.safe_dump({"plan": facts}, sort_keys=False, allow_unicode=True))


def read_plan(path: Path) -> RunPlan:
    """The plan write_plan wrote: what a launched worker trains with."""
    from ..run_folder import load_saved_config

    config = load_saved_config(path)
    facts = yaml.safe_load(Path(path).read_text(encoding="utf-8"))["plan"]
    paths: dict[str, Any] = {
        name: Path(facts[name]) if facts[name] else None for name in ("run_dir", "resume_from", "from_run_adapter")
    }
    model = LocatedModel(config.model.name, facts["model_path"], facts["model_config"] or {})
    return RunPlan(config=config, model=model, **{name: facts[name] for name in PLAN_FACTS}, **paths)


def known_config(config: RunConfig) -> dict:
    return model_config_of(config.model.name) or {}


def locate_run_model(config: RunConfig) -> LocatedModel:
    """The model on this machine (a GGUF converted, a hub model fetched), its config.json read."""
    from ..models.load import locate_model

    path = locate_model(config.model.name)
    return LocatedModel(config.model.name, path, model_config_of(path) or {})


def settle_from_run(config: RunConfig) -> RunConfig:
    """--from-run RUN: the config with RUN's base model and LoRA shape (training/preference.py)."""
    if not config.train.from_run:
        return config
    from .preference import from_run_config

    return from_run_config(config)


def from_run_adapter(config: RunConfig) -> Path | None:
    """--from-run: the SFT run's adapter folder, which this run continues."""
    if not config.train.from_run:
        return None
    from ..run_folder import read_sft_run

    return read_sft_run(config.train.from_run)[0]


def settle_engine(config: RunConfig, target: Target) -> RunConfig:
    """train.engine auto: ddp for one process (config.engine_of); with several, the fastest engine
    the memory plan fits on the target's GPUs (planning.choice.pick_engine)."""
    if config.train.engine != "auto":
        return config
    from ..planning.choice import pick_engine

    if world_size_of(config.train) == 1:
        return config.with_changes({"train.engine": engine_of(config.train)}, "auto (one GPU)")
    engine, why = pick_engine(config, target.gpu_gib, target.cpu_gib, target.deepspeed)
    where = f"{target.gpu_gib:.1f} GiB per GPU" if target.gpu_gib else "no GPU memory known"
    log.info(f"--engine auto: {engine} for {world_size_of(config.train)} GPUs ({where}): {why}")
    return config.with_changes({"train.engine": engine}, "auto")


def settle_trainable_tokens(config: RunConfig) -> RunConfig:
    """lora.trainable_tokens auto: on for LoRA and DoRA on a base checkpoint
    (registry.wants_trainable_tokens), off otherwise."""
    setting = config.lora.trainable_tokens
    if isinstance(setting, bool):
        return config
    wanted = wants_trainable_tokens(setting, config.train.tuner, config.model.name)
    why = "a base checkpoint" if wanted else "not a LoRA or DoRA run of a base checkpoint"
    return config.with_changes({"lora.trainable_tokens": wanted}, f"auto ({why})")


def settle_attention(config: RunConfig, model: LocatedModel, target: Target) -> RunConfig:
    """model.attn_implementation: the family's own where sdpa cannot run its attention
    (registry.Family.attention: gpt-oss's sinks; eager on a CPU); a packed row then attends
    through the mask transformers builds from its restarting positions."""
    from ..errors import LoraLabError
    from ..registry import attention_for

    needed = attention_for(model.model_type, config.model.attn_implementation, target.cuda)
    if needed == config.model.attn_implementation:
        return config
    source = config.sources.get("model.attn_implementation", "default")
    if source != "default" and not source.startswith("preset"):
        raise LoraLabError(
            f"model.attn_implementation sdpa ({source}): {model.model_type} models need {needed} "
            f"(sdpa has no attention sinks); drop the setting or pass {needed}."
        )
    log.info(f"model.attn_implementation: {needed} ({model.model_type}: sdpa has no attention sinks)")
    return config.with_changes({"model.attn_implementation": needed}, f"{model.model_type} needs it")


def settle_precision(config: RunConfig, target: Target) -> tuple[RunConfig, str]:
    """--dtype auto: bf16 where the GPU has it, fp16 on older GPUs, fp32 on CPU; recorded in the
    settled config, so that config.yaml says what the run trained in (`lora-lab merge` merges in
    it). A run on this machine checks a forced dtype (models/load.choose_precision)."""
    requested = config.model.dtype
    if requested != "auto":
        return config, requested
    name = ("bf16" if target.bf16 else "fp16") if target.cuda else "fp32"
    return config.with_changes({"model.dtype": name}, "auto (GPU)" if target.cuda else "auto (CPU)"), name


def settle_kernels(kernels: str, target: Target) -> str:
    """model.kernels -> "liger" or "none" on the target (models/kernels.applies_liger refuses a
    forced liger the machine cannot run)."""
    if kernels == "none" or (kernels == "auto" and not (target.cuda and target.liger)):
        return "none"
    return "liger"


def torch_has_varlen() -> bool:
    """Whether the installed PyTorch ships torch.nn.attention.varlen (the kernel
    data.packed_attention auto takes on a CUDA GPU), found on disk: planning imports no torch."""
    spec = importlib.util.find_spec("torch")
    return spec is not None and any(
        (Path(folder) / "nn" / "attention" / "varlen.py").exists() for folder in spec.submodule_search_locations or ()
    )


def settle_packed_attention(kind: str, target: Target, attention: str = "sdpa") -> str:
    """data.packed_attention auto: varlen where the target's PyTorch runs it on CUDA, else mask.
    A model attending with another implementation than sdpa (eager, flex_attention, flash
    attention: model.attn_implementation or its family's) takes `positions`: the position ids
    restart at each sample and transformers builds each layer's mask from them in the form that
    implementation reads (a [tokens x tokens] mask for eager)."""
    if attention != "sdpa":
        return "positions"
    if kind != "auto":
        return kind
    return "varlen" if target.cuda and target.varlen else "mask"


def plan_target(preset: str, gpu_gib: float | None) -> Target:
    """`lora-lab plan`'s target: a GPU of gpu_gib, or the preset's card (16gb: 16 GiB)."""
    if gpu_gib is None and preset in TIERS_GIB:
        gpu_gib = TIERS_GIB[preset]
        log.info(f"planned for the {preset} preset's card, {gpu_gib} GiB (--gpu-memory GIB plans for another)")
    return Target.card(gpu_gib)
