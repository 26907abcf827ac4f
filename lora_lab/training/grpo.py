"""--task grpo: TRL's GRPOTrainer with LoraLabMixin in front (crash-safe checkpoints, the
non-finite guard, the progress line), on the prompts data/prompts.py read and the rewards of
data/rewards.py (docs/grpo.md).

Each optimizer step samples grpo.num_generations completions for each of
train.micro_batch_size x train.grad_accum / num_generations prompts, in one generation batch
(transformers' generate on the trained model), scores them, and takes the advantage of each
completion within its prompt's group. grpo.loss picks TRL's settings (LOSS_SETTINGS).

The reference: with train.pref_beta 0 (grpo's default) there is none, and no reference pass.
Above 0, TRL adds a frozen copy of the starting adapter ("ref") and computes the reference with
it: the base model for a new adapter (LoRA's B starts at zero), the SFT policy with --from-run.
The base weights are never copied.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ..config import RunConfig
from ..config.grpo import reward_weights_of
from ..data.prompts import prompt_template_kwargs
from ..data.rewards import build_rewards
from ..log import get_logger
from ..models.memory_means import checkpointing_paused
from .preference import REFERENCE_ADAPTER, TrainedAdapterOnly, require_trl, rows_dataset
from .sampling import PartedGeneration, sampling_key
from .trainer import LoraLabMixin

log = get_logger()

LOSS_SETTINGS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},  # the Dr. GRPO paper
    # the DAPO paper's clip-higher; its overlong shaping is the length reward (a completion cut
    # at max_completion_length still trains, as TRL's default keeps it)
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
    "bnpo": {"loss_type": "bnpo"},
    # the GSPO paper's clipping range, as TRL's GSPO recipe sets it
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
}
"""grpo.loss -> the GRPOConfig fields it sets."""


@functools.cache
def grpo_trainer_class():
    """TRL's GRPOTrainer with lora-lab's mixin; built once."""
    require_trl()
    from trl import GRPOTrainer

    class LoraLabGRPOTrainer(LoraLabMixin, TrainedAdapterOnly, GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            """Sampling with the layers' checkpointing paused, lora-lab's checkpoint functions
            and uncheckpointed layers kept (models/memory_means.checkpointing_paused), through
            training/sampling.py: each completion drawn with its own noise, keyed on the run's
            seed, the step and the sampling's place in it; in parts of the generation batch
            after an out-of-memory error."""
            model = self.accelerator.unwrap_model(self.model)
            calls = self.__dict__.setdefault("sampling_calls", {})
            place = (self.state.global_step, model.training)
            calls[place] = calls.get(place, -1) + 1
            key = sampling_key(self.args.seed, *place, calls[place])
            parted = self.__dict__.setdefault("parted_generation", PartedGeneration())
            own = model.generate
            model.generate = functools.partial(parted.generate, own, key)
            try:
                with checkpointing_paused(model):
                    return super()._generate_single_turn(*args, **kwargs)
            finally:
                del model.generate

        def log(self, logs: dict, start_time: float | None = None) -> None:
            """A metric without a value since the last event (TRL would log None, which the
            trackers refuse with a warning each time) is left out of it."""
            for metrics in self._metrics.values():
                for key in [k for k, v in metrics.items() if v and all(math.isnan(x) for x in v)]:
                    del metrics[key]
            super().log(logs, start_time)

    return LoraLabGRPOTrainer


def grpo_config_class():
    require_trl()
    from trl import GRPOConfig

    return GRPOConfig


def grpo_settings(config: RunConfig, tokenizer) -> dict:
    """The GRPOConfig fields lora-lab sets. Gradient checkpointing stays lora-lab's
    (models/lora.py), as for the preference tasks."""
    grpo = config.grpo
    return {
        "gradient_checkpointing": False,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "beta": config.train.pref_beta,
        "num_generations": grpo.num_generations,
        "max_completion_length": grpo.max_completion_length,
        "temperature": grpo.temperature,
        "reward_weights": reward_weights_of(grpo),
        "chat_template_kwargs": prompt_template_kwargs(tokenizer, config.data.enable_thinking),
        "log_completions": False,
        "cache_implementation": "static" if grpo.static_cache else None,
        **LOSS_SETTINGS[grpo.loss],
    }


def build_grpo_trainer(
    config: RunConfig, model, args, train_samples: list, val_samples: list | None, tokenizer, callbacks: list, **parts
):
    """The GRPO trainer on a PEFT model; `parts`: LoraLabMixin's keyword arguments."""
    rewards = build_rewards(config.grpo.rewards, config.grpo.max_completion_length)
    trainer = grpo_trainer_class()(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=rows_dataset(train_samples),
        eval_dataset=rows_dataset(val_samples) if val_samples else None,
        processing_class=tokenizer,
        callbacks=callbacks,
        **parts,
    )
    # TRL turns transformers' compiled decoding off; a static cache is what it compiles for
    trainer.generation_config.disable_compile = not config.grpo.static_cache
    weights = reward_weights_of(config.grpo)
    log.info(
        f"--task grpo: loss {config.grpo.loss}, {config.grpo.num_generations} completions a prompt of at most "
        f"{config.grpo.max_completion_length} tokens; rewards "
        + ", ".join(f"{r.__name__} x{float(w):g}" for r, w in zip(rewards, weights))
        + "; reference: "
        + _reference(config, REFERENCE_ADAPTER in getattr(trainer.model, "peft_config", {}))
    )
    return trainer


def _reference(config: RunConfig, has_copy: bool) -> str:
    if config.train.pref_beta == 0:
        return "none (beta 0)"
    start = "the --from-run adapter" if config.train.from_run else "the new adapter (the base model)"
    return f"a frozen copy of {start}, KL weight {config.train.pref_beta:g}" if has_copy else "the base model"
