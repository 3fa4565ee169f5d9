"""The test suite's tiers (matrices/tiers.yaml, harness/orchestration/tiers.py): every matrix case
is in exactly one tier, each block of the default-tier matrices keeps exactly one case in the default
tier, nothing listed is stale, and pytest deselects exactly what the list names."""

from __future__ import annotations

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
EVERY = [*tiers.DEFAULT_MATRICES, *sorted(p.name for p in MATRICES.glob("*.yaml")
                                          if p.name not in (tiers.FILE, "gate.yaml", *tiers.DEFAULT_MATRICES))]


def _own(name: str) -> list[CaseSpec]:
    return load_matrix(MATRICES / name).own()


def _problems(listed: dict[str, frozenset[str]]) -> list[str]:
    """What breaks the rules, given the listed ids per file (the real list, or a planted one)."""
    bad = []
    blocks: dict[str, list[str]] = {}
    for name in EVERY:
        specs = _own(name)
        ids = {s.id for s in specs}
        bad += [f"{name}: {i} is listed but no such case" for i in sorted(listed.get(name, frozenset()) - ids)]
        for s in specs:
            where = tiers.tier(s, listed.get(name, frozenset()))
            if len(where) > 1:
                bad.append(f"{name}: {s.id} is in {len(where)} tiers: {where}")
            if name in tiers.DEFAULT_MATRICES and not any(t in s.markers for t in tiers.TIERS):
                blocks.setdefault(tiers.block(s), []).append(f"{name}: {s.id}" + ("" if where else " (default)"))
    for key, members in blocks.items():
        default = [m for m in members if m.endswith(" (default)")]
        if len(default) != 1:
            bad.append(f"block {key}: {len(default)} case(s) in the default tier, want 1: {members[:3]}")
    bad += [f"{name}: not a matrix file" for name in listed if name not in EVERY]
    return bad


def test_every_case_is_in_one_tier_and_every_block_keeps_one_default_case():
    listed = tiers.load(MATRICES)
    assert listed, f"{MATRICES / tiers.FILE}: no slow list"
    want = tiers.rule((n, _own(n)) for n in tiers.DEFAULT_MATRICES)
    assert _problems(listed) == [], "the list the rule gives:\n" + tiers.render(want)


def test_the_rules_go_red_on_a_planted_list():
    listed = dict(tiers.load(MATRICES))
    smoke = _own("smoke.yaml")
    first = smoke[0]
    # the one default case of a block moved too, a stale id, a case in two tiers, an unknown file
    planted = {**listed, "smoke.yaml": listed["smoke.yaml"] | {first.id, "reshard-weights[nope]"},
               "memory.yaml": frozenset({_own("memory.yaml")[0].id}), "nope.yaml": frozenset()}
    bad = _problems(planted)
    assert any("0 case(s) in the default tier" in b and first.id in b for b in bad), bad
    assert "smoke.yaml: reshard-weights[nope] is listed but no such case" in bad
    assert any(b.startswith("memory.yaml:") and "2 tiers" in b for b in bad), bad
    assert "nope.yaml: not a matrix file" in bad
    # a block with two default cases: one listed case put back
    back = next(iter(sorted(listed["smoke.yaml"])))
    two = _problems({**listed, "smoke.yaml": listed["smoke.yaml"] - {back}})
    assert any("2 case(s) in the default tier" in b and back in b for b in two), two
    assert _problems({}) != []  # no list at all: every multi-pair block has too many


def test_the_rule_keeps_the_first_case_of_a_block_and_skips_tiered_cases():
    a = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=2), Topology(pp=2), markers=("smoke",))
    b = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=2), Topology(dp=2), markers=("smoke",))
    c = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=4), Topology(dp=2), markers=("memory",))
    d = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=4), Topology(dp=4), options=(("x", 1),))
    assert tiers.rule([("smoke.yaml", [a, b, c]), ("extended.yaml", [d])]) == {"smoke.yaml": [b.id]}
    assert tiers.tier(b, frozenset({b.id})) == ["slow"] and tiers.tier(a) == [] and tiers.tier(c, frozenset({c.id})) == ["slow", "memory"]


@pytest.mark.parametrize("text, says", [("[1]", "a mapping with one key"), ("slow: [a]", "a mapping of matrix file"),
                                        ("slow: {smoke.yaml: [a, a]}", "a is listed twice"), ("fast: {}", "one key")])
def test_a_malformed_list_is_refused_naming_the_file(tmp_path, text, says):
    (tmp_path / tiers.FILE).write_text(text)
    with pytest.raises(tiers.TiersError, match=says) as exc:
        tiers.load(tmp_path)
    assert str(tmp_path / tiers.FILE) in str(exc.value)


def test_pytest_deselects_exactly_the_listed_cases():
    listed = tiers.load(MATRICES)
    got = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-p", "no:xdist",
                          "-m", "not slow and not memory and not gpu and not arch", "matrices/smoke.yaml", "matrices/verl.yaml"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    ids = {line.split("::", 1)[1] for line in got.stdout.splitlines() if "::" in line}
    for name in ("smoke.yaml", "verl.yaml"):
        own = {s.id for s in _own(name) if not any(t in s.markers for t in tiers.TIERS)}
        chosen = {i for i in ids if i in own}
        assert chosen == own - listed[name], f"{name}: {sorted(chosen ^ (own - listed[name]))[:3]}"
        assert chosen, name
