"""Hub models: one quick request to the Hugging Face hub before anything is loaded, so that a
missing repo or an unreachable hub is one clear message at once, not minutes of retries, and a
model in the local hub cache still loads when the hub cannot be reached. A model about to be
downloaded is announced with its size; huggingface_hub draws its own progress bars on a
terminal."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelError
from ..log import get_logger
from ..paths import human_bytes

log = get_logger()

PROBE_TIMEOUT_S = 5.0
"""Seconds the one metadata request may wait for the hub; HF_HUB_ETAG_TIMEOUT overrides it."""


def _ways_out(repo_id: str) -> str:
    return (
        f"Pass a local model folder (--model /path/to/folder), point HF_ENDPOINT at a hub "
        f"mirror this machine can reach, or download it where the hub is reachable "
        f"(`hf download {repo_id}`), copy the cache and run with HF_HUB_OFFLINE=1."
    )


def cached_snapshot(repo_id: str, filename: str = "config.json") -> str | None:
    """The folder of the local hub cache (HF_HUB_CACHE) that holds repo_id's `filename` at main,
    or None when it is not there."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return str(Path(found).parent) if isinstance(found, str) else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def hub_problem(spec: str, repo_id: str) -> tuple[str, str] | None:
    """None when the hub has repo_id's config.json. Else (kind, message): kind "missing" (no such
    repo, gated, not a model) ends the run; kind "unreachable" may fall back on the cache.

    One HEAD request without retries: get_hf_file_metadata retries nothing unless asked
    (retry_on_errors=False), unlike from_pretrained, which retries every file five times."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    hub = constants.ENDPOINT
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or PROBE_TIMEOUT_S)
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout)
        return None
    except GatedRepoError:
        return "missing", (
            f"--model {spec}: {repo_id} is a gated repo. Accept its terms at "
            f"{hub}/{repo_id} and log in here with `hf auth login` (or set "
            f"HF_TOKEN), or pass a local model folder."
        )
    except RepositoryNotFoundError:
        return "missing", (
            f"--model {spec}: the hub ({hub}) has no model {repo_id}, or it is "
            f"private and this machine is not logged in. Check the spelling, "
            f"run `hf auth login` for a private or gated repo, or pass a local "
            f"model folder."
        )
    except EntryNotFoundError:
        return "missing", (
            f"--model {spec}: {repo_id} on {hub} has no config.json, so it is "
            f"not a transformers model. Pass a model repo, a local model folder "
            f"or a .gguf file."
        )
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", "an error")
        if status in (401, 403):
            return "missing", (
                f"--model {spec}: the hub ({hub}) refused this machine's "
                f"credentials for {repo_id} (HTTP {status}). Check HF_TOKEN or "
                f"log in again with `hf auth login`."
            )
        return "unreachable", (
            f"--model {spec}: the hub ({hub}) answered HTTP {status} for "
            f"{repo_id}, and it is not in the local hub cache. Try again "
            f"later. {_ways_out(repo_id)}"
        )
    except Exception as exc:  # anything but an HTTP answer: the hub was not reached
        return "unreachable", (
            f"--model {spec}: cannot reach the Hugging Face hub ({hub}: "
            f"{_first_line(exc)}), and {repo_id} is not in the local hub "
            f"cache. {_ways_out(repo_id)}"
        )


def locate_hub_model(spec: str, repo_id: str) -> str:
    """What from_pretrained should load for a hub model: the id where the hub has it; the cached
    copy's folder where the hub cannot be reached or HF_HUB_OFFLINE is set; else a ModelError."""
    from huggingface_hub import constants

    cached = cached_snapshot(repo_id)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return cached
        raise ModelError(
            f"--model {spec}: HF_HUB_OFFLINE is set and {repo_id} is not in the "
            f"local hub cache ({constants.HF_HUB_CACHE}). Unset HF_HUB_OFFLINE to "
            f"download it, or pass a local model folder."
        )
    problem = hub_problem(spec, repo_id)
    if problem is None:
        return repo_id
    kind, message = problem
    if kind == "unreachable" and cached:
        log.info(f"--model {spec}: the hub cannot be reached; loading the cached copy {cached}")
        return cached
    raise ModelError(message)


SMALL_FILES = (".json", ".txt", ".jinja", ".model")
"""The files beside the weights that from_pretrained fetches (config, tokenizer, template)."""


def weight_files(repo_id: str, names: set) -> list[str]:
    """The safetensors files from_pretrained loads: model.safetensors, or the shards its index
    names (the index is fetched, as from_pretrained fetches it first)."""
    if "model.safetensors" in names:
        return ["model.safetensors"]
    if "model.safetensors.index.json" not in names:
        return []
    import json

    from huggingface_hub import hf_hub_download

    index = json.loads(Path(hf_hub_download(repo_id, "model.safetensors.index.json")).read_text())
    return sorted(set(index["weight_map"].values()))


def files_to_download(repo_id: str) -> list[tuple[str, int]]:
    """(name, bytes) of each file loading repo_id's model and tokenizer would download: those
    of the top folder that are not in the local hub cache (other weight formats left out)."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or PROBE_TIMEOUT_S)
    info = HfApi().model_info(repo_id, files_metadata=True, timeout=timeout)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    wanted = weight_files(repo_id, set(sizes)) + sorted(n for n in sizes if "/" not in n and n.endswith(SMALL_FILES))
    return [
        (n, sizes.get(n, 0)) for n in dict.fromkeys(wanted) if not isinstance(try_to_load_from_cache(repo_id, n), str)
    ]


def announce_download(repo_id: str) -> None:
    """One line before a hub model is downloaded: what, from where, how much, and where to."""
    from huggingface_hub import constants

    try:
        files = files_to_download(repo_id)
    except Exception as exc:  # the size is news, not a reason to stop: the load reports errors
        log.info(
            f"downloading {repo_id} from {constants.ENDPOINT} into {constants.HF_HUB_CACHE} "
            f"(size unknown: {_first_line(exc)})"
        )
        return
    if not any(name.endswith(".safetensors") for name, _ in files):
        return  # the weights are here: what is left takes no time worth a line
    largest = max(files, key=lambda f: f[1])
    log.info(
        f"downloading {repo_id} from {constants.ENDPOINT}: "
        f"{human_bytes(sum(size for _, size in files))} in {len(files)} files (the largest "
        f"{largest[0]}, {human_bytes(largest[1])}) into {constants.HF_HUB_CACHE}"
    )
