"""Preference tasks (--task dpo / orpo / simpo / kto) with TRL's trainers and lora-lab's
guarantees: each trainer class is TRL's with LoraLabMixin in front (crash-safe checkpoints, the
non-finite guard, exact resume), fed the samples data/pairs.py encoded.

  dpo    trl.DPOTrainer (loss train.dpo_loss), reference: see below
  kto    trl.KTOTrainer, reference: see below
  simpo  trl.experimental.cpo.CPOTrainer with loss_type="simpo" (no reference model)
  orpo   trl.experimental.orpo.ORPOTrainer (no reference model)

The reference of dpo and kto is the policy the run starts from, frozen: TRL copies a PEFT
model's adapter into a frozen "ref" adapter and computes the reference with it. A new adapter
starts at zero (LoRA's B = 0), so there the reference is the base model; with --from-run it is
the SFT run's adapter, the SFT policy the DPO paper takes as reference. Policy and reference
are then equal at step 0, and the DPO loss there is ln 2.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import TrainingError
from ..log import get_logger
from ..run_folder import is_adapter_folder
from .trainer import LoraLabMixin

log = get_logger()

TRL_REQUIREMENT = "trl>=1.16,<2"
"""The TRL versions lora-lab's preference tasks are tested with (setup.cfg extra `preference`)."""
REFERENCE_ADAPTER = "ref"
"""The frozen copy of the starting adapter TRL adds as the reference (dpo, kto)."""


def require_trl() -> None:
    """TRL installed, in the tested range; else how to install it."""
    from packaging.version import Version

    try:
        import trl
    except ImportError:
        raise TrainingError(
            "--task dpo/orpo/simpo/kto/grpo trains with TRL, which is not installed: "
            "pip install 'lora-lab[preference]' (or "
            f"pip install '{TRL_REQUIREMENT}')."
        ) from None
    version = Version(trl.__version__)
    if not Version("1.16") <= version < Version("2"):
        raise TrainingError(
            f"TRL {trl.__version__} is installed; lora-lab's preference tasks "
            f"are tested with {TRL_REQUIREMENT}: pip install '{TRL_REQUIREMENT}'."
        )


FROM_RUN_KEYS = ("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules")
"""The adapter's shape: a continued adapter keeps the SFT run's."""


def from_run_config(config: RunConfig) -> RunConfig:
    """--from-run RUN: the run continues RUN's adapter, so it takes RUN's LoRA shape and base
    model (a --model that names another base is refused); a new config, said in the log and
    recorded in config.yaml with --from-run as the source."""
    from ..registry import resolve_model_spec
    from ..run_folder import read_sft_run

    adapter_dir, saved = read_sft_run(config.train.from_run)
    source = f"--from-run {config.train.from_run}"
    values = {key: saved.value(key) for key in FROM_RUN_KEYS}
    if config.sources.get("model.name", "default") == "default":
        values["model.name"] = saved.model.name
    elif resolve_model_spec(config.model.name)[1] != resolve_model_spec(saved.model.name)[1]:
        raise TrainingError(
            f"{source} trained an adapter for {saved.model.name}; --model "
            f"{config.model.name} is another base. Drop --model (the run's base "
            f"is taken) or pass --model {saved.model.name}."
        )
    settled = config.with_changes(values, source)
    log.info(
        f"{source}: continuing {adapter_dir} (LoRA r={saved.lora.rank} "
        f"alpha={saved.lora.alpha}) on {settled.model.name}"
    )
    return settled


class TrainedAdapterOnly:
    """What a TRL trainer of lora-lab's saves (mixed in before TRL's class): the trained adapter
    alone, without TRL's frozen reference copy, and no README.md model card in checkpoints or
    adapter/ (run_summary.json says it)."""

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        ref = Path(output_dir or self.args.output_dir) / REFERENCE_ADAPTER
        if ref.is_dir() and is_adapter_folder(ref):
            shutil.rmtree(ref)

    def create_model_card(self, *args, **kwargs):
        """None: see the class."""


