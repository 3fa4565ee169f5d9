"""harness.compat.registry: one Shim record shape, one registry collected per compat module (no hand
wiring), every record complete, names unique, no table of shims or workarounds outside the
convention, and every workaround name a matrix or an option uses resolves to its record."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from harness.compat import _shim, registry
from harness.compat._shim import ADAPTS, HIDES, INSTALL, KINDS, REQUIRE, SWITCHES, Shim

ROOT = Path(__file__).resolve().parent.parent
#: a top-level name that holds a table of shims or workarounds


def incomplete(shim: Shim) -> list[str]:
    """What a record lacks (empty: complete)."""
    out = [f for f in ("name", "upstream", "why", "probe", "retire_when") if not str(getattr(shim, f)).strip()]
    if shim.kind not in KINDS:
        out.append(f"kind {shim.kind!r}")
    if shim.apply is None and not shim.applied_in:
        out.append("apply (or applied_in)")
    if shim.trigger in (INSTALL, REQUIRE) and not callable(shim.needed):
        out.append("needed (a probe install/require can call)")
    if shim.kind == HIDES and not (shim.shown_by and shim.switch):
        out.append("shown_by and switch (a hidden defect must be switchable and shown without it)")
    if shim.switch and shim.kind != HIDES:
        out.append("a switched record HIDES a defect")
    if re.search(r"__version__|importlib\.metadata|packaging\.version", shim.probe):
        out.append("probe names a version")
    return out


def test_every_record_is_complete():
    records = registry.records()
    assert len(records) >= 30 and {s.kind for s in records.values()} == set(KINDS)
    assert {n: incomplete(s) for n, s in records.items() if incomplete(s)} == {}
    # the check itself bites: a record with an empty why, no probe, no apply, a HIDES without its xfail
    bare = Shim(name="x", upstream="u", why=" ", probe="", retire_when="r", kind=HIDES)
    assert set(incomplete(bare)) >= {"why", "probe", "apply (or applied_in)",
                                     "shown_by and switch (a hidden defect must be switchable and shown without it)"}
    with pytest.raises(ValueError, match="kind"):
        Shim(name="x", upstream="u", why="w", probe="p", retire_when="r", kind="maybe")


@pytest.fixture
def plant(tmp_path, monkeypatch):
    """plant(files) -> the name of a fresh package under tmp_path holding `files` (gone after the test)."""
    made: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(files: dict[str, str]) -> str:
        name = f"planted_compat_{len(made)}"
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
        made.append(name)
        return name

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] in made]:
        del sys.modules[name]


RECORD = '''from harness.compat._shim import ADAPTS, CALLER, Shim
SHIMS = (Shim(name={name!r}, upstream="somepkg.mod", why="w", probe="p", retire_when="r", kind=ADAPTS,
              trigger=CALLER, apply=lambda: None),)
'''


def test_the_registry_collects_a_planted_modules_records_without_wiring(plant):
    pkg = plant({"upstream_a.py": RECORD.format(name="planted shim"),
                 "_helper.py": "SHIMS = ('not a record: _-prefixed modules are helpers',)\n",
                 "quiet.py": "SHIMS = ()\n"})
    found = registry.collect(pkg)
    assert list(found) == ["planted shim"] and found["planted shim"].upstream == "somepkg.mod"
    assert [m.__name__ for m in registry.modules(pkg)] == [f"{pkg}.quiet", f"{pkg}.upstream_a"]
    assert registry.collect(plant({})) == {}


def test_a_module_without_the_conventional_name_or_with_a_duplicate_is_refused(plant):
    with pytest.raises(ValueError, match="'twice' is defined twice"):
        registry.collect(plant({"a.py": RECORD.format(name="twice"), "b.py": RECORD.format(name="twice")}))
    with pytest.raises(LookupError, match="has no SHIMS"):
        registry.collect(plant({"forgot.py": "X = 1\n"}))
    with pytest.raises(TypeError, match="not a Shim"):
        registry.collect(plant({"wrong.py": "SHIMS = ({'name': 'a dict'},)\n"}))


def test_names_and_result_labels_are_unique_across_the_registry():
    every = [s for m in registry.modules() for s in m.SHIMS]
    assert every and len(every) == len(registry.records())  # none lost to a shared name
    labels = [s.label for s in every]
    assert len(set(labels)) == len(labels)
    assert registry.by_label("checkpoint_inspector reads megatron-core 0.19's common state").name == "common_state"


def test_lookups_by_upstream_kind_trigger_and_switch():
    records = registry.records()
    core = registry.by_upstream("megatron.core")
    assert core and all(s.upstream.startswith("megatron.core.") or s.upstream == "megatron.core" for s in core)
    assert not any(s.upstream.startswith("megatron.bridge") for s in core)
    assert {s.name for s in registry.by_upstream("megatron.bridge")} >= {"megatron.bridge peft HAVE_TE=False"}
    assert registry.by_upstream("megatron.co") == ()  # a dotted prefix, not a string prefix
    adapts, hides = registry.by_kind(ADAPTS), registry.by_kind(HIDES)
    assert adapts and hides and len(adapts) + len(hides) == len(records)
    assert {s.name for s in hides} == {n for sw in SWITCHES for n in registry.switched(sw)}
    assert "cuda.current_device" in {s.name for s in registry.by_trigger(INSTALL)}
    with pytest.raises(KeyError, match="known"):
        registry.get("no such shim")
    with pytest.raises(ValueError):
        registry.switched("nowhere")


#: the names and defaults each option had before the records (a name must keep working in matrices/*.yaml)
OPTION_NAMES = {
    "training": ("prime_adam", "load_no_grad", "fully_reshardable_step", "unshare_adam_step", "vpp_overlap_p2p"),
    "verl": ("verl_fresh_model_sd", "verl_async_calls_module", "verl_async_strategy_mcore", "verl_async_one_at_a_time",
             "mbridge_encoder_and_decoder"),
    "fsdp": ("fsdp_adam_state", "fsdp_swiglu_lookup", "fsdp_load_keys"),
    "converter": ("common_state",),
}


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_option_keeps_its_names_and_defaults(switch):
    assert registry.defaults(switch) == OPTION_NAMES[switch]
    assert tuple(registry.switched(switch)) == OPTION_NAMES[switch]
    registry.check(switch, OPTION_NAMES[switch][:1], "x")
    with pytest.raises(ValueError, match=re.escape(f"unknown x ['bogus']; known: {sorted(OPTION_NAMES[switch])}")):
        registry.check(switch, ("bogus", *OPTION_NAMES[switch]), "x")


def _option_lists(entry: dict) -> dict[str, list[str]]:
    """The workaround lists a matrix entry gives, by the switch they belong to."""
    opts, bopts = entry.get("options") or {}, entry.get("backend_options") or {}
    out = {}
    if "workarounds" in opts:
        out["training"] = opts["workarounds"]
    if "converter_workarounds" in opts:
        out["converter"] = opts["converter_workarounds"]
    if "workarounds" in bopts:
        out["backend"] = bopts["workarounds"]
    return out


def _entries() -> list[tuple[str, dict]]:
    return [(p.name, e) for p in sorted((ROOT / "matrices").glob("*.yaml")) for e in yaml.safe_load(p.read_text()).get("entries") or []]


def test_every_workaround_name_a_matrix_lists_resolves_to_its_option():
    backend = set(registry.switched("verl")) | set(registry.switched("fsdp"))
    seen = 0
    for file, entry in _entries():
        for switch, names in _option_lists(entry).items():
            known = backend if switch == "backend" else set(registry.switched(switch))
            assert set(names) <= known, (file, entry.get("tag"), names)
            seen += len(names)
    assert seen > 20


def test_the_backends_refuse_an_unknown_workaround_with_their_known_names():
    from harness.backends.mcore_fsdp import McoreFsdpOptions
    from harness.backends.verl_manager import VerlOptions
    from harness.models.training import TrainOptions

    for options, switch in ((VerlOptions, "verl"), (McoreFsdpOptions, "fsdp"), (TrainOptions, "training")):
        assert options().workarounds == OPTION_NAMES[switch]
        with pytest.raises(ValueError, match=re.escape(f"['nope']; known: {sorted(OPTION_NAMES[switch])}")):
            options(workarounds=("nope",))


def test_each_hidden_defect_is_shown_by_a_strict_xfail_without_its_workaround():
    hides = registry.by_kind(HIDES)
    assert hides
    entries = _entries()
    for shim in hides:
        where, _, tag = shim.shown_by.partition(":")
        if where.startswith("tests/"):
            test = shim.shown_by.split("::")[1]
            assert f"def {test}(" in (ROOT / where.split("::")[0]).read_text(), shim.name
            continue
        shown = [e for f, e in entries if f"matrices/{f}" == where and e.get("tag") == tag]
        assert shown, f"{shim.name}: no entry tagged {tag} in {where}"
        for entry in shown:
            lists = _option_lists(entry)
            listed = lists.get(shim.switch, lists.get("backend")) if shim.switch in ("verl", "fsdp") else lists.get(shim.switch)
            assert entry.get("xfail") and listed is not None and shim.name not in listed, (shim.name, tag)


def test_the_gate_tells_an_adapting_shim_from_one_that_hides_a_defect():
    from harness.gate.evidence import shim_findings

    def doc(shims: list[str]) -> dict:
        return {"results": [{"id": "a[1]", "status": "passed", "compat_shims": shims}]}

    hides, adapts = registry.get("common_state"), registry.get("cuda.current_device")
    found = {f.case: f.detail for f in shim_findings(doc([]), doc([hides.label, adapts.label, "unregistered"]))}
    assert len(found) == 3
    assert f"hides an upstream defect ({hides.upstream}), shown without it by {hides.shown_by}" in found[f"workaround {hides.label}"]
    assert "adapts to an API or environment (torch.cuda)" in found["workaround cuda.current_device"]
    assert "hides" not in found["workaround unregistered"] and "adapts" not in found["workaround unregistered"]
