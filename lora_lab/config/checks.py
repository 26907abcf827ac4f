"""The checks of a resolved config: every problem found, each with the key it is about and its fix
(resolve_config names the flag or file line the key came from and raises them together)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

from ..paths import identity_datasets
from ..registry import model_config_of
from .fields import LORA_INITS, REPORT_BACKENDS, SECTIONS, RunConfig
from .grpo import grpo_problems
from .rules import converts_initial_adapter, engine_of, main_host_port, trains_adapter, world_size_of


def tuner_problems(config: RunConfig) -> list[tuple[str, str]]:
    """The tuner options that do not go together, each with its fix."""
    lora, train, tuner = config.lora, config.train, config.train.tuner
    problems = []
    if lora.init not in LORA_INITS and not re.fullmatch(r"pissa_niter_[1-9][0-9]*", lora.init):
        problems.append(
            (
                "lora.init",
                f"must be one of {', '.join(LORA_INITS)} or "
                f"pissa_niter_N (N iterations of randomised SVD, e.g. "
                f"pissa_niter_4); got {lora.init!r}.",
            )
        )
    if tuner == "ia3" and config.model.quantization != "none":
        problems.append(
            (
                "train.tuner",
                "IA3 trains on a 16-bit base only (it trains about "
                "0.02% of the weights: the base is the memory). "
                "Drop --quantization nf4, or use --tuner lora "
                "--quantization nf4 (QLoRA).",
            )
        )
    if tuner == "ia3" and lora.trainable_tokens is True:
        problems.append(
            (
                "lora.trainable_tokens",
                "true trains token rows beside a LoRA or "
                "DoRA adapter; peft's IA3 has none. Use "
                "--tuner lora, or lora.trainable_tokens "
                "auto.",
            )
        )
    if tuner in ("dora", "ia3") and config.model.fast_lora is True:
        problems.append(
            (
                "model.fast_lora",
                f"true computes plain LoRA layers; --tuner {tuner} "
                f"needs peft's forward. Use --set "
                f"model.fast_lora=auto (or false).",
            )
        )
    for key, on in (
        ("lora.use_rslora", lora.use_rslora),
        ("lora.init", lora.init != "default"),
        ("train.loraplus_lr_ratio", train.loraplus_lr_ratio > 0),
    ):
        if on and tuner in ("ia3", "full"):
            problems.append(
                (
                    key,
                    f"applies to --tuner lora and dora (LoRA's A and B "
                    f"matrices); --tuner {tuner} has none. Drop it, or use "
                    f"--tuner lora.",
                )
            )
    if converts_initial_adapter(lora) and tuner in ("lora", "dora"):
        problems += _converted_init_problems(config)
    return problems


def _converted_init_problems(config: RunConfig) -> list[tuple[str, str]]:
    """lora.init pissa / olora: the adapter starts from the base weight's decomposition."""
    lora, train, tuner = config.lora, config.train, config.train.tuner
    problems = []
    if tuner == "dora":
        problems.append(
            (
                "lora.init",
                f"{lora.init} starts plain LoRA from the base "
                f"weight's decomposition; peft converts no DoRA "
                f"adapter back to the original base. Use --tuner lora, "
                f"or lora.init default or gaussian with dora.",
            )
        )
    if config.model.quantization != "none":
        problems.append(
            (
                "lora.init",
                f"{lora.init} rewrites the base weights as the "
                f"residual of their decomposition, which 4-bit "
                f"weights cannot hold exactly. Drop --quantization "
                f"nf4, or use lora.init default (QLoRA).",
            )
        )
    if train.engine.startswith("deepspeed-zero3"):
        problems.append(
            (
                "lora.init",
                f"{lora.init} decomposes each whole base weight when "
                f"the adapter is made; {train.engine} has split them "
                f"over the GPUs by then. Use --engine "
                f"deepspeed-zero2, fsdp or ddp.",
            )
        )
    return problems


def _expert_lora_problems(config: RunConfig) -> list[tuple[str, str]]:
    """lora.experts (peft target_parameters on the fused experts, 16-bit or 4-bit) against the
    tuner and the dropout."""
    lora, tuner = config.lora, config.train.tuner
    problems = []
    if lora.experts and tuner != "lora":
        problems.append(
            (
                "lora.experts",
                f"LoRA on the fused experts is peft's target_parameters, which --tuner {tuner} does not have: "
                "pass --tuner lora, or drop lora.experts.",
            )
        )
    if lora.experts and lora.dropout:
        problems.append(
            ("lora.experts", "peft's LoRA on parameters takes no dropout: pass --lora-dropout 0 with lora.experts.")
        )
    return problems


