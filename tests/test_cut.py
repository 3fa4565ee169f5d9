"""`--max-world N`: the cutting rule (dp, then cp, pp, tp; vpp/ep kept), matrices cut and
deduplicated with the written pair in each case's notes, and a cut the case refuses named."""

from __future__ import annotations

import json
import textwrap

import pytest

from harness.cli import main
from harness.core.cut import cut
from harness.core.topology import Topology
from harness.orchestration.matrix import MatrixError, load_matrix

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("written, n, expect", [
    ("tp2pp2dp2", 2, "tp2"),       # dp goes, then pp
    ("tp2pp2dp2", 4, "tp2pp2"),    # dp alone is enough
    ("tp4", 2, "tp2"),             # tp only when nothing else is left
    ("tp2dp4", 2, "tp2"),
    ("tp1dp4", 2, "dp2"),          # the largest divisor that fits, not 1
    ("cp2dp2", 2, "cp2"),          # dp before cp
    ("pp2cp2", 2, "pp2"),          # cp before pp
    ("tp2pp2cp2", 4, "tp2pp2"),
    ("dp3", 2, "dp1"),             # 3's divisors are 3 and 1
    ("tp8", 4, "tp4"),
    ("tp2pp2", 8, "tp2pp2"),       # fits: unchanged
    ("tp2pp2dp2", 1, "tp1"),
])
def test_cut_rule(written, n, expect):
    got = cut(Topology.parse(written), n)
    assert got == Topology.parse(expect) and got.world_size <= n


def test_cut_keeps_other_fields_and_refuses_zero():
    # vpp/ep are validated by Topology itself; the cut never touches them (dataclasses.replace)
    t = Topology(tp=2, dp=4)
    assert cut(t, 4).vpp == t.vpp and cut(t, 4).ep == t.ep
    with pytest.raises(ValueError, match="--max-world must be >= 1"):
        cut(t, 0)


MATRIX = """
name: c
defaults: {max_world_size: 8}
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp2pp2dp2 -> tp4", "tp2dp4 -> tp4", "tp1 -> tp2"]
"""


def _write(tmp_path, body: str):
    p = tmp_path / "m.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_matrix_cut_dedups_and_notes_the_written_pairs(tmp_path):
    p = _write(tmp_path, MATRIX)
    assert len(load_matrix(p).cases) == 3
    cases = load_matrix(p, max_world=2).cases
    assert [c.id for c in cases] == [
        "reshard-weights[mcore_dist-gpt-gqa-tp2pp1dp1cp1->tp2pp1dp1cp1]",  # both written pairs collapse to tp2 -> tp2
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]",  # fits: untouched, no note
    ]
    assert cases[0].notes == (
        "cut to --max-world 2: written as tp2pp2dp2cp1 -> tp4pp1dp1cp1",
        "also covers tp2pp1dp4cp1 -> tp4pp1dp1cp1 (same case after the cut)",
    )
    assert cases[1].notes == ()


def test_a_cut_that_leaves_nothing_to_refuse_is_a_matrix_error(tmp_path):
    p = _write(tmp_path, """
        entries:
          - case: reshard-optimizer
            models: [gpt-gqa]
            pairs: ["tp2dp2 -> tp4"]
            axes: {sharding: [dp_reshardable]}
            expect: refuse
    """)
    with pytest.raises(MatrixError, match=r"entries\[0\].*cut to --max-world 2 as tp2pp1dp1cp1 -> tp2pp1dp1cp1.*no reshard is left to refuse"):
        load_matrix(p, max_world=2)


def test_cli_list_and_run_take_max_world(tmp_path, capsys):
    p = _write(tmp_path, MATRIX)
    assert main(["list", str(p), "--max-world", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "# cut to --max-world 2: written as tp2pp2dp2cp1 -> tp4pp1dp1cp1" in out[0]
    assert main(["list", str(p), "--max-world", "0"]) == 2
    rep = tmp_path / "r"
    assert main(["run", str(p), "--max-world", "2", "-k", "->tp2pp1dp1cp1] tp2pp1dp1cp1->", "--report", str(rep), "--dist-backend", "gloo"]) == 0
    (r,) = json.loads((rep / "results.json").read_text())["results"]
    assert r["status"] == "passed" and "cut to --max-world 2: written as tp2pp2dp2cp1 -> tp4pp1dp1cp1" in r["notes"]


def test_pytest_option_cuts_the_collected_cases(pytester):
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "c.yaml").write_text(textwrap.dedent(MATRIX))
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "--ckpt-max-world", "2")
    result.stdout.fnmatch_lines(["*tp2pp1dp1cp1->tp2pp1dp1cp1*", "*tp1pp1dp1cp1->tp2pp1dp1cp1*", "*2 tests collected*"])


def test_cases_of_different_entries_colliding_after_the_cut_are_an_error_unless_tagged(tmp_path):
    body = """
        entries:
          - {case: reshard-weights, models: [gpt-gqa], pairs: ["tp2dp2 -> tp1"]}
          - {case: reshard-weights, models: [gpt-gqa], pairs: ["tp2cp2 -> tp1"], options: {layer_spec: te}%s}
    """
    with pytest.raises(MatrixError, match=r"entries\[1\].*becomes .*tp2pp1dp1cp1->tp1pp1dp1cp1\], which .*entries\[0\] defines differently"):
        load_matrix(_write(tmp_path, body % ""), max_world=2)
    ids = [c.id for c in load_matrix(_write(tmp_path, body % ", tag: te"), max_world=2).cases]
    assert ids == ["reshard-weights[mcore_dist-gpt-gqa-tp2pp1dp1cp1->tp1pp1dp1cp1]",
                   "reshard-weights[mcore_dist-gpt-gqa-tp2pp1dp1cp1->tp1pp1dp1cp1-te]"]


def test_a_cut_topology_that_cannot_exist_is_a_matrix_error_naming_the_entry(tmp_path, monkeypatch):
    """E.g. an EP topology whose world no longer divides by ep*etp*pp once dp is cut (ep is kept):
    Topology raises, the loader names the entry."""
    import harness.core.cut
    from harness.core.topology import TopologyError

    def impossible(topo, n):
        raise TopologyError(f"{topo.id}: world size 2 is not divisible by etp*ep*pp = 1*4*1")

    monkeypatch.setattr(harness.core.cut, "cut", impossible)
    with pytest.raises(MatrixError, match=r"entries\[0\].*cannot be cut to --max-world 2: .*not divisible by etp\*ep\*pp"):
        load_matrix(_write(tmp_path, MATRIX), max_world=2)
