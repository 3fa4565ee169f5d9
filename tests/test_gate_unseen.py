"""Nothing unseen is certified (issue 44): each hole planted on REAL results of a small smoke slice
and handed to `ckpt-harness compare`, which decides as the gate decides (harness.gate.evidence.decide).
Each of these printed SAFE (exit 0) before; each must now end non-zero, and the unplanted pair must
stay SAFE (so every assertion here can fail both ways)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.cli import main
from harness.compat import registry

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "matrices" / "smoke.yaml"
PASSED = "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]"
#: a named defect (dp_reshardable resets the Adam step) whose failing checks carry a difference
DEFECT = "resume[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp1dp1cp1-dp_reshardable]"


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("real")
    subprocess.run([sys.executable, "-m", "harness.cli", "run", str(SMOKE), "--id", PASSED, "--id", DEFECT,
                    "--report", str(out), "--jobs", "2"], cwd=ROOT, check=False, capture_output=True)
    doc = json.loads((out / "results.json").read_text())
    status = {r["id"]: r["status"] for r in doc["results"]}
    assert status == {PASSED: "passed", DEFECT: "xfailed"}, status  # the slice the plants stand on
    return doc


@pytest.fixture
def gate(tmp_path, real, capsys) -> Callable[..., tuple[int, str]]:
    """compare(real, planted copy) -> (exit code, what it printed)."""
    def run(plant: Callable[[dict[str, dict]], None], *extra: str) -> tuple[int, str]:
        cand = copy.deepcopy(real)
        plant({r["id"]: r for r in cand["results"]})
        cand["results"] = [r for r in cand["results"] if not r.get("_gone")]
        for name, d in (("base", real), ("cand", cand)):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "results.json").write_text(json.dumps(d))
        code = main(["compare", str(tmp_path / "base"), str(tmp_path / "cand"), *extra])
        return code, capsys.readouterr().out

    return run


def test_the_unplanted_pair_is_safe(gate):
    code, out = gate(lambda cases: None)
    assert code == 0 and out.rstrip().endswith("**SAFE**: no regression."), out


def test_a_case_not_run_on_the_candidate_is_unevaluated_until_accepted(gate):
    def plant(cases):
        cases[PASSED].update(status="not-run", not_run_reason="needs the module megatron.core.dist_checkpointing")

    code, out = gate(plant)
    assert code == 2 and "**1 case(s) green on the baseline with no real result on the candidate**" in out, out
    assert "not-run on the candidate (needs the module megatron.core.dist_checkpointing)" in out
    code, out = gate(plant, "--accept-unevaluated", "reshard-weights[*")
    assert code == 0 and "accepted** by `--accept-unevaluated 'reshard-weights[*'`" in out, out


def test_a_case_that_vanished_from_the_candidate_is_unevaluated(gate):
    code, out = gate(lambda cases: cases[PASSED].update(_gone=True))
    assert code == 2 and "absent from the candidate's run" in out, out


def test_a_named_defect_a_million_times_worse_is_failing(gate):
    def plant(cases):
        for c in cases[DEFECT]["checks"]:
            if c["name"] == "losses":
                c["max_abs_diff"] *= 1e6

    code, out = gate(plant)
    assert code == 1 and "| defect-changed |" in out and "failing check losses" in out and "grew 1000000.0x" in out, out


def test_a_named_defect_turned_nan_is_failing(gate):
    def plant(cases):
        next(c for c in cases[DEFECT]["checks"] if c["name"] == "final-weights")["max_abs_diff"] = float("nan")

    code, out = gate(plant)
    assert code == 1 and "failing check final-weights" in out and "became nan" in out, out


def test_a_workaround_hiding_a_defect_on_the_candidate_only_is_failing(gate):
    hides = registry.by_kind("hides")[0]
    code, out = gate(lambda cases: cases[PASSED]["compat_shims"].append(hides.label))
    assert code == 1 and "hides-workarounds needed 1" in out and hides.shown_by in out, out


def test_a_passed_case_whose_judging_checks_all_went_not_run_is_failing(gate):
    def plant(cases):
        for c in cases[PASSED]["checks"]:
            if c["name"] != "source-unchanged":
                c.update(status="not-run", detail="nothing to compare")

    code, out = gate(plant)
    assert code == 1 and out.count("| check-lost |") == 5 and "judging checks lost 5" in out, out


def test_run_selects_exact_ids_and_names_one_it_lacks():
    """`run --id` (the gate's rerun): exactly the ids asked, in matrix order; an unknown id is an error."""
    from harness.orchestration.matrix import load_matrix

    m = load_matrix(SMOKE)
    assert [c.id for c in m.select(None, [DEFECT, PASSED])] == [c.id for c in m.cases if c.id in (PASSED, DEFECT)]
    assert len(m.select(None, [PASSED])) == 1 and PASSED.endswith("]")  # no other id contains it
    with pytest.raises(ValueError, match=r"no case 'resume\[nope\]'"):
        m.select(None, [PASSED, "resume[nope]"])
    with pytest.raises(ValueError, match="matching -k 'tp4'"):
        m.select("tp4", [PASSED])


def test_the_default_gate_selection_shows_every_hidden_defect_unpatched():
    """A workaround that hides a defect is failing on the candidate only; the gate must also see the
    defect itself on both sides: every `shown_by` matrix entry is in matrices/gate.yaml."""
    from harness.compat._shim import HIDES
    from harness.orchestration.matrix import load_matrix

    gate = load_matrix(ROOT / "matrices" / "gate.yaml")
    shown = [s.shown_by for s in registry.by_kind(HIDES) if not s.shown_by.startswith("tests/")]
    assert shown
    for where in shown:
        file, _, tag = where.partition(":")
        cases = [c for c in gate.cases if c.tag == tag and c.origin.startswith(f"{ROOT / file}: ")]
        assert cases and all(c.xfail for c in cases), f"{where}: not in the gate's default selection"


def test_an_include_by_tag_takes_only_those_entries_and_names_a_tag_it_lacks(tmp_path):
    from harness.orchestration.matrix import MatrixError, load_matrix

    (tmp_path / "m.yaml").write_text(f"include:\n  - {{file: {ROOT / 'matrices' / 'verl.yaml'}, tags: [verl-F2]}}\n")
    m = load_matrix(tmp_path / "m.yaml")
    assert m.cases and {c.tag for c in m.cases} == {"verl-F2"}
    (tmp_path / "bad.yaml").write_text(f"include:\n  - {{file: {ROOT / 'matrices' / 'verl.yaml'}, tags: [verl-F99]}}\n")
    with pytest.raises(MatrixError, match="has no entry tagged 'verl-F99'"):
        load_matrix(tmp_path / "bad.yaml")
    (tmp_path / "odd.yaml").write_text("include:\n  - {path: x.yaml}\n")
    with pytest.raises(MatrixError, match=r"include\[0\]: expected a file name or"):
        load_matrix(tmp_path / "odd.yaml")
