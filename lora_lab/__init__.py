"""lora-lab: LoRA fine-tuning of Qwen2.5 on one consumer GPU.

The Python API behind the `lora-lab` command: each command is a thin layer over one function
here. Heavy libraries (torch, transformers, peft) are imported only when a function that needs
them runs.
"""

from .config import RunConfig, list_presets, resolve_config
from .errors import ConfigError, DataError, LoraLabError, ModelError
from .run_folder import load_saved_config

__all__ = [
    "RunConfig",
    "resolve_config",
    "load_saved_config",
    "list_presets",
    "train",
    "plan",
    "choose_preset",
    "check_data",
    "merge_adapter",
    "export_model",
    "export_quantized",
    "export_gguf",
    "evaluate_run",
    "benchmark_run",
    "report_run",
    "LoraLabError",
    "ConfigError",
    "DataError",
    "ModelError",
]
__version__ = "0.1.0"


def train(config: RunConfig):
    """Fine-tune (LoRA or full) and return the run's TrainResult; with config.train.gpus > 1 or
    an engine other than ddp, as several processes through accelerate launch. With
    config.train.eval_tasks, lm-eval scores the base and the fine-tune once training ends."""
    from .training.launch import launch_run, needs_launch
    from .training.run import train as train_here
    from .use.benchmarks import BenchmarkSettings, benchmark_run, check_tasks

    tasks = config.train.eval_tasks
    settings = None
    if tasks:  # lm-eval and the task names, before anything trains
        settings = BenchmarkSettings(
            tuple(tasks), config.train.eval_tasks_path, flags=("--eval-tasks", "train.eval_tasks_path")
        )
        check_tasks(settings)
    result = launch_run(config) if needs_launch(config) else train_here(config)
    if settings is not None:  # the base and the fine-tune on the benchmarks, once training ended
        result.benchmark = benchmark_run(result.run_dir, settings)
    return result


def plan(
    config: RunConfig,
    gpu_memory_gib: float | None = None,
    longest_sample_tokens: int | None = None,
    cpu_memory_gib: float | None = None,
):
    """The memory plan of `config` (planning.memory.MemoryPlan) on a GPU of gpu_memory_gib;
    without it, on the card of the config's tier (the 16gb preset: 16 GiB). With
    cpu_memory_gib (a machine's RAM), its host memory is planned against that too. `config` is
    left as it is.

    The plan counts what a run would settle (training/plan.py: the same `plan_run`), on a CUDA
    GPU wherever it is made: train.engine auto with several GPUs is the fastest engine that
    fits, data.packed_attention auto as the installed PyTorch runs it on CUDA."""
    from .planning.memory import plan_memory
    from .training.plan import plan_run, plan_target

    settled = plan_run(config, plan_target(config.preset, gpu_memory_gib), for_run=False)
    try:
        return plan_memory(
            settled.planner_config, gpu_memory_gib or settled.gpu_gib, longest_sample_tokens, cpu_memory_gib
        )
    except ValueError:
        raise LoraLabError(
            f"--model {config.model.name}: the planner needs the model's "
            f"config.json. Pass a local model folder, or a model it ships the "
            f"config of (docs/families.md: qwen2.5-7b, qwen3-8b, llama-3.1-8b, "
            f"gemma-3-4b, phi-4-mini, mistral-7b ...)."
        ) from None


def choose_preset(preset: str, gpu_memory_gib: float | None = None) -> str:
    """--preset auto: the largest tier that fits this GPU (cpu without one); else `preset`."""
    if preset != "auto":
        return preset
    from .device import gpu_memory_gib as this_gpu
    from .log import get_logger
    from .planning.choice import pick_preset

    gpu_memory_gib = gpu_memory_gib or this_gpu()
    if gpu_memory_gib is None:
        get_logger().info("--preset auto: no CUDA GPU here, using the cpu preset")
        return "cpu"
    name, why = pick_preset(gpu_memory_gib)
    get_logger().info(f"--preset auto: {name} ({why})")
    return name


def check_data(*args, **kwargs):
    """Datasets checked row by row as a run reads them (use.data_check.check_data)."""
    from .use.data_check import check_data as check

    return check(*args, **kwargs)


def merge_adapter(*args, **kwargs):
    """Merge a run's adapter into its base (use.merge.merge_adapter)."""
    from .use.merge import merge_adapter as merge

    return merge(*args, **kwargs)


def export_model(*args, **kwargs):
    """Export a merged folder or a run in --format safetensors or gguf (use.export_common)."""
    from .use.export_common import export_model as export

    return export(*args, **kwargs)


def export_quantized(*args, **kwargs):
    """Quantize a merged folder or a run for serving (use.export.export_quantized)."""
    from .use.export import export_quantized as export

    return export(*args, **kwargs)


def export_gguf(*args, **kwargs):
    """A merged folder or a run as a GGUF with an Ollama Modelfile (use.gguf_export)."""
    from .use.gguf_export import export_gguf as export

    return export(*args, **kwargs)


def benchmark_run(*args, **kwargs):
    """Benchmark scores of a run's base and fine-tune through lm-eval (use.benchmarks.benchmark_run)."""
    from .use.benchmarks import benchmark_run as run

    return run(*args, **kwargs)


def evaluate_run(*args, **kwargs):
    """Loss and answers of a run on held-out data (use.evaluate.evaluate_run)."""
    from .use.evaluate import evaluate_run as evaluate

    return evaluate(*args, **kwargs)


def report_run(run_dir):
    """PNG plots of a run's step log in RUN/plots/ (training.plots.report_run)."""
    from .training.plots import report_run as report

    return report(run_dir)
