"""Where the GGUF export's converter comes from: never fetched at export time; the cached
llama-cpp-python source is used only with its pinned sha256."""

import pytest

pytest.importorskip("llama_cpp")

from lora_lab.errors import LoraLabError
from lora_lab.use.gguf_export import locate_converter


def test_a_missing_source_says_what_to_get_and_fetches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("LORA_LAB_LLAMA_CPP", raising=False)
    with pytest.raises(LoraLabError, match=r"get it once with `make llama-cpp`, or: pip download"):
        locate_converter()
    assert sorted(p.name for p in tmp_path.rglob("*")) == []  # nothing downloaded


def test_a_source_that_is_not_the_pinned_one_is_not_run(tmp_path, monkeypatch):
    import importlib.metadata

    version = importlib.metadata.version("llama_cpp_python")
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("LORA_LAB_LLAMA_CPP", raising=False)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / f"llama_cpp_python-{version}.tar.gz").write_bytes(b"a planted archive")
    with pytest.raises(LoraLabError, match="its sha256 is not the pinned one"):
        locate_converter()
    assert not (tmp_path / "llama.cpp").exists()


def test_the_export_warns_where_llama_cpp_cannot_follow_the_models_rope():
    """gpt-oss's YaRN does not round its correction range (rope_parameters.truncate false), which
    llama.cpp always does: on the tiny gpt-oss that alone moved llama.cpp's logits by up to 2.4 at
    40 tokens (1.4e-4 with truncate true). The export says so; a YaRN that rounds, or none, is
    left alone."""
    import json

    from lora_lab.paths import model_configs_dir
    from lora_lab.use.gguf_export import rope_caveat

    configs = model_configs_dir()
    gpt_oss = json.loads((configs / "gpt-oss-20b.json").read_text())
    assert "rope_parameters.truncate false" in rope_caveat(gpt_oss)
    rounded = {**gpt_oss, "rope_scaling": {**gpt_oss["rope_scaling"], "truncate": True}}
    assert rope_caveat(rounded) is None
    assert rope_caveat(json.loads((configs / "qwen2.5-7b.json").read_text())) is None
    assert rope_caveat({"text_config": gpt_oss}) == rope_caveat(gpt_oss)  # a vision-language config's
