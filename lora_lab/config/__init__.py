"""Run configuration: one dataclass per concern (fields.py), resolved defaults -> preset ->
--config -> flags (resolve.py).

Every value remembers where it came from, so that the resolved config can be printed ("lora.rank
= 8  (preset 16gb)") and every problem can name the key the way the user typed it.
"""
from .fields import (ADAPTER_TUNERS, DEEPSPEED_ENGINES, ENGINES, FLAG_FOR_KEY, FLAGS,
                     FULL_FINETUNING_LR, LORA_INITS, MAX_LORA_RANK, MAX_SEQUENCE_TOKENS,
                     PAIRED_TASKS, PREFERENCE_TASKS, REFERENCE_TASKS, REPORT_BACKENDS, SECTIONS,
                     TUNERS, DataArgs, LoraArgs, ModelArgs, RunConfig, TrainArgs, all_keys,
                     converts_initial_adapter, engine_template, field_help, flatten,
                     resolve_fast_lora, syncs_each_micro_batch, trains_adapter, DEFAULT_MAIN_PORT, main_host_port,
                     world_size_of)
from .resolve import AUTO_OR_BOOL, identity_problem, list_presets, load_preset, resolve_config

__all__ = ["ADAPTER_TUNERS", "DEEPSPEED_ENGINES", "ENGINES", "FLAG_FOR_KEY", "FLAGS",
           "FULL_FINETUNING_LR", "LORA_INITS", "MAX_LORA_RANK", "MAX_SEQUENCE_TOKENS",
           "PAIRED_TASKS", "PREFERENCE_TASKS", "REFERENCE_TASKS", "REPORT_BACKENDS", "SECTIONS",
           "TUNERS", "DataArgs", "LoraArgs", "ModelArgs", "RunConfig", "TrainArgs", "all_keys",
           "converts_initial_adapter", "engine_template", "field_help", "flatten",
           "resolve_fast_lora", "syncs_each_micro_batch", "trains_adapter", "DEFAULT_MAIN_PORT", "main_host_port",
           "world_size_of", "AUTO_OR_BOOL", "identity_problem",
           "list_presets", "load_preset", "resolve_config"]
