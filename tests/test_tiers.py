"""The test suite's tiers (matrices/tiers.yaml, harness/orchestration/tiers.py): every matrix case
is in exactly one tier, each block of the default-tier matrices keeps exactly one case in the main
job or the default tier, nothing listed is stale, and pytest deselects exactly what the list names."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration import tiers
from harness.orchestration.matrix import load_matrix

ROOT = Path(__file__).resolve().parent.parent
MATRICES = ROOT / "matrices"
#: every matrix pytest collects, the default-tier ones first in the order the rule reads them
DEFAULT_MARKS = "not slow and not memory and not gpu and not arch and not main_job"  # scripts/test's
EVERY = [*tiers.DEFAULT_MATRICES, *sorted(p.name for p in MATRICES.glob("*.yaml")
                                          if p.name not in (tiers.FILE, "gate.yaml", *tiers.DEFAULT_MATRICES))]


@functools.lru_cache(maxsize=None)
def _own(name: str) -> list[CaseSpec]:
    return load_matrix(MATRICES / name).own()


def _problems(t: tiers.Tiers) -> list[str]:
    """What breaks the rules, given tiers.yaml as read (the real one, or a planted one)."""
    bad = []
    blocks: dict[str, list[str]] = {}
    for name in EVERY:
        specs = _own(name)
        ids = {s.id for s in specs}
        bad += [f"{name}: {i} is listed but no such case" for i in sorted(t.slow.get(name, frozenset()) - ids)]
        for s in specs:
            where = tiers.tier(s, t.slow.get(name, frozenset()), name in t.main)
            if len(where) > 1:
                bad.append(f"{name}: {s.id} is in {len(where)} tiers: {where}")
            if name in tiers.DEFAULT_MATRICES and not any(m in s.markers for m in tiers.TIERS):
                blocks.setdefault(tiers.block(s), []).append((f"{name}: {s.id}", where))
    for key, members in blocks.items():
        main = [m for m, where in members if where == ["main_job"]]
        default = [m for m, where in members if where == []]
        if not main and len(default) != 1:  # the main job runs the block, or the default tier runs it once
            bad.append(f"block {key}: {len(default)} case(s) in the default tier, want 1: {[m for m, _ in members][:3]}")
        if main and default:
            bad.append(f"block {key}: the main job runs it and the default tier again: {default[:3]}")
    bad += [f"{name}: not a matrix file" for name in [*t.slow, *t.main] if name not in EVERY]
    return bad


def test_every_case_is_in_one_tier_and_every_block_keeps_one_case():
    t = tiers.load(MATRICES)
    assert t.main and t.slow, f"{MATRICES / tiers.FILE}: no tiers"
    want = tiers.rule(((n, _own(n)) for n in tiers.DEFAULT_MATRICES), t.main)
    assert _problems(t) == [], "the list the rule gives:\n" + tiers.render(want, t.main)


def test_the_rules_go_red_on_a_planted_list():
    t = tiers.load(MATRICES)
    ext = [s for s in _own("extended.yaml") if not tiers.tier(s, t.slow["extended.yaml"])]
    kept = ext[0]  # a block's one default case
    # the kept case moved too, a stale id, a case in two tiers, an unknown file
    planted = tiers.Tiers(t.main | {"nope.yaml"}, {**t.slow, "extended.yaml": t.slow["extended.yaml"] | {kept.id, "reshard-weights[nope]"},
                                                   "memory.yaml": frozenset({_own("memory.yaml")[0].id})})
    bad = _problems(planted)
    assert any("0 case(s) in the default tier" in b and kept.id in b for b in bad), bad
    assert "extended.yaml: reshard-weights[nope] is listed but no such case" in bad
    assert any(b.startswith("memory.yaml:") and "2 tiers" in b for b in bad), bad
    assert "nope.yaml: not a matrix file" in bad
    # a block with two default cases: one listed case put back
    back = sorted(t.slow["extended.yaml"])[0]
    two = _problems(tiers.Tiers(t.main, {**t.slow, "extended.yaml": t.slow["extended.yaml"] - {back}}))
    assert any(("2 case(s) in the default tier" in b or "the main job runs it and the default tier again" in b) and back in b
               for b in two), two
    # smoke out of the main job: its multi-pair blocks keep every pair in the default tier
    assert any("case(s) in the default tier, want 1" in b for b in _problems(tiers.Tiers(frozenset(), t.slow)))
    assert _problems(tiers.Tiers()) != []


def test_the_rule_keeps_the_first_case_of_a_block_and_skips_tiered_cases():
    a = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=2), Topology(pp=2), markers=("smoke",))
    b = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=2), Topology(dp=2), markers=("smoke",))
    c = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=4), Topology(dp=2), markers=("memory",))
    d = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=4), Topology(dp=4), options=(("x", 1),))
    e = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=4), Topology(pp=4))
    assert tiers.rule([("smoke.yaml", [a, b, c]), ("extended.yaml", [d, e])]) == {"smoke.yaml": [b.id], "extended.yaml": [e.id]}
    # the main job's file keeps its blocks and is never listed
    assert tiers.rule([("smoke.yaml", [a, b, c]), ("extended.yaml", [d, e])], ["smoke.yaml"]) == {"extended.yaml": [e.id]}
    assert tiers.tier(b, frozenset({b.id})) == ["slow"] and tiers.tier(a) == [] and tiers.tier(c, frozenset({c.id})) == ["slow", "memory"]
    assert tiers.tier(a, main=True) == ["main_job"]
    t = tiers.Tiers(frozenset({"smoke.yaml"}), {"extended.yaml": frozenset({e.id})})
    assert t.markers(a, "smoke.yaml") == ["main_job"] and t.markers(e, "extended.yaml") == ["slow"] and t.markers(d, "extended.yaml") == []


@pytest.mark.parametrize("text, says", [("[1]", "a mapping with the keys"), ("slow: [a]", "a mapping of matrix file"),
                                        ("slow: {smoke.yaml: [a, a]}", "a is listed twice"), ("fast: {}", "a mapping with the keys"),
                                        ("main_job: smoke.yaml", "a list of matrix file names"),
                                        ("{main_job: [smoke.yaml], slow: {smoke.yaml: [a]}}", "the file is main_job's")])
def test_a_malformed_list_is_refused_naming_the_file(tmp_path, text, says):
    (tmp_path / tiers.FILE).write_text(text)
    with pytest.raises(tiers.TiersError, match=says) as exc:
        tiers.load(tmp_path)
    assert str(tmp_path / tiers.FILE) in str(exc.value)


def test_pytest_deselects_exactly_the_listed_cases():
    t = tiers.load(MATRICES)
    got = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-p", "no:xdist",
                          "-m", DEFAULT_MARKS, "matrices/smoke.yaml", "matrices/verl.yaml"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    ids = {line.split("::", 1)[1] for line in got.stdout.splitlines() if "::" in line}
    verl = {s.id for s in _own("verl.yaml") if not any(m in s.markers for m in tiers.TIERS)}
    assert ids == verl - t.slow["verl.yaml"] and ids, sorted(ids ^ (verl - t.slow["verl.yaml"]))[:3]
    assert "smoke.yaml" in t.main  # and none of smoke's cases were collected: the main job runs them


def test_scripts_test_filters_the_tiers_this_file_checks():
    assert re.search(r'^marks="' + re.escape(DEFAULT_MARKS) + '"', (ROOT / "scripts" / "test").read_text(), re.M)
    assert all(f"not {t}" in DEFAULT_MARKS for t in tiers.TIERS)
