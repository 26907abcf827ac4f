"""Hub models: a missing repo or an unreachable hub is one clean message at once (no retries), a
cached model loads without the hub, a download says what it fetches and how much (and shows the
hub's progress bars on a terminal), and the data commands count tokens with the shipped Qwen2.5
tokenizer when the model is not here."""

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from lora_lab.errors import ModelError
from lora_lab.models.load import locate_model, locate_tokenizer
from lora_lab.paths import shipped_tokenizer_dir
from lora_lab.registry import uses_shipped_tokenizer
from tests.support.fake_hub import serve_repos
from tests.support.terminal import on_a_terminal
from tests.support.tiny import TOKENIZER_DIR, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused
NAMES = ["--model-name", "A", "--model-author", "B"]


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Point huggingface_hub at `endpoint`, online, with an empty cache: what HF_ENDPOINT,
    HF_HUB_CACHE and no HF_HUB_OFFLINE do when read at import."""
    from huggingface_hub import constants

    def point(endpoint: str, cache: Path = tmp_path / "hub-cache"):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        return cache

    return point


def fake_cache(cache: Path, repo_id: str, files: dict) -> Path:
    """A hub cache entry for repo_id at main, the layout huggingface_hub writes."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name, source in files.items():
        (snapshot / name).write_bytes(Path(source).read_bytes())
    return snapshot


def test_run_with_an_unreachable_hub_stops_at_once_with_one_message(hub_at, tmp_path):
    import lora_lab.training.run  # noqa: F401  (imports are not what is timed)

    hub_at(CLOSED_PORT)
    started = time.monotonic()
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            "no-such-org/no-such-model",
            "--data",
            "self-cognition",
            *NAMES,
            "--output-dir",
            str(tmp_path),
        ],
    )
    elapsed = time.monotonic() - started
    assert result.exit_code == 2, result.output
    assert elapsed < 5, f"{elapsed:.1f} s: the hub was retried"
    error = result.output[result.output.index("error: ") :]
    assert error.startswith(
        f"error: --model no-such-org/no-such-model: cannot reach the Hugging Face hub ({CLOSED_PORT}: ConnectError"
    )
    for fix in ("--model /path/to/folder", "HF_ENDPOINT", "HF_HUB_OFFLINE=1"):
        assert fix in error
    assert len(error.strip().splitlines()) == 1 and "Traceback" not in result.output


class _Hub(http.server.BaseHTTPRequestHandler):
    """Answers every request the way the hub answers for one kind of failure."""

    status, error_code = 404, None

    def do_HEAD(self):
        self.send_response(self.status)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def answering_hub():
    servers = []

    def start(status: int, error_code: str | None) -> str:
        handler = type("Handler", (_Hub,), {"status": status, "error_code": error_code})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize(
    "status,error_code,message",
    [
        (404, "RepoNotFound", "has no model no-such-org/no-such-model, or it is private"),
        (401, "GatedRepo", "no-such-org/no-such-model is a gated repo. Accept its terms"),
        (404, "EntryNotFound", "has no config.json, so it is not a transformers model"),
        (401, None, "refused this machine's credentials"),
        (503, None, "answered HTTP 503 for no-such-org/no-such-model"),
    ],
)
def test_what_the_hub_answers_is_said_at_once(hub_at, answering_hub, status, error_code, message):
    hub_at(answering_hub(status, error_code))
    started = time.monotonic()
    with pytest.raises(ModelError, match="^--model no-such-org/no-such-model: ") as caught:
        locate_model("no-such-org/no-such-model")
    assert time.monotonic() - started < 3
    assert message in str(caught.value)


def test_a_cached_model_loads_without_the_hub(hub_at, monkeypatch):
    from huggingface_hub import constants

    cache = hub_at(CLOSED_PORT)
    snapshot = fake_cache(cache, "org/tiny", {"config.json": TOKENIZER_DIR / "LICENSE"})
    assert locate_model("org/tiny") == str(snapshot)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert locate_model("org/tiny") == str(snapshot)
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set and org/other is not in the local hub cache"):
        locate_model("org/other")