def identity_problem(specs: list, model_name: str | None, model_author: str | None) -> str | None:
    """Why `specs` cannot be trained on as given: a bundled identity set (self-cognition) with
    --model-name or --model-author missing. Said before anything is loaded or printed."""
    missing = [flag for flag, value in (("--model-name", model_name), ("--model-author", model_author)) if not value]
    if not identity_datasets(specs) or not missing:
        return None
    return (
        f"the bundled self-cognition rows say {{{{NAME}}}} and {{{{AUTHOR}}}} where the "
        f"model's new name and its author go; pass --model-name and --model-author, e.g. "
        f"--model-name Aurora --model-author 'Lab X' ({' and '.join(missing)} not given)."
    )


def config_problems(config: RunConfig, need_data: bool = True, training: bool = True) -> list[tuple[str, str]]:
    """Every problem of a resolved config, as (key, message): the fields' own bounds, then the
    data, full fine-tuning, tuner, memory-means, step, tracker, task and node rules."""
    problems = []
    identity = identity_problem(
        config.data.datasets + config.data.val_data, config.data.model_name, config.data.model_author
    )
    if training and identity:
        problems.append(("data.datasets", identity))
    problems += _field_problems(config)
    problems += _data_problems(config, need_data)
    problems += _full_finetuning_problems(config)
    problems += tuner_problems(config)
    problems += _expert_lora_problems(config)
    problems += _memory_means_problems(config)
    if config.train.max_steps == 0 or config.train.max_steps < -1:
        problems.append(("train.max_steps", "must be -1 (use epochs) or at least 1."))
    problem = report_to_problem(config.train.report_to, check_installed=training)
    if problem:
        problems.append(("train.report_to", problem))
    if config.train.eval_tasks and config.train.tuner == "full":
        problems.append(
            (
                "train.eval_tasks",
                "scores the base and the fine-tune by turning the adapter off and on; a full fine-tuning run has "
                "none: score its model/ with lm-eval, or train an adapter.",
            )
        )
    problems += _task_problems(config.train, config.data)
    problems += grpo_problems(config.grpo, config.train)
    problems += _node_problems(config.train, launching=need_data and training)
    return problems


def _field_problems(config: RunConfig) -> list[tuple[str, str]]:
    """Each field against its own choices and bounds (the dataclasses' metadata)."""
    problems = []
    for section, cls in SECTIONS.items():
        for spec in dataclasses.fields(cls):
            key, value = f"{section}.{spec.name}", getattr(getattr(config, section), spec.name)
            choices, minimum = spec.metadata["choices"], spec.metadata["minimum"]
            if choices and value not in choices:
                problems.append((key, f"must be one of {', '.join(choices)}; got {value!r}."))
            if minimum is not None and isinstance(value, (int, float)) and value < minimum:
                problems.append((key, f"must be at least {minimum}; got {value!r}."))
            maximum = spec.metadata["maximum"]
            if maximum is not None and value is not None and value > maximum:
                problems.append((key, f"must be at most {maximum:,}; got {value:,}."))
    if not 0 <= config.lora.dropout < 1:
        problems.append(
            (
                "lora.dropout",
                f"must be at least 0 and below 1 (a share of the LoRA input zeroed); got {config.lora.dropout}.",
            )
        )
    name = config.train.run_name
    if name is not None and (name in ("", ".", "..") or "/" in name or "\\" in name):
        problems.append(("train.run_name", f"must be one folder name inside --output-dir (no / or ..); got {name!r}."))
    return problems


def _data_problems(config: RunConfig, need_data: bool) -> list[tuple[str, str]]:
    problems = []
    if config.data.val_ratio >= 1:
        problems.append(("data.val_ratio", f"must be below 1; got {config.data.val_ratio}."))
    if config.data.val_ratio and config.data.val_data:
        problems.append(("data.val_ratio", "give either --val-ratio or --val-data, not both."))
    if need_data and not config.data.datasets:
        problems.append(
            ("data.datasets", "no training data. Pass --data FILE (or --data self-cognition for the bundled set).")
        )
    return problems


def _full_finetuning_problems(config: RunConfig) -> list[tuple[str, str]]:
    problems = []
    if config.train.tuner == "full" and config.model.quantization != "none":
        problems.append(
            (
                "train.tuner",
                "full fine-tuning trains 16-bit weights; 4-bit weights "
                "cannot be trained. Drop --quantization nf4 (QLoRA is "
                "--tuner lora --quantization nf4).",
            )
        )
    if config.train.tuner == "full" and config.model.dtype == "fp16":
        problems.append(
            (
                "train.tuner",
                "full fine-tuning in fp16 is refused: Qwen2.5's "
                "activations overflow fp16 and whole-model updates "
                "diverge. Use --dtype bf16 (a GPU with bf16) or fp32.",
            )
        )
    return problems


