"""Run configuration: one frozen dataclass per concern (fields.py), the named flags (flags.py),
resolved defaults -> preset -> --config -> flags (resolve.py), checked all at once (checks.py).

Every value remembers where it came from, so that the resolved config can be printed ("lora.rank
= 8  (preset 16gb)") and every problem can name the key the way the user typed it. A resolved
config is what the user asked for and never changes: what a run derives from it is its plan
(training/plan.py).
"""

from .checks import identity_problem
from .fields import (
    DEEPSPEED_ENGINES,
    ENGINES,
    PAIRED_TASKS,
    PLANNED_MODEL,
    REFERENCE_TASKS,
    SECTIONS,
    DataArgs,
    LoraArgs,
    ModelArgs,
    RunConfig,
    flatten,
)
from .flags import FLAG_FOR_KEY, FLAGS, all_keys, field_help
from .resolve import list_presets, resolve_config
from .rules import converts_initial_adapter, engine_of, engine_template, main_host_port, trains_adapter, world_size_of

__all__ = [
    "DEEPSPEED_ENGINES",
    "ENGINES",
    "FLAG_FOR_KEY",
    "FLAGS",
    "PAIRED_TASKS",
    "PLANNED_MODEL",
    "REFERENCE_TASKS",
    "SECTIONS",
    "DataArgs",
    "LoraArgs",
    "ModelArgs",
    "RunConfig",
    "all_keys",
    "converts_initial_adapter",
    "engine_template",
    "field_help",
    "flatten",
    "main_host_port",
    "trains_adapter",
    "world_size_of",
    "engine_of",
    "identity_problem",
    "list_presets",
    "resolve_config",
]