def test_data_commands_count_with_a_cached_tokenizer_without_the_hub(hub_at):
    cache = hub_at(CLOSED_PORT)
    files = {name: TOKENIZER_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    snapshot = fake_cache(cache, "Qwen/Qwen2.5-7B-Instruct", files)
    assert locate_tokenizer("qwen2.5-7b") == (str(snapshot), "tokenizer: Qwen/Qwen2.5-7B-Instruct (local hub cache)")
    result = CliRunner().invoke(main, ["data", "stats", "self-cognition", "--model", "qwen2.5-7b", *NAMES])
    assert result.exit_code == 0, result.output
    assert "tokenizer: Qwen/Qwen2.5-7B-Instruct (local hub cache)" in result.output


def test_data_stats_counts_with_the_shipped_tokenizer_when_the_hub_is_unreachable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=CLOSED_PORT, HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "lora_lab", "data", "stats", "self-cognition", "--model", "qwen2.5-0.5b", *NAMES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 20
    assert (
        "tokenizer: the Qwen2.5 Instruct tokenizer shipped with lora-lab (the one "
        "Qwen/Qwen2.5-0.5B-Instruct uses; not in the local hub cache)"
    ) in result.stdout
    assert "samples 120" in result.stdout and "recommended --max-length 256" in result.stdout
    assert "Retrying" not in result.stderr


@pytest.mark.parametrize(
    "alias,repo_id,family",
    [
        ("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "a Llama 3.x, SmolLM2, TinyLlama model"),
        ("gemma-3-270m", "google/gemma-3-270m-it", "a Gemma 3 (text) model"),
        ("phi-4-mini", "microsoft/Phi-4-mini-instruct", "a Phi-3, Phi-4-mini model"),
        ("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", "a Mistral model"),
        ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "a Qwen3 model"),
        ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "a Llama 3.x, SmolLM2, TinyLlama model"),
        ("someone/own-model", "someone/own-model", "this model"),
    ],
)
def test_data_commands_refuse_to_count_another_familys_text_with_the_qwen_tokenizer(hub_at, alias, repo_id, family):
    cache = hub_at(CLOSED_PORT)
    result = CliRunner().invoke(main, ["data", "stats", "self-cognition", "--model", alias, *NAMES])
    assert result.exit_code == 2, result.output
    error = result.output[result.output.index("error: ") :]
    assert error.strip() == (
        f"error: --model {alias}: counting tokens needs {repo_id}'s own tokenizer; it is not in "
        f"the local hub cache ({cache}) and the hub ({CLOSED_PORT}) cannot be reached. The "
        f"tokenizer shipped with lora-lab is Qwen2.5 Instruct's; {family} has its own "
        f"vocabulary and chat template, and counts with Qwen2.5's would be wrong. Pass a local "
        f"folder with the model's tokenizer (--model /path/to/folder), or download it where the "
        f"hub is reachable (`hf download {repo_id} --include '*.json' '*.jinja' 'tokenizer*'`), "
        f"copy the hub cache here and run with HF_HUB_OFFLINE=1."
    )
    assert "samples" not in result.output and "tokenizer:" not in result.output  # nothing counted


def test_a_qwen_base_model_offline_is_refused_too_and_its_cached_tokenizer_counts(hub_at, monkeypatch):
    from huggingface_hub import constants

    cache = hub_at(CLOSED_PORT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for command in (
        ["validate", "self-cognition", "--model", "qwen2.5-0.5b-base"],
        ["encode", "self-cognition", "--model", "qwen2.5-0.5b-base", "--output", str(cache.parent / "out.jsonl")],
    ):
        result = CliRunner().invoke(main, ["data", *command, *NAMES])
        assert result.exit_code == 2, result.output
        assert (
            "counting tokens needs Qwen/Qwen2.5-0.5B's own tokenizer; it is not in the local hub cache"
        ) in result.output
        assert (
            "and HF_HUB_OFFLINE is set. The Qwen2.5 Instruct tokenizer shipped with lora-lab "
            "was not checked against this model's tokenizer and chat template."
        ) in result.output
    files = {name: TOKENIZER_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    snapshot = fake_cache(cache, "Qwen/Qwen2.5-0.5B", files)
    assert locate_tokenizer("qwen2.5-0.5b-base") == (str(snapshot), "tokenizer: Qwen/Qwen2.5-0.5B (local hub cache)")


def test_the_shipped_tokenizer_is_the_tested_one_and_only_for_instruct_models():
    for name in ("tokenizer.json", "tokenizer_config.json", "LICENSE"):
        assert (shipped_tokenizer_dir() / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes()
    assert uses_shipped_tokenizer("Qwen/Qwen2.5-1.5B-Instruct")
    assert not uses_shipped_tokenizer("Qwen/Qwen2.5-7B")  # base: not checked against it


def test_a_download_says_what_and_how_much_and_draws_the_hubs_bars(tiny_model_dir, tmp_path, hub_at):
    """`lora-lab infer --model ORG/NAME` from a local hub that serves the tiny model's folder."""
    from lora_lab.models.hub import files_to_download

    endpoint, server = serve_repos({"org/tiny": tiny_model_dir})
    cache = tmp_path / "hub-cache"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"query": f"Q{i}?"} for i in range(3)])
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(cache))
    try:
        status, stdout, screen = on_a_terminal(
            [
                sys.executable,
                "-m",
                "lora_lab",
                "infer",
                "--model",
                "org/tiny",
                "--input",
                str(prompts),
                "--output",
                str(tmp_path / "answers.jsonl"),
                "--batch-size",
                "2",
                "--max-new-tokens",
                "3",
                "--greedy",
            ],
            env,
            ROOT,
        )
        assert status == 0, stdout + screen[-3000:]
        weights = (tiny_model_dir / "model.safetensors").stat().st_size
        fetched = [p for p in tiny_model_dir.iterdir() if p.suffix in (".json", ".safetensors", ".jinja", ".txt")]
        total = sum(p.stat().st_size for p in fetched)
        assert (
            f"downloading org/tiny from {endpoint}: {total / 2**20:.1f} MiB in "
            f"{len(fetched)} files (the largest model.safetensors, {weights / 2**20:.1f} MiB)"
            f" into {cache}"
        ) in stdout.splitlines()
        assert "model.safetensors: 100%|" in screen  # huggingface_hub's own bar on a terminal
        assert "HTTP Request" not in screen  # and not a line per request
        lines = [line for line in stdout.splitlines() if line.startswith("generat")]
        assert lines[0] == (
            f"generating answers to 3 prompts of {prompts} in 2 batches of up to 2 (at most 3 new tokens each)"
        )
        assert [line.split(" · ")[0] for line in lines[1:]] == ["generated 2/3 prompts", "generated 3/3 prompts"]
        assert lines[-1].endswith(" tok/s") and "wrote 3 answers" in stdout
        hub_at(endpoint, cache)
        assert [name for name, _ in files_to_download("org/tiny")] == []  # now cached: no line
    finally:
        server.shutdown()
