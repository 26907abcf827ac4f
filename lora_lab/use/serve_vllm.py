"""`lora-lab serve --engine vllm`: the same runs served by vLLM, `vllm serve BASE --enable-lora
--lora-modules NAME=ADAPTER ...`, with the rank vLLM must reserve and, for `--gpu TIER`, the
serving plan's context, sequences and memory share (planning/serving.py). The API key goes to vLLM
through its environment (VLLM_API_KEY), never its argument list. Where vLLM is not installed, the
command is printed with what to install."""

from __future__ import annotations

import json
import os
import shlex
import shutil

from ..architecture import parameter_count
from ..errors import LoraLabError
from ..log import get_logger
from ..planning.serving import VLLM_MAX_LORA_RANKS, VLLM_UNSERVED_ADAPTERS, plan_vllm_serving, vllm_lora_rank
from ..registry import model_config_of
from ..run_folder.names import ADAPTER_CONFIG
from .merge import adapter_kind_of
from .serve import check_address, served_runs

log = get_logger()


def vllm_argv(specs: list[str], base: str | None, host: str, port: int, gpu: str | None = None) -> list[str]:
    """The `vllm serve` arguments for the runs (each one's adapter under its name), refusing an
    adapter vLLM does not load (DoRA, IA3) or a rank above its largest."""
    runs, base_args = served_runs(specs, base)
    ranks = []
    for name, adapter_dir, _ in runs:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        kind = adapter_kind_of(config)
        if kind in VLLM_UNSERVED_ADAPTERS:
            raise LoraLabError(f"--engine vllm: {name} ({adapter_dir}): {VLLM_UNSERVED_ADAPTERS[kind]}")
        ranks.append(int(config.get("r") or 0))
    rank = vllm_lora_rank(max(ranks))
    if rank is None:
        raise LoraLabError(
            f"--engine vllm: LoRA rank {max(ranks)} is above vLLM's largest --max-lora-rank "
            f"({VLLM_MAX_LORA_RANKS[-1]}): merge the run and serve the merged folder."
        )
    argv = ["vllm", "serve", base_args.name, "--host", host, "--port", str(port), "--enable-lora"]
    argv += ["--lora-modules", *(f"{name}={adapter_dir}" for name, adapter_dir, _ in runs)]
    argv += ["--max-lora-rank", str(rank), "--max-loras", str(len(runs))]
    if gpu:
        config = model_config_of(base_args.name)
        if config is None:
            raise LoraLabError(f"--gpu {gpu}: the shape of {base_args.name} is not known here; drop --gpu.")
        plan = plan_vllm_serving(config, 2 * parameter_count(config), gpu)  # the 16-bit base's weights
        if not plan.fits:
            raise LoraLabError(f"--gpu {gpu}: {plan.arithmetic()[-1]}")
        argv += plan.flags().split()
    return argv


def serve_with_vllm(
    specs: list[str], base: str | None, host: str, port: int, api_key: str | None, gpu: str | None = None
) -> None:
    """Replace this process with vLLM serving the runs (the address checked as for lora-lab's
    own server); where vLLM is not installed, say what to install and its command."""
    check_address(host, api_key)
    argv = vllm_argv(specs, base, host, port, gpu)
    executable = shutil.which("vllm")
    if executable is None:
        raise LoraLabError(
            "--engine vllm: vLLM is not installed here (pip install vllm, on Linux with a CUDA GPU; "
            f"it serves these runs with: {shlex.join(argv)}"
            + (" and VLLM_API_KEY set to the key" if api_key else "")
            + "). Without it, drop --engine: lora-lab's own server answers the same API."
        )
    env = dict(os.environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    log.info(f"starting vLLM: {shlex.join(argv)}")
    os.execve(executable, argv, env)
