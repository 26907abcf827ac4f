"""Hub models: one quick request to the Hugging Face hub before anything is loaded, so that a
missing repo or an unreachable hub is one clear message at once, not minutes of retries, and a
model in the local hub cache still loads when the hub cannot be reached."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelError
from ..log import get_logger

log = get_logger()

PROBE_TIMEOUT_S = 5.0
"""Seconds the one metadata request may wait for the hub; HF_HUB_ETAG_TIMEOUT overrides it."""


def _ways_out(repo_id: str) -> str:
    return (f"Pass a local model folder (--model /path/to/folder), point HF_ENDPOINT at a hub "
            f"mirror this machine can reach, or download it where the hub is reachable "
            f"(`hf download {repo_id}`), copy the cache and run with HF_HUB_OFFLINE=1.")


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
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        RepositoryNotFoundError)

    hub = constants.ENDPOINT
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or PROBE_TIMEOUT_S)
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout)
        return None
    except GatedRepoError:
        return "missing", (f"--model {spec}: {repo_id} is a gated repo. Accept its terms at "
                           f"{hub}/{repo_id} and log in here with `hf auth login` (or set "
                           f"HF_TOKEN), or pass a local model folder.")
    except RepositoryNotFoundError:
        return "missing", (f"--model {spec}: the hub ({hub}) has no model {repo_id}, or it is "
                           f"private and this machine is not logged in. Check the spelling, "
                           f"run `hf auth login` for a private or gated repo, or pass a local "
                           f"model folder.")
    except EntryNotFoundError:
        return "missing", (f"--model {spec}: {repo_id} on {hub} has no config.json, so it is "
                           f"not a transformers model. Pass a model repo, a local model folder "
                           f"or a .gguf file.")
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", "an error")
        if status in (401, 403):
            return "missing", (f"--model {spec}: the hub ({hub}) refused this machine's "
                               f"credentials for {repo_id} (HTTP {status}). Check HF_TOKEN or "
                               f"log in again with `hf auth login`.")
        return "unreachable", (f"--model {spec}: the hub ({hub}) answered HTTP {status} for "
                               f"{repo_id}, and it is not in the local hub cache. Try again "
                               f"later. {_ways_out(repo_id)}")
    except Exception as exc:  # anything but an HTTP answer: the hub was not reached
        return "unreachable", (f"--model {spec}: cannot reach the Hugging Face hub ({hub}: "
                               f"{_first_line(exc)}), and {repo_id} is not in the local hub "
                               f"cache. {_ways_out(repo_id)}")


def locate_hub_model(spec: str, repo_id: str) -> str:
    """What from_pretrained should load for a hub model: the id where the hub has it; the cached
    copy's folder where the hub cannot be reached or HF_HUB_OFFLINE is set; else a ModelError."""
    from huggingface_hub import constants

    cached = cached_snapshot(repo_id)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return cached
        raise ModelError(f"--model {spec}: HF_HUB_OFFLINE is set and {repo_id} is not in the "
                         f"local hub cache ({constants.HF_HUB_CACHE}). Unset HF_HUB_OFFLINE to "
                         f"download it, or pass a local model folder.")
    problem = hub_problem(spec, repo_id)
    if problem is None:
        return repo_id
    kind, message = problem
    if kind == "unreachable" and cached:
        log.info(f"--model {spec}: the hub cannot be reached; loading the cached copy {cached}")
        return cached
    raise ModelError(message)
