"""Untrusted inputs (issue item 7): a golden corpus is a user's directory, and a pickle runs code on
load. Every test plants a pickle whose `__reduce__` creates a marker file and checks that the marker
is NOT created without --trust-pickles (the error names the file and the flag), and that with the
flag the file is unpickled in full (the marker appears). The corpus the harness writes itself checks
without the flag (tests/test_gate.py runs that check end to end; here its pickles are screened)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from harness import cli
from harness.gate import bump, golden
from harness.judge.ckpt_content import (
    TRUST_FLAG,
    UntrustedPickle,
    load_metadata,
    read_objects,
    refuse_pickles,
)


class Plant:
    """Unpickling this creates `marker` (what a hostile checkpoint would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One corpus the harness writes itself (the model-only artefact: one small world)."""
    corpus = tmp_path_factory.mktemp("made") / "corpus"
    (result,) = golden.make(corpus, k="model-dist")
    assert result.status == "passed", result.error
    return corpus


@pytest.fixture
def corpus(made: Path, tmp_path: Path) -> Path:
    shutil.copytree(made, tmp_path / "corpus")
    return tmp_path / "corpus"


def _reseal(corpus: Path, rel: str) -> None:
    """Rewrite the manifest's sha256 of `rel` (a forger controls the manifest too)."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["artefacts"]["model-dist"]["files"][rel] = hashlib.sha256((corpus / "model-dist" / rel).read_bytes()).hexdigest()
    (corpus / "manifest.json").write_text(json.dumps(manifest))


def _dcp(directory: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return directory


def test_the_corpus_the_harness_writes_passes_the_screen_without_the_flag(made):
    """Its DCP metadata and object items load with weights_only semantics: no --trust-pickles needed."""
    ckpt = made / "model-dist" / "ckpt"
    assert type(load_metadata(ckpt / ".metadata")).__name__ == "Metadata"
    objects = read_objects(ckpt)
    assert objects and any(k.startswith("common_state") for k in objects)
    assert golden.screen(made, ["model-dist"]) == 1 + len(objects)


def test_a_code_running_pt_file_in_a_corpus_is_refused_by_name(corpus, tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = corpus / "model-dist" / "ckpt" / "extra.pt"
    torch.save(Plant(marker), evil)  # not in the manifest: the screen reads every file, listed or not
    with pytest.raises(golden.UntrustedCorpus) as info:
        golden.check(corpus, k="model-dist")
    assert str(evil) in str(info.value) and TRUST_FLAG in str(info.value) and "Unsupported global: GLOBAL _io.open" in str(info.value)
    assert cli.main(["golden", "check", str(corpus), "-k", "model-dist"]) == 2
    err = capsys.readouterr().err
    assert str(evil) in err and TRUST_FLAG in err
    assert not marker.exists()


def test_a_code_running_dcp_metadata_is_refused_and_loads_only_with_the_flag(corpus, tmp_path):
    """The `.metadata` torch DCP unpickles with plain pickle inside megatron-core's loader: screened
    here; with --trust-pickles the loader gets it (and runs it: the marker is the proof)."""
    marker = tmp_path / "ran"
    meta = corpus / "model-dist" / "ckpt" / ".metadata"
    meta.write_bytes(pickle.dumps(Plant(marker)))
    _reseal(corpus, "ckpt/.metadata")
    with pytest.raises(golden.UntrustedCorpus, match=r"\.metadata.*--trust-pickles"):
        golden.check(corpus, k="model-dist")
    assert not marker.exists()
    (result,) = golden.check(corpus, k="model-dist", trust_pickles=True)
    assert marker.exists() and result.status == "error"  # unpickled in full, then not a Metadata


def test_a_code_running_dcp_object_item_is_refused_by_file_and_key(tmp_path):
    marker = tmp_path / "ran"
    ckpt = _dcp(tmp_path / "ckpt", {"w": torch.ones(3), "optimizer.evil": Plant(marker), "optimizer.fine": ({"step": 4.0},)})
    with pytest.raises(UntrustedPickle) as info:
        read_objects(ckpt)
    assert info.value.key == "optimizer.evil" and str(ckpt) in str(info.value) and TRUST_FLAG in str(info.value)
    with pytest.raises(UntrustedPickle, match="optimizer.evil"):
        golden.checkpoint_steps(ckpt)  # the corpus step reader, from a user's directory
    assert read_objects(ckpt, keys=["optimizer.fine"]) == {"optimizer.fine": ({"step": 4.0},)}  # (a tuple: DCP keeps it whole)
    assert not marker.exists()
    assert golden.checkpoint_steps(ckpt, trust_pickles=True) == [4.0] and marker.exists()


def test_a_clean_dcp_checkpoint_and_torch_file_pass(tmp_path):
    ckpt = _dcp(tmp_path / "ckpt", {"w": torch.ones(3, dtype=torch.bfloat16), "obj": ({"a": [1, 2.5, "x"], "t": torch.arange(3)},)})
    torch.save({"x": torch.zeros(2)}, ckpt / "common.pt")
    assert refuse_pickles(tmp_path) == 3  # .metadata, one object item, common.pt
    (obj,) = read_objects(ckpt)["obj"]
    assert obj["a"] == [1, 2.5, "x"] and torch.equal(obj["t"], torch.arange(3))


@pytest.mark.parametrize("module, name", [("os", "system"), ("builtins", "eval"), ("io", "open"),
                                          ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
                                          ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
                                          ("torch", "load")])
def test_the_metadata_unpickler_allows_only_dcp_records(tmp_path, module, name):
    """Protocol 4 STACK_GLOBAL of (module, name): the global alone is refused, before any call."""
    path = tmp_path / ".metadata"
    enc = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # noqa: E731  SHORT_BINUNICODE
    path.write_bytes(b"\x80\x04" + enc(module) + enc(name) + b"\x93.")
    with pytest.raises(UntrustedPickle, match=f"{module}.{name}".replace(".", r"\.")):
        load_metadata(path)
    path.write_bytes(b"\x80\x04" + enc("torch") + enc("bfloat16") + b"\x93.")
    assert load_metadata(path) is torch.bfloat16


def test_the_cli_threads_trust_pickles_to_golden_check_and_the_gate(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(golden, "check", lambda *a, **kw: seen.setdefault("check", kw) and [])
    monkeypatch.setattr(bump, "run_gate", lambda *a, **kw: seen.setdefault("gate", kw) and 0)
    cli.main(["golden", "check", str(tmp_path), TRUST_FLAG])
    cli.main(["gate", "--candidate", "megatron-core==0.19.0", "--out", str(tmp_path / "g"), "--corpus", str(tmp_path), TRUST_FLAG])
    assert seen["check"]["trust_pickles"] is True and seen["gate"]["trust_pickles"] is True
    seen.clear()
    cli.main(["golden", "check", str(tmp_path)])
    cli.main(["gate", "--candidate", "megatron-core==0.19.0", "--out", str(tmp_path / "g")])
    assert seen["check"]["trust_pickles"] is False and seen["gate"]["trust_pickles"] is False


@pytest.mark.parametrize("trust", [False, True])
def test_the_gate_passes_the_flag_to_its_check_of_a_stored_corpus(monkeypatch, tmp_path, trust):
    calls = []

    def harness(side, args, log):
        calls.append(args)
        report = Path(args[args.index("--report") + 1])
        report.mkdir(parents=True)
        (report / "results.json").write_text("{}")
        return 0

    monkeypatch.setattr(bump, "_harness", harness)
    bump.stored_corpus(bump.Side("candidate", []), tmp_path / "corpus", tmp_path / "out", trust_pickles=trust)
    assert calls[0][:3] == ["golden", "check", str(tmp_path / "corpus")] and (TRUST_FLAG in calls[0]) is trust
