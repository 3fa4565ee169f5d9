import textwrap
from pathlib import Path

import pytest

from harness.matrix import MatrixError, load_matrix
from harness.topology import Topology

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, body: str) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
name: t
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp1 -> tp2", {source: pp2, target: tp2}]
    cross: {sources: [dp2], targets: [tp1, pp2]}
"""


def test_pairs_and_cross_product_expand(tmp_path):
    m = load_matrix(_write(tmp_path, GOOD))
    ids = [c.id for c in m.cases]
    assert ids == [
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp2dp1cp1->tp2pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp2dp1cp1]",
    ]
    assert m.select("pp2 ->tp2") == [m.cases[1]]


@pytest.mark.parametrize(
    "body, message",
    [
        ("entries: []", "'entries' must be a non-empty list"),
        ("bogus: 1\nentries: [{case: reshard-weights}]", "unknown top-level key(s) ['bogus']"),
        ("entries: [{models: [gpt-gqa], pairs: ['tp1 -> tp2']}]", "entries[0]: missing required key 'case'"),
        ("entries: [{case: nope, models: [gpt-gqa], pairs: ['tp1 -> tp2']}]", "entries[0].case: unknown case 'nope'"),
        ("entries: [{case: reshard-weights, models: [gpt-zzz], pairs: ['tp1 -> tp2']}]", "entries[0].models: unknown model 'gpt-zzz'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], backends: [zarr], pairs: ['tp1 -> tp2']}]", "unknown backend 'zarr'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 tp2']}]", "entries[0].pairs[0]: pair 'tp1 tp2' must look like"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tq2']}]", "entries[0].pairs[0]: cannot parse topology 'tq2'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> pp3']}]", "topology tp1pp3dp1cp1 cannot hold model 'gpt-gqa'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa]}]", "no topology pairs"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], typo: 1}]", "unknown key(s) ['typo']"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], markers: [fast]}]", "unknown marker(s) ['fast']"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], expect: maybe}]", "must be 'pass' or 'refuse'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], options: {x: 1}}]", "takes no options"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2', 'tp1 -> tp2']}]", "already defined by"),
        ("defaults: {max_world_size: 2}\nentries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp4']}]", "exceeds the 2 ranks"),
        ("entries: [{case: reshard-weights\n", "not valid YAML"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], memory_budgets: [{rank: 0}]}]", "memory_budgets[0]: a memory budget is"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], memory_budgets: [{phase: save}]}]", "sets no limit"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: r, checks: step}}]", "entries[0].xfail.checks: expected a list"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: r, match: '('}}]", "entries[0].xfail.match: bad regex"),
    ],
)
def test_bad_matrices_name_file_entry_and_key(tmp_path, body, message):
    path = _write(tmp_path, body)
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    assert message in str(exc.value)
    assert str(path) in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "absent.yaml")


def test_smoke_matrix_covers_every_kind_of_change():
    m = load_matrix(ROOT / "matrices" / "smoke.yaml")
    pairs = {(c.source, c.target) for c in m.cases if c.case == "reshard-weights"}
    assert len(pairs) >= 12
    assert all(t.world_size <= 4 for p in pairs for t in p)

    def some(pred):
        return any(pred(s, d) for s, d in pairs)

    assert some(lambda s, d: d.tp > s.tp) and some(lambda s, d: d.tp < s.tp)
    assert some(lambda s, d: d.pp > s.pp) and some(lambda s, d: d.pp < s.pp)
    assert some(lambda s, d: d.dp != s.dp) and some(lambda s, d: d.cp != s.cp)
    assert some(lambda s, d: sum(getattr(s, k) != getattr(d, k) for k in ("tp", "pp", "dp", "cp")) >= 2)
    assert some(lambda s, d: (s.world_size, d.world_size) == (1, 4))
    assert some(lambda s, d: (s.world_size, d.world_size) == (4, 1))
    assert {c.model for c in m.cases} >= {"gpt-gqa", "gpt-tied"}
    assert Topology.parse("tp1") in {s for s, _ in pairs}


def _xfail_result(failed, status="failed"):
    from harness.result import CaseResult, Check

    r = CaseResult("x", "c", "m", "b", "s", "t", status=status)
    r.checks = [Check(n, "failed" if n in failed else "passed") for n in ("step", "optimizer-state", "memory-budget:save@rank0")]
    return r


@pytest.mark.parametrize(
    "failed, status, why",
    [
        ({"step"}, "failed", ""),
        ({"step", "memory-budget:save@rank0"}, "failed", "failed too, beyond the expected"),
        ({"optimizer-state"}, "failed", "failed too"),
        (set(), "error", "errored instead"),
    ],
)
def test_xfail_checks_accept_only_the_named_failure(tmp_path, failed, status, why):
    """A known defect in one check must not hide a new failure in another check of the same case."""
    from harness.runner import _unexpected_failure

    path = _write(tmp_path, "entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: known, checks: [step]}}]")
    (spec,) = load_matrix(path).cases
    got = _unexpected_failure(spec, _xfail_result(failed, status))
    assert (why in got and got) if why else got == ""