@functools.cache
def trainer_class(task: str):
    """The TRL trainer of `task` with lora-lab's mixin; built once per task."""
    require_trl()
    base: type
    if task == "dpo":
        from trl import DPOTrainer as base
    elif task == "kto":
        from trl import KTOTrainer as base
    elif task == "simpo":
        from trl.experimental.cpo import CPOTrainer as base
    elif task == "orpo":
        from trl.experimental.orpo import ORPOTrainer as base
    else:
        raise ValueError(f"not a preference task: {task}")

    class PreferenceTrainer(LoraLabMixin, TrainedAdapterOnly, base):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            """Rows arrive encoded (data/pairs.py); KTO adds each micro-batch's mismatched
            answers for its KL estimate, as TRL's own preparation does."""
            if task == "kto" and self.calculate_KL:

                def add_kl(batch):
                    batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
                    return batch

                dataset = dataset.map(add_kl, batched=True, batch_size=args.per_device_train_batch_size)
            return dataset

        def tokenize_row(self, feature, model=None) -> dict:
            """CPO / ORPO: the encoded pair in their column layout."""
            prompt = feature["prompt_ids"]
            out = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
            for name in ("chosen", "rejected"):
                ids = prompt + feature[f"{name}_ids"]
                out[f"{name}_input_ids"] = ids
                out[f"{name}_attention_mask"] = [1] * len(ids)
                out[f"{name}_labels"] = [-100] * len(prompt) + feature[f"{name}_ids"]
            return out

    PreferenceTrainer.__name__ = PreferenceTrainer.__qualname__ = f"LoraLab{base.__name__}"
    return PreferenceTrainer


def trainer_config(task: str):
    """TRL's TrainingArguments subclass for `task`."""
    require_trl()
    if task == "dpo":
        from trl import DPOConfig

        return DPOConfig
    if task == "kto":
        from trl import KTOConfig

        return KTOConfig
    if task == "simpo":
        from trl.experimental.cpo import CPOConfig

        return CPOConfig
    from trl.experimental.orpo import ORPOConfig

    return ORPOConfig


def task_settings(config: RunConfig) -> dict:
    """The TRL config fields lora-lab sets for config.train.task. Gradient checkpointing stays
    lora-lab's (models/lora.py): TRL turns it off for the reference forward and back on with
    these kwargs. Sequences arrive cut to --max-length, so TRL truncates nothing more."""
    t = config.train
    common = {
        "gradient_checkpointing": False,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "beta": t.pref_beta,
    }
    if t.task == "dpo":
        return {**common, "loss_type": [t.dpo_loss], "max_length": None}
    if t.task == "kto":
        return {**common, "max_length": None}
    length = {"max_length": config.data.max_length, "max_completion_length": None}
    if t.task == "simpo":
        return {**common, **length, "loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": t.simpo_gamma}
    return {**common, **length}


def rows_dataset(samples: list):
    """A datasets.Dataset of the encoded samples' TRL rows (EncodedPair.row, EncodedPrompt.row)."""
    from datasets import Dataset

    return Dataset.from_list([s.row() for s in samples])


def build_preference_trainer(
    config: RunConfig,
    model,
    args,
    train_samples: list,
    val_samples: list | None,
    tokenizer,
    callbacks: list,
    **lora_lab,
):
    """The task's trainer on a PEFT model; `lora_lab`: LoraLabMixin's keyword arguments."""
    cls = trainer_class(config.train.task)
    kwargs: dict[str, Any] = {}
    if config.train.task in ("dpo", "kto"):
        kwargs["ref_model"] = None  # the frozen copy of the starting adapter (module docstring)
    trainer = cls(
        model=model,
        args=args,
        train_dataset=rows_dataset(train_samples),
        eval_dataset=rows_dataset(val_samples) if val_samples else None,
        processing_class=tokenizer,
        callbacks=callbacks,
        **kwargs,
        **lora_lab,
    )
    if config.train.task in ("dpo", "kto"):
        peft_config = getattr(trainer.model, "peft_config", {})
        reference = (
            "a frozen copy of the --from-run adapter"
            if config.train.from_run
            else "the base model (the new adapter starts at zero)"
        )
        if REFERENCE_ADAPTER not in peft_config:
            raise TrainingError(
                f"TRL did not add the frozen reference adapter for --task "
                f"{config.train.task}; use {TRL_REQUIREMENT} with peft >= 0.20."
            )
        log.info(f"--task {config.train.task}: the reference model is {reference}")
    return trainer