def _memory_means_problems(config: RunConfig) -> list[tuple[str, str]]:
    """The memory means that serve LoRA in one process with gradient checkpointing."""
    problems = []
    single = engine_of(config.train) == "ddp" and world_size_of(config.train) == 1 and trains_adapter(config.train)
    for key, value in (
        ("model.embedding_on_cpu", config.model.embedding_on_cpu),
        ("train.offload_checkpoints", config.train.offload_checkpoints),
    ):
        if value is True and not (single and config.train.gradient_checkpointing):
            problems.append(
                (
                    key,
                    "true serves LoRA in one process with gradient checkpointing "
                    "(DDP and DeepSpeed do not see its recomputed gradients). "
                    "Use auto or false here.",
                )
            )
    kept = config.train.uncheckpointed_layers
    if kept not in (0, "auto") and not (single and config.train.gradient_checkpointing):
        problems.append(
            (
                "train.uncheckpointed_layers",
                "serves LoRA in one process with gradient checkpointing on. Set it to 0 here.",
            )
        )
    layers = (model_config_of(config.model.name) or {}).get("num_hidden_layers")
    if isinstance(kept, int) and layers and kept > layers:
        problems.append(
            ("train.uncheckpointed_layers", f"the model has {layers} decoder layers: use at most {layers}, or auto.")
        )
    return problems


def _node_problems(train, launching: bool = True) -> list[tuple[str, str]]:
    """--nodes N: a node rank among them; to launch, node 0's address and one run folder name
    for all (a plan needs neither)."""
    if train.node_rank >= train.nodes:
        ranks = {1: "0", 2: "0 and 1"}.get(train.nodes, f"0 to {train.nodes - 1}")
        return [
            (
                "train.node_rank",
                f"out of range: with --nodes {train.nodes} the node ranks are {ranks}; got {train.node_rank}.",
            )
        ]
    if train.nodes == 1:
        return []
    problems = []
    if not train.main_address:
        if launching:
            problems.append(
                (
                    "train.main_address",
                    f"--nodes {train.nodes} needs node 0's "
                    f"address: --main-address HOST[:PORT], the "
                    f"same on every node.",
                )
            )
    elif (
        not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+)(:\d{1,5})?", train.main_address)
        or not 0 < main_host_port(train)[1] < 65536
    ):
        problems.append(
            (
                "train.main_address",
                f"expected HOST or HOST:PORT (e.g. 10.0.0.1:29500 or node01); got {train.main_address!r}.",
            )
        )
    if not train.run_name and not train.resume and launching:
        problems.append(
            (
                "train.run_name",
                f"--nodes {train.nodes}: pass --run-name NAME, the "
                f"same on every node, so that all of them train into "
                f"one run folder.",
            )
        )
    return problems


def _task_problems(train, data) -> list[tuple[str, str]]:
    """Preference tasks train a LoRA adapter on unpacked pairs; --from-run is theirs alone."""
    if train.task == "sft":
        return (
            [
                (
                    "train.from_run",
                    "continues an SFT run with a preference task or GRPO; pass --task dpo (or orpo, simpo, kto, "
                    "grpo) with it.",
                )
            ]
            if train.from_run
            else []
        )
    problems = []
    if train.tuner != "lora" and not (train.task == "grpo" and train.tuner == "dora"):
        problems.append(("train.task", f"{train.task} trains a LoRA adapter; drop --tuner {train.tuner}."))
    if data.packing:
        problems.append(
            (
                "data.packing",
                f"--task {train.task} trains on prompt + answer sequences, not packed rows; drop data.packing.",
            )
        )
    if train.gpus > 1:
        problems.append(("train.gpus", f"--task {train.task} trains in one process; use --gpus 1."))
    if train.task == "kto" and train.micro_batch_size < 2:
        problems.append(
            (
                "train.micro_batch_size",
                "--task kto estimates its KL term from the "
                "other answers of a micro-batch; use "
                "--micro-batch-size 2 or more.",
            )
        )
    return problems


def report_to_problem(names: list, check_installed: bool = True) -> str | None:
    """Why train.report_to cannot be used: an unknown name, none mixed with a backend, or a
    backend whose package is not installed (said before anything is loaded)."""
    valid = ", ".join([*REPORT_BACKENDS, "none"])
    unknown = [n for n in names if n not in REPORT_BACKENDS and n != "none"]
    if unknown:
        return f"unknown backend {', '.join(map(repr, unknown))}; the valid ones are {valid}."
    if "none" in names and len(names) > 1:
        return f"none turns every backend off; give it alone or not at all (got {','.join(names)})."
    missing = (
        [REPORT_BACKENDS[n] for n in names if n != "none" and importlib.util.find_spec(REPORT_BACKENDS[n]) is None]
        if check_installed
        else []
    )
    if missing:
        return (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed. "
            f"Run: pip install {' '.join(missing)} (or pip install 'lora-lab[trackers]' "
            f"for every backend), or leave {' and '.join(missing)} out of --report-to."
        )
    return None
