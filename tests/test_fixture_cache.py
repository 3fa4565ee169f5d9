"""harness.models.fixture_cache: an HF fixture is written once per (arguments, transformers, torch,
deriving code) and copied on later calls; the copy is the caller's, the key moves with each input."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from harness.core.zoo import get_model
from harness.models import fixture_cache as fc


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CKPT_HARNESS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(fc.OFF, raising=False)
    return tmp_path / "home" / "fixtures"


def test_a_fixture_is_written_once_and_copied_after(store, tmp_path):
    calls: list[Path] = []

    def write(d: Path) -> None:
        calls.append(d)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text("{}")

    args = (get_model("hf-llama"), "fp32", 1, ())
    a, state_a = fc.cached(tmp_path / "a", args, write)
    b, state_b = fc.cached(tmp_path / "b", args, write)
    assert (state_a, state_b) == ("wrote", "hit") and len(calls) == 1 and _digest(a) == _digest(b)
    (b / "config.json").write_text("changed by the case")  # the case's copy, not the store
    c, _ = fc.cached(tmp_path / "c", args, write)
    assert (c / "config.json").read_text() == "{}" and len(list(store.iterdir())) == 1


def test_the_key_moves_with_every_input(monkeypatch):
    base = fc.fixture_key(get_model("hf-llama"), "fp32", 1, ())
    assert base == fc.fixture_key(get_model("hf-llama"), "fp32", 1, ())
    assert base != fc.fixture_key(get_model("hf-qwen2"), "fp32", 1, ())
    assert base != fc.fixture_key(get_model("hf-llama"), "bf16", 1, ())
    assert base != fc.fixture_key(get_model("hf-llama"), "fp32", 2, ())
    import transformers

    monkeypatch.setattr(transformers, "__version__", "0.0.0-planted")
    assert base != fc.fixture_key(get_model("hf-llama"), "fp32", 1, ())


def test_a_failed_write_leaves_no_entry_and_off_writes_in_place(store, tmp_path, monkeypatch):
    def broken(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        (d / "half").write_text("x")
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        fc.cached(tmp_path / "a", (get_model("hf-llama"), "fp32", 1, ()), broken)
    assert not [p for p in store.iterdir()]  # neither an entry nor its temporary
    monkeypatch.setenv(fc.OFF, "0")
    d, state = fc.cached(tmp_path / "b", ("x",), lambda p: (p.mkdir(parents=True), (p / "f").write_text("1")))
    assert state == "off" and (d / "f").read_text() == "1" and not [p for p in store.iterdir()]


def test_write_fixture_hits_give_the_same_bytes(store, tmp_path):
    from harness.models.hf import write_fixture

    spec = get_model("hf-llama")
    first = write_fixture(spec, tmp_path / "one")
    second = write_fixture(spec, tmp_path / "two")
    assert _digest(first) == _digest(second) and (first / "model.safetensors").exists()
    assert len(list(store.iterdir())) == 1
