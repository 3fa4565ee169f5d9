"""Save once, load many (harness.run.reuse): the key, the store, and real cases sharing a source."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from harness import backends
from harness.core.memory import Budget
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import get_model
from harness.orchestration.runner import RunOptions, run_case, run_cases
from harness.orchestration.schedulers._common import writers_first
from harness.run.reuse import PLACEHOLDER, SOURCE_UNCHANGED, SourceStore, manifest, source_key


def _rank_fn(ctx, arg):  # a stand-in rank function: the key names it by module and qualified name
    return arg


def _other_rank_fn(ctx, arg):
    return arg


def harmless_hook() -> None:
    """A rank hook that does nothing: the store is off for any hook, whatever it does."""


# --------------------------------------------------------------------------- the key

BASE = dict(fn=_rank_fn, arg=("gpt-gqa", get_model("gpt-gqa"), Topology.parse("tp2"), "fp32", backends.resolve("mcore_dist"),
                              str(PLACEHOLDER / "ckpt")),
            topo=Topology.parse("tp2"), knobs={"dist_backend": "auto", "launcher": "mp"}, package_versions={"torch": "2.14.1"})


def _key(**changed):
    kw = {**BASE, **changed}
    return source_key(kw["fn"], kw["arg"], kw["topo"], kw["knobs"], kw["package_versions"])


def _arg_with(i, value):
    arg = list(BASE["arg"])
    arg[i] = value
    return tuple(arg)


@pytest.mark.parametrize("what, changed", [
    ("rank function", dict(fn=_other_rank_fn)),
    ("model seed", dict(arg=_arg_with(1, get_model("gpt-gqa").with_seed(get_model("gpt-gqa").seed + 1)))),
    ("model", dict(arg=_arg_with(1, get_model("gpt-tied")))),
    ("source topology in the argument", dict(arg=_arg_with(2, Topology.parse("pp2")))),
    ("dtype", dict(arg=_arg_with(3, "bf16"))),
    ("backend options", dict(arg=_arg_with(4, backends.resolve("mcore_dist", {"fully_parallel_save": False})))),
    ("output layout", dict(arg=_arg_with(5, str(PLACEHOLDER / "other")))),
    ("world topology", dict(topo=Topology.parse("dp2"))),
    ("dist backend", dict(knobs={"dist_backend": "nccl", "launcher": "mp"})),
    ("launcher", dict(knobs={"dist_backend": "auto", "launcher": "torchrun"})),
    ("package versions", dict(package_versions={"torch": "2.15.0"})),
])
def test_every_input_changes_the_key(what, changed):
    assert _key() == _key(), "the key must be a function of its inputs"
    assert _key(**changed) != _key(), f"a change of the {what} must give a new key"


def test_the_key_refuses_an_argument_shown_by_address():
    with pytest.raises(ValueError, match="plain value"):
        source_key(_rank_fn, object(), None, {})


# --------------------------------------------------------------------------- the store

def _write(d: Path, text: str = "weights") -> str:
    (d / "ckpt").mkdir()
    (d / "ckpt" / "shard.bin").write_text(text)
    return f"values of {text}"


def test_the_second_case_gets_the_first_ones_world_without_running_it(tmp_path):
    store, made = SourceStore(tmp_path), []
    d1, v1, u1 = store.get_or_make("a" * 64, "save", "case-1", lambda d: made.append(d) or _write(d))
    d2, v2, u2 = store.get_or_make("a" * 64, "save", "case-2", lambda d: made.append(d) or _write(d, "other"))
    assert made == [d1] and d1 == d2 and v1 == v2 == "values of weights"
    assert (u1.role, u2.role, u2.writer) == ("wrote", "reused", "case-1")
    _, _, u3 = store.get_or_make("b" * 64, "save", "case-3", _write)
    assert u3.role == "wrote", "another key is another entry"


def test_a_make_that_raises_leaves_no_entry(tmp_path):
    store = SourceStore(tmp_path)

    def broken(d):
        _write(d)
        raise RuntimeError("the world died")

    with pytest.raises(RuntimeError):
        store.get_or_make("c" * 64, "save", "case-1", broken)
    _, value, use = store.get_or_make("c" * 64, "save", "case-2", _write)
    assert use.role == "wrote" and value == "values of weights"


def test_a_changed_entry_fails_verification_and_is_set_aside(tmp_path):
    store = SourceStore(tmp_path)
    d, _, use = store.get_or_make("d" * 64, "save", "case-1", _write)
    assert store.verify(use) == []
    (d / "ckpt" / "shard.bin").write_text("weightz")
    (d / "ckpt" / "extra").write_text("")
    assert store.verify(use) == ["changed ckpt/shard.bin", "added ckpt/extra"]
    assert not (tmp_path / use.key).exists() and list(tmp_path.glob(f"{use.key}.changed-*")), "kept for inspection, out of the way"
    _, _, again = store.get_or_make("d" * 64, "save", "case-2", _write)
    assert again.role == "wrote", "the next case with the key writes it anew"


def test_manifest_hashes_content(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    before = manifest(tmp_path)
    (tmp_path / "a").write_bytes(b"y")
    assert manifest(tmp_path) != before


# --------------------------------------------------------------------------- real cases

def _spec(case, model, src, dst, backend="mcore_dist", **opts):
    return CaseSpec(case, model, backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())), timeout_s=240)


SHARED = [  # each pair shares its source world (and the HF cases their fixture)
    _spec("reshard-weights", "gpt-gqa", "tp2", "tp1"), _spec("reshard-weights", "gpt-gqa", "tp2", "pp2"),
    _spec("reshard-optimizer", "gpt-gqa", "dp2", "tp1", sharding="fully_reshardable"),
    _spec("reshard-optimizer", "gpt-gqa", "dp2", "tp2", sharding="fully_reshardable"),
    _spec("resume", "gpt-gqa", "dp2", "tp1", sharding="fully_reshardable"), _spec("resume", "gpt-gqa", "dp2", "tp2", sharding="fully_reshardable"),
    _spec("hf-roundtrip", "hf-llama", "tp2", "pp2", backend="bridge_hf"), _spec("hf-roundtrip", "hf-llama", "tp2", "tp1", backend="bridge_hf"),
    _spec("peft-export", "hf-llama", "tp2", "pp2", backend="bridge_peft"),
    _spec("peft-export", "hf-llama", "tp2", "tp1", backend="bridge_peft"),
]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """The pairs with the store, and the same cases without it, once per session: the tests that use
    it are one xdist_group (conftest.py keeps groups on one worker under pytest 9, where xdist 3.8.0
    alone did not, and both workers computed it, 45-60 s each)."""
    root = tmp_path_factory.mktemp("reuse")
    sources = root / "sources"
    with_store = run_cases(SHARED, RunOptions(workdir=root / "work", sources=sources, keep=True))
    without = run_cases(SHARED, RunOptions(workdir=root / "work-plain", reuse=False))
    return with_store, without, sources


@pytest.mark.xdist_group("reuse-shared-runs")  # one worker computes the shared runs, not both
def test_each_pair_writes_once_and_reuses_once(shared_runs):
    with_store, _, _ = shared_runs
    for first, second in zip(with_store[::2], with_store[1::2]):
        assert first.status == second.status == "passed", (first.failure_text(), second.failure_text())
        assert [u["role"] for u in first.reuse if u["phase"] == "save"] == ["wrote"]
        assert [(u["role"], u["writer"]) for u in second.reuse if u["phase"] == "save"] == [("reused", first.id)]
        assert "save" not in second.phases, "a reused world does not run"
        assert any("reused" in n for n in second.notes)


@pytest.mark.xdist_group("reuse-shared-runs")  # one worker computes the shared runs, not both
def test_loaders_never_change_a_reused_source(shared_runs):
    """Every case that used a stored source re-hashed it when it ended, and the store's manifests
    (taken when each entry was written) still hold after every case ran."""
    with_store, _, sources = shared_runs
    for r in with_store:
        checks = [c for c in r.checks if c.name == SOURCE_UNCHANGED]
        assert checks and all(c.status == "passed" for c in checks), r.id
    import json

    entries = [p for p in sources.iterdir() if p.is_dir()]
    assert len(entries) == 6, "five source worlds and one fixture (hf-roundtrip's and peft-export's hf-llama base is the same)"
    for entry in entries:
        assert manifest(entry / "data") == json.loads((entry / "source.json").read_text())["manifest"], entry.name


@pytest.mark.xdist_group("reuse-shared-runs")  # one worker computes the shared runs, not both
def test_reuse_gives_the_same_outcome_as_running_every_world(shared_runs):
    with_store, without, _ = shared_runs
    for a, b in zip(with_store, without):
        assert not b.reuse and all(c.name != SOURCE_UNCHANGED for c in b.checks)
        assert {c.name: c.status for c in a.checks if c.name != SOURCE_UNCHANGED} == {c.name: c.status for c in b.checks}, a.id


def test_a_loader_that_writes_into_a_shared_source_fails_and_the_next_case_gets_a_fresh_one(tmp_path):
    backends.register("writes-into-source", "doubles:LoadWritesIntoSource")
    try:
        specs = [_spec("reshard-weights", "gpt-gqa", "tp2", "tp1", backend="writes-into-source"),
                 _spec("reshard-weights", "gpt-gqa", "tp2", "pp2", backend="writes-into-source")]
        first, second = run_cases(specs, RunOptions(workdir=tmp_path, sources=tmp_path / "sources"))
    finally:
        backends.unregister("writes-into-source")
    for r in (first, second):
        check = r.check(SOURCE_UNCHANGED)
        assert r.status == "failed" and check.status == "failed" and "added ckpt-source/loaded-by-me.txt" in check.detail, r.id
        assert [u["role"] for u in r.reuse] == ["wrote"], "the damaged entry was set aside: the second case wrote its own"
    assert len(list((tmp_path / "sources").glob("*.changed-*"))) == 2


def test_no_reuse_and_rank_hooks_run_their_own_worlds(tmp_path):
    spec = _spec("reshard-weights", "gpt-gqa", "tp1", "tp2")
    assert not run_case(spec, RunOptions(workdir=tmp_path, reuse=False, sources=tmp_path / "s")).reuse
    hooked = RunOptions(workdir=tmp_path, sources=tmp_path / "s", rank_hooks=("test_reuse:harmless_hook",))
    assert not run_case(spec, hooked).reuse, "a rank hook may damage what a world writes"
    assert run_case(spec, RunOptions(workdir=tmp_path, sources=tmp_path / "s")).reuse, "and the same spec plainly does use the store"
    assert not [p for p in os.listdir(tmp_path / "s") if not p.endswith(".lock") and "changed" not in p][1:], "one entry"


def test_a_budget_on_a_reused_world_is_judged_on_the_writers_measurement(tmp_path):
    spec = _spec("reshard-weights", "gpt-gqa", "tp1", "tp2")
    opts = RunOptions(workdir=tmp_path, sources=tmp_path / "s")
    first = run_case(replace(spec, budgets=(Budget("save", max_peak_delta_mib=4096),)), opts)
    tight = run_case(replace(spec, target=Topology.parse("pp2"), budgets=(Budget("save", max_peak_delta_mib=0.0),)), opts)
    assert first.status == "passed" and [u["role"] for u in tight.reuse] == ["reused"]
    assert tight.memory["save"]["0"]["measured_by"] == first.id and "measured_by" not in first.memory["save"]["0"]
    check = tight.check("memory-budget:save@rank0")
    assert check.status == "failed" and f"measured by {first.id}" in check.detail, "the writer's measurement, judged and named"


def test_parallel_workers_take_the_writers_first():
    specs = [SHARED[0], SHARED[1], SHARED[2], SHARED[3], SHARED[4]]
    assert writers_first(specs) == [0, 2, 4, 1, 3]
