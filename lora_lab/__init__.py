"""lora-lab: LoRA fine-tuning of Qwen2.5 on one consumer GPU.

The Python API behind the `lora-lab` command. Heavy libraries (torch, transformers, peft) are
imported only when a function that needs them runs.
"""
from .config import RunConfig, list_presets, load_saved_config, resolve_config
from .errors import ConfigError, DataError, LoraLabError, ModelError

__all__ = ["RunConfig", "resolve_config", "load_saved_config", "list_presets", "train",
           "LoraLabError", "ConfigError", "DataError", "ModelError"]
__version__ = "0.1.0"


def train(config, echo=print):
    """Fine-tune (LoRA or full); with config.train.gpus > 1 or an engine, through accelerate
    launch (lora_lab.launch). See lora_lab.train.train."""
    from .launch import launch_run, needs_launch
    from .train import train as _train

    return launch_run(config, echo) if needs_launch(config) else _train(config, echo=echo)
