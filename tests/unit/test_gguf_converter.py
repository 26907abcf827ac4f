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
