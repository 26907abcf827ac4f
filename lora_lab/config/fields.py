"""The run configuration's dataclasses, one per concern, with a help text under every field, and
the named flags of `lora-lab run`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .grpo import GrpoArgs
from .lora_args import MAX_LORA_RANK, LoraArgs  # noqa: F401  (MAX_LORA_RANK: re-exported)
from .spec import spec_field as _f

ENGINES = ("ddp", "deepspeed-zero2", "deepspeed-zero2-offload", "deepspeed-zero3", "deepspeed-zero3-offload", "fsdp")
"""train.engine values; each but ddp has its config file in presets/engines/."""
DEEPSPEED_ENGINES = ("deepspeed-zero2", "deepspeed-zero2-offload", "deepspeed-zero3", "deepspeed-zero3-offload")


REPORT_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
"""train.report_to names -> the package that provides each (what `pip install` takes)."""


MAX_SEQUENCE_TOKENS = 1_048_576
"""The longest row (sample or packed row) accepted, far past any supported model's context."""


@dataclass(frozen=True)
class ModelArgs:
    name: str = _f("qwen2.5-0.5b", "Hub id, alias (qwen2.5-7b, qwen2.5-7b-base), folder or .gguf.")
    dtype: str = _f(
        "auto",
        "auto: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU.",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    quantization: str = _f("none", "none, or nf4 for 4-bit QLoRA (bitsandbytes).", choices=("none", "nf4"))
    trust_remote_code: bool = _f(False, "Run Python code shipped with the model. Off by default.")
    attn_implementation: str = _f(
        "sdpa",
        "Attention kernel: sdpa, eager, flex_attention or flash_attention_2 (a family sdpa cannot run, "
        "gpt-oss, takes flex_attention on a GPU and eager on the CPU).",
        choices=("sdpa", "eager", "flex_attention", "flash_attention_2"),
    )
    router_aux_loss_coef: float = _f(
        0.0,
        "Mixture of experts: the weight of the routers' load-balancing loss (aux_loss, logged) in the loss.",
        minimum=0,
    )
    kernels: str = _f(
        "auto",
        "Fused Triton kernels: liger (fused linear cross-entropy, RoPE, "
        "RMSNorm, SwiGLU; needs a CUDA GPU and liger-kernel), none, or auto "
        "(liger when both are there).",
        choices=("auto", "liger", "none"),
    )
    embedding_on_cpu: str | bool = _f(
        "auto",
        "Keep the input embedding table in CPU memory (1.02 GiB of Qwen2.5-7B). auto: on "
        "for LoRA on one GPU when the model has its own output head (7B); never for tied "
        "embeddings (0.5B-3B). true / false force it.",
        choices=("auto", True, False),
    )
    fast_lora: str | bool = _f(
        "auto",
        "Compute LoRA layers with lora-lab's fused autograd functions "
        "(models/fast_lora/: the LoRA branch in 16 bits, one function per SwiGLU MLP "
        "and one per attention's q, k and v) instead of peft's forward. auto: on for "
        "LoRA without adapter dropout, in one process or under ddp; true / false force "
        "it (with dropout the layers fall back to peft, which applies it).",
        choices=("auto", True, False),
    )
    fast_lora_chunk_tokens: int = _f(
        0,
        "The fast LoRA MLP runs on at most this many tokens at a time where no gradient is "
        "taken (a checkpointed layer's first pass) and in its backward pass (a checkpointed "
        "layer's MLP is recomputed there a chunk at a time), so its [tokens x intermediate] "
        "temporaries are a chunk's; 0: all tokens at once.",
        minimum=0,
    )
    fast_lora_down_backward_tokens: int = _f(
        2048,
        "Without fast_lora_chunk_tokens, the fast LoRA MLP's backward pass through down and "
        "SwiGLU (from the saved gate and up) runs on at most this many tokens at a time, so its "
        "[tokens x intermediate] temporaries are a chunk's; 0: all tokens at once.",
        minimum=0,
    )
    fast_lora_residual_skip: bool = _f(
        True,
        "Where a checkpointed decoder layer is recomputed for its backward pass and its MLP "
        "output only enters the residual sum (Qwen2/3, Llama, Mistral layers), the fast LoRA "
        "MLP stops after gate and up there. false: the recomputation runs the MLP to its output.",
    )
    fast_lora_shared_input: bool = _f(
        True,
        "The fast LoRA path computes an attention's q, k and v projections in one call (one "
        "product with their stacked A); false: one call each.",
    )
    fast_lora_cast_cache: bool = _f(
        True,
        "The fast LoRA path casts each call site's adapter weights to 16 bits once while they "
        "stay unchanged (forward, recomputation and every micro-batch of a step share it); "
        "false: cast at every call.",
    )
    native_rms_norm: bool = _f(
        True,
        "With model.kernels liger, RMSNorm layers that compute what torch.rms_norm computes "
        "(Qwen2/3, Llama, Mistral, Phi-3) run through PyTorch's fused kernel; false: "
        "through liger's Triton kernel.",
    )
    liger_experts: str | bool = _f(
        "auto",
        "With model.kernels liger, where liger has a fused MoE kernel for the family (Qwen3-MoE, "
        "Qwen3.5-MoE). true: the experts run through it; its backward also computes the weight "
        "gradient of frozen experts, and lora.experts adds its delta to the experts' tensors. "
        "false: through transformers' own experts (torch's grouped matrix products), with "
        "lora.experts in low rank on those products. auto: false with lora.experts, else true.",
        choices=("auto", True, False),
    )
    cudnn_attention: str | bool = _f(
        "auto",
        "sdpa's cuDNN attention kernel. auto: for packed rows whose samples all have "
        "one length (data.packed_attention=varlen), as one batch, for at most 8 shapes a "
        "process: cuDNN builds a plan (up to seconds) for every new shape, and rows of "
        "short samples of varying length bring a new one at almost every step. true: "
        "also wherever sdpa picks it, and an unpacked row of one sample of 16,384 tokens or "
        "more on cuDNN's grouped-query kernel (no repeated keys and values); false: never "
        "(docs/benchmarks.md has the measurements).",
        choices=("auto", True, False),
    )


@dataclass(frozen=True)
class DataArgs:
    datasets: list = _f(
        [],
        "Training data: files (.jsonl .json .csv .parquet), hub dataset ids "
        "or 'self-cognition'; PATH#N samples N rows.",
    )
    val_data: list = _f([], "Validation data (same forms as --data).")
    val_ratio: float = _f(0.0, "Fraction of the training rows held out for validation.", minimum=0)
    format: str = _f(
        "auto",
        "Row format; auto detects it per dataset.",
        choices=("auto", "messages", "sharegpt", "swift-sharegpt", "alpaca", "query-response", "text"),
    )
    max_length: int = _f(2048, "Longest encoded sample in tokens.", minimum=8, maximum=MAX_SEQUENCE_TOKENS)
    packing: bool = _f(
        False,
        "Pack the samples of each optimizer step into as few rows as "
        "pack_length allows (no padding; each sample keeps its own "
        "positions and attends only to itself). Same samples per step.",
    )
    packed_attention: str = _f(
        "auto",
        "How a packed row's samples are kept apart: mask (one sdpa call with a block-diagonal mask), "
        "segments (one causal sdpa call per sample), varlen (one flash-attention call over the row from "
        "the samples' lengths; CUDA, PyTorch >= 2.10) or auto: varlen where it runs, else mask "
        "(docs/training.md, Packing). Another attention than sdpa reads masks built from the restarting "
        "position ids.",
        choices=("auto", "mask", "segments", "varlen"),
    )
    pack_length: int = _f(
        0,
        "Tokens per packed row; 0 = max_length x micro_batch_size (the same tokens per pass as without packing).",
        minimum=0,
        maximum=MAX_SEQUENCE_TOKENS,
    )
    truncation: str = _f(
        "truncate", "Samples over max_length: truncate (cut the end) or drop.", choices=("truncate", "drop")
    )
    system: str = _f(None, "System prompt for conversations that have none (default: the chat template's own).")
    enable_thinking: str | bool = _f(
        "auto",
        "Thinking mode for chat templates that take "
        "enable_thinking (Qwen3): auto (thinking for rows "
        "with reasoning), true, or false (non-thinking, "
        "reasoning dropped). A row's own `enable_thinking` "
        "field wins. The empty think block never carries "
        "loss.",
        choices=("auto", True, False),
    )
    model_name: str = _f(None, "Fills {{NAME}} (or {{name}}) placeholders in the data.")
    model_author: str = _f(None, "Fills {{AUTHOR}} (or {{author}}) placeholders in the data.")
    cache: bool = _f(
        True,
        "Keep the encoded data under ~/.cache/lora-lab/data (Arrow, "
        "memory-mapped) and reuse it while the files, tokenizer, template and "
        "data settings are unchanged; false encodes every time.",
    )
    num_proc: int = _f(
        0,
        "Worker processes that parse, normalise and encode the data, a chunk "
        "of rows at a time; 0 = the machine's cores (at most 8; a dataset of "
        "one chunk stays in the main process); 1 encodes in the main process.",
        minimum=0,
    )


TUNERS = ("lora", "dora", "ia3", "full")
ADAPTER_TUNERS = ("lora", "dora", "ia3")
"""train.tuner values that train an adapter (adapter/) on a frozen base."""
LORA_INITS = ("default", "gaussian", "pissa", "olora")
"""lora.init values besides pissa_niter_N."""

PLANNED_MODEL = "qwen2.5-7b"
"""The model `lora-lab plan` and the page's plan count without --model."""
FULL_FINETUNING_LR = 1e-5
"""train.lr for --tuner full unless given: LoRA learning rates would wreck the base weights."""


PREFERENCE_TASKS = ("dpo", "orpo", "simpo", "kto")
"""train.task values that train on preference data (docs/preference.md)."""
PAIRED_TASKS = ("dpo", "orpo", "simpo")
"""Preference tasks whose every sample is a chosen and a rejected answer, run in one batch."""
REFERENCE_TASKS = ("dpo", "kto")
"""Preference tasks with a reference model: a forward pass without gradients per micro-batch."""


@dataclass(frozen=True)
class TrainArgs:
    task: str = _f(
        "sft",
        "What the run learns: sft (supervised: the assistant replies), a preference task on "
        "chosen / rejected answers through TRL (pip install 'lora-lab[preference]'): dpo, orpo, "
        "simpo, or kto (answers labelled good or bad, unpaired; docs/preference.md), or grpo "
        "(completions sampled for prompts and scored by rewards, TRL's GRPOTrainer; docs/grpo.md).",
        choices=("sft",) + PREFERENCE_TASKS + ("grpo",),
    )
    from_run: str = _f(
        None,
        "Preference tasks and grpo: start from this SFT run's adapter (a run folder) and keep "
        "training it; the reference model is that SFT policy, frozen (dpo, kto, grpo with --beta). "
        "Without it a new adapter starts on the base model, which is then the reference.",
    )
    pref_beta: float = _f(
        0.1,
        "Preference tasks and grpo: beta, how far the policy may move from the reference (dpo, "
        "kto; grpo's KL weight, 0 unless given: no reference pass), the reward scale (simpo) or "
        "the weight of the odds-ratio term (orpo, the paper's lambda).",
        minimum=0,
    )
    dpo_loss: str = _f(
        "sigmoid",
        "--task dpo: the loss on the reward margin: sigmoid (the DPO paper's), ipo, hinge or robust (TRL loss_type).",
        choices=("sigmoid", "ipo", "hinge", "robust"),
    )
    simpo_gamma: float = _f(0.5, "--task simpo: the target reward margin gamma.", minimum=0)
    tuner: str = _f(
        "lora",
        "What trains: lora (adapters on a frozen base; QLoRA is lora with "
        "--quantization nf4), dora (LoRA with a trained magnitude per output "
        "channel, peft use_dora: closer to full fine-tuning, slower, not "
        "served by vLLM as an adapter), ia3 (peft IA3: a trained scale per "
        "output channel of each targeted linear, per input channel of "
        "down_proj; about 0.02% of 7B's weights; lora.rank, alpha, dropout "
        "and init do not apply) or full (every "
        "weight: bf16 mixed precision with fp32 master weights, lr 1e-5 "
        "unless given, no fp16; the run folder gets a "
        "from_pretrained-loadable model/ instead of adapter/). "
        "docs/tuners.md says when to use which.",
        choices=TUNERS,
    )
    output_dir: str = _f("output", "Run folders are created under this folder.")
    run_name: str = _f(None, "Run folder name (default: <model>-<preset>-<date-time>).")
    micro_batch_size: int = _f(1, "Samples per forward pass.", minimum=1)
    grad_accum: int = _f(16, "Micro-batches per optimizer step.", minimum=1)
    lr: float = _f(1e-4, "Peak learning rate.", minimum=0)
    epochs: float = _f(1.0, "Passes over the training data (ignored when max_steps > 0).", minimum=0)
    max_steps: int = _f(-1, "Optimizer steps; -1 trains for `epochs`.")
    loraplus_lr_ratio: float = _f(
        0.0,
        "LoRA+: the B matrices learn this many times faster "
        "than lr (peft create_loraplus_optimizer; the LoRA+ "
        "paper uses 16). 0 = off. --tuner lora and dora.",
        minimum=0,
    )
    neftune_noise_alpha: float = _f(
        0.0,
        "NEFTune: uniform noise of this scale (divided by "
        "sqrt(tokens x hidden)) added to the input embeddings "
        "while training (transformers' "
        "neftune_noise_alpha; the paper uses 5). 0 = off.",
        minimum=0,
    )
    warmup_ratio: float = _f(0.05, "Fraction of steps with a linear learning-rate warm-up.", minimum=0)
    lr_scheduler: str = _f(
        "cosine", "Learning-rate schedule.", choices=("cosine", "linear", "constant", "constant_with_warmup")
    )
    weight_decay: float = _f(0.0, "AdamW weight decay.", minimum=0)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.", minimum=0)
    gradient_checkpointing: bool = _f(True, "Recompute activations in backward to save memory.")
    offload_checkpoints: str | bool = _f(
        "auto",
        "Keep each layer's checkpoint in pinned CPU memory until the backward pass (LoRA "
        "on one GPU, with gradient checkpointing). auto: on when training on a GPU, but for "
        "--task grpo only when the plan does not fit the GPU without it; true / false force it.",
        choices=("auto", True, False),
    )
    uncheckpointed_layers: int | str = _f(
        0,
        "With gradient checkpointing, the last N decoder layers keep their activations on "
        "the GPU instead of being recomputed in the backward pass (LoRA on one GPU): each "
        "saves its recomputation (a third of its compute) for its activations' memory, which "
        "the plan counts: for a card with room to spare. 0 recomputes every layer; auto: as "
        "many as the memory plan fits in 90% of the GPU's usable memory (0 without a GPU).",
        minimum=0,
    )
    offload_copy_stream: bool = _f(
        True,
        "Copy offloaded layer checkpoints on a side CUDA "
        "stream, overlapping the layers' compute, and fetch "
        "each back one layer ahead of its backward pass.",
    )
    expandable_segments: bool = _f(
        True,
        "PyTorch's caching allocator maps its GPU memory in growable segments, so what it "
        "holds stays near what is allocated. Not where "
        "PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set, under DeepSpeed, or on "
        "Windows / WSL, where the driver lacks it.",
    )
    mlp_chunk_tokens: int = _f(
        4096,
        "Recompute each layer's MLP on at most this many tokens "
        "at a time (LoRA on one GPU, with gradient checkpointing), "
        "on a GPU only when the memory plan does not fit without "
        "it (it costs a third MLP pass); 0 turns it off.",
        minimum=0,
    )
    logging_steps: int = _f(
        5,
        "Log every N optimizer steps (the step log, --report-to "
        "backends, and the progress line when output is not a "
        "terminal).",
        minimum=1,
    )
    report_to: list = _f(
        ["tensorboard"],
        "Where the step log also goes, comma-separated: "
        "tensorboard (RUN/logs), wandb (RUN/wandb), mlflow "
        "(RUN/mlflow.db), swanlab (RUN/swanlog), or none. "
        "wandb, mlflow and swanlab are optional packages "
        "(pip install 'lora-lab[trackers]'); their own "
        "settings (WANDB_MODE=offline ...) apply.",
    )
    save_steps: int = _f(100, "Save a checkpoint every N optimizer steps.", minimum=1)
    eval_steps: int = _f(100, "Evaluate every N optimizer steps (when there is validation data).", minimum=1)
    eval_tasks: list = _f(
        [],
        "lm-evaluation-harness tasks, comma-separated, scored on the base and on the fine-tune when training "
        "ends, as `lora-lab eval --tasks` does (RUN/benchmark_report.json; needs lora-lab[eval]).",
    )
    eval_tasks_path: str | None = _f(None, "train.eval_tasks: a folder of your own lm-eval task YAML files.")
    save_total_limit: int = _f(2, "Keep at most N checkpoints.", minimum=1)
    save_only_model: bool = _f(
        False,
        "Checkpoints hold the weights (adapter or model) only, "
        "without optimizer, scheduler and random state: for full "
        "fine-tuning a fraction of the size (7B: ~15 GB instead of "
        "~100 GB), but a run cannot resume from them.",
    )
    disk_check: bool = _f(
        True,
        "Refuse up front a run whose checkpoints and final weights "
        "would not fit the free space of --output-dir (estimated from "
        "the model's shape).",
    )
    seed: int = _f(42, "Random seed.")
    memory_check: bool = _f(
        True, "On a GPU, refuse up front a run the memory planner says will not fit (lora-lab plan shows the numbers)."
    )
    resume: str = _f(
        None,
        "Continue a run: auto (the newest complete checkpoint in the run "
        "folder; a fresh start if there is none), a run folder or a "
        "checkpoint folder.",
    )
    allow_config_change: bool = _f(
        False, "Resume even though the model, data, LoRA or batch settings differ from the run's config.yaml."
    )
    on_nonfinite: str = _f(
        "stop",
        "A NaN or inf loss or gradient: stop the run, or skip that update and count it.",
        choices=("stop", "skip"),
    )
    oom_retry: bool = _f(
        True,
        "On CUDA out-of-memory, halve the micro-batch, double grad_accum "
        "(same effective batch) and resume from the last checkpoint.",
    )
    gpus: int = _f(
        1,
        "Processes (one per GPU) to train with; above 1 the run is relaunched "
        "through `accelerate launch` (on a machine without CUDA: CPU processes "
        "over gloo). The effective batch is micro_batch_size x grad_accum x gpus.",
        minimum=1,
    )
    nodes: int = _f(
        1,
        "Machines the run spans (accelerate num_machines), each running the same "
        "`lora-lab run` command with its own --node-rank and --gpus processes; "
        "the effective batch is micro_batch_size x grad_accum x gpus x nodes. "
        "The run folder (--output-dir) must be on storage every node sees.",
        minimum=1,
    )
    node_rank: int = _f(
        0,
        "This machine's place among --nodes (accelerate machine_rank): 0 on "
        "the main machine, whose first process writes the run folder; 1 to "
        "nodes-1 on the others.",
        minimum=0,
    )
    main_address: str = _f(
        None,
        "HOST[:PORT] of node 0, where every node meets (accelerate "
        "main_process_ip / main_process_port; port 29500 when left "
        "out). Needed with --nodes above 1.",
    )
    node_wait_seconds: float = _f(
        300,
        "With --nodes above 1: how long a node other than 0 "
        "waits for node 0 to answer at --main-address before "
        "refusing to start.",
        minimum=1,
    )
    sync_each_micro_batch: str | bool = _f(
        "auto",
        "Several GPUs: reduce the gradients after every micro-batch, not only after "
        "the last one of an optimizer step. Without it FSDP keeps each GPU's whole "
        "unsharded 16-bit gradients between micro-batches (2 bytes a trained "
        "parameter: 2.9 GiB for full 1.5B); with it DDP communicates grad_accum times "
        "as often. auto: on for fsdp, off otherwise; DeepSpeed reduces every "
        "micro-batch either way.",
        choices=("auto", True, False),
    )
    engine: str = _f(
        "auto",
        "Distributed engine for --gpus: ddp (a full replica per GPU), "
        "deepspeed-zero2, deepspeed-zero2-offload, deepspeed-zero3, "
        "deepspeed-zero3-offload (pip install deepspeed) or fsdp; auto: "
        "ddp on one GPU, else the fastest one the memory plan fits. The "
        "engine configs are in presets/engines/.",
        choices=("auto",) + ENGINES,
    )


SECTIONS = {"model": ModelArgs, "lora": LoraArgs, "data": DataArgs, "train": TrainArgs, "grpo": GrpoArgs}


@dataclass(frozen=True)
class RunConfig:
    preset: str = "cpu"
    model: ModelArgs = field(default_factory=ModelArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    grpo: GrpoArgs = field(default_factory=GrpoArgs)
    sources: dict = field(default_factory=dict, repr=False)
    """key -> where its value came from ("default", "preset 16gb", "--lora-rank" ...)."""

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"preset": self.preset}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def with_changes(self, values: dict, source: str | dict) -> RunConfig:
        """A new config with `values` ("train.engine" -> "fsdp") set, each recorded as coming
        from `source` (one label, or key -> label); this one is left as it was."""
        sections: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            section, name = key.split(".")
            sections[section][name] = value
        labels = source if isinstance(source, dict) else dict.fromkeys(values, source)
        return dataclasses.replace(
            self,
            **{name: dataclasses.replace(getattr(self, name), **body) for name, body in sections.items() if body},
            sources={**self.sources, **labels},
        )

    def value(self, key: str):
        """The value of a dotted key ("lora.rank")."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def describe(self, changed_only: bool = False) -> str:
        """One line per key: value and where it came from; changed_only: only the keys whose value
        is not the dataclass default (what a run's start shows; config.yaml keeps them all)."""
        defaults = flatten(RunConfig().to_dict()) if changed_only else {}
        lines = []
        for key, value in flatten(self.to_dict()).items():
            if key != "preset" and not (changed_only and value == defaults[key]):
                lines.append(f"  {key:<28} = {value!r:<32} ({self.sources.get(key, 'default')})")
        return "\n".join(lines)


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key in SECTIONS and not prefix:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
