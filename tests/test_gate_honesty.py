"""SAFE is earned: the real `gate` on planted candidates, each on a small slice of the smoke matrix,
asserting its exit code and the verdict's first finding.

One planted Megatron-Bridge tree (tests/planted_bridge.py) serves every scenario: its faults are
switched by CKPT_TEST_PLANT, which the gate's subprocesses inherit and only the planted copy reads,
so the candidate venv is built once (a minute or two with the shared uv store) and reused. The
baseline is the pins. Cross-version reads are off (`cross=False`): these scenarios are about the
matrix verdict, and the corpus round trips are covered in tests/test_gate.py. One baseline runs the
union of the slices once and is handed to every gate as --baseline-results (what a user does with a
nightly baseline of the whole matrix): each gate cuts it down to its own slice and runs the candidate
alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import browser
from harness.cli import main
from harness.gate.bump import run_gate
from harness.gate.envspec import _default_cache
from harness.gate.verdict_html import RANKS
from harness.report import grid
from planted_bridge import PLANT, planted_bridge

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "matrices" / "smoke.yaml"
#: one worker runs them all (scripts/test: --dist loadgroup), sharing the baselines and the candidate venv
pytestmark = pytest.mark.xdist_group("planted-candidate")
#: one mcore case beside three Bridge HF round trips (the slice the issue measured)
MIXED = "tp2pp1dp1cp1->tp1pp2dp1cp1]"
HF = "hf-roundtrip tp2pp1dp1cp1->tp1pp2dp1cp1]"
#: one Bridge HF round trip
ONE = "hf-roundtrip[bridge_hf-hf-llama-tp2pp1dp1cp1->tp1pp2dp1cp1]"
#: a LoRA export, a canonical-LoRA export and a named defect, one model, one source topology
PEFT = "peft-export[bridge_peft-hf-llama-tp1pp1dp1cp1->"

@pytest.fixture(scope="module")
def tree() -> Path:
    return planted_bridge(_default_cache())


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One baseline run over the union of every slice here, made as the gate makes it (the pins'
    venv, this harness, --probe-imports), then handed to each gate as --baseline-results: the gate
    checks it is a whole run of this code in the baseline's environment, cuts it down to the gate's
    own selection, and runs only the candidate."""
    from harness.gate.baseline_cache import selection

    ids = list(dict.fromkeys(i for k in (MIXED, HF, ONE, PEFT) for i in selection(SMOKE, k)))
    out = tmp_path_factory.mktemp("baseline")
    subprocess.run([sys.executable, "-m", "harness.cli", "run", str(SMOKE), *(a for i in ids for a in ("--id", i)),
                    "--report", str(out), "--jobs", "2", "--probe-imports"], cwd=ROOT, check=False, capture_output=True)
    return out


def _gate(tmp_path: Path, monkeypatch, tree: Path, plant: str, k: str, baseline: list[str] | None = None,
          baseline_results: Path | None = None, rerun: bool = False):
    """The gate on `plant`; `rerun` off unless a scenario is about it (each rerun runs its cases again
    on both sides: the regressions here are deterministic plants)."""
    monkeypatch.setenv(PLANT, plant)
    out = tmp_path / "gate"
    code = run_gate([str(tree)], baseline or [], SMOKE, k, out, _default_cache(), cross=False,
                    baseline_results=baseline_results, rerun=rerun)
    verdict = (out / "verdict.md").read_text()
    gate = json.loads((out / "gate.json").read_text())
    return code, verdict, gate


def _first_failing(gate: dict) -> dict:
    return next(f for f in gate["findings"] if f["failing"])


@pytest.fixture(scope="module")
def regressed(tmp_path_factory, tree, baseline) -> tuple[Path, int, str, dict]:
    """The gate on `export-attr` over the mixed slice, rerun on: (its directory, exit code, verdict.md,
    gate.json). One gate serves the regression test and the browser test of its verdict.html."""
    tmp = tmp_path_factory.mktemp("regressed")
    with pytest.MonkeyPatch.context() as mp:
        code, verdict, gate = _gate(tmp, mp, tree, "export-attr", MIXED, baseline_results=baseline, rerun=True)
    return tmp / "gate", code, verdict, gate


def test_a_candidate_whose_export_raises_inside_its_own_code_is_a_regression(regressed):
    _, code, verdict, gate = regressed
    assert code == 1, verdict
    assert "rerun candidate" in gate["timings_s"]  # each regression ran again on both sides and reproduced
    assert not [f for f in gate["findings"] if f["class"] == "flaky"]
    first = _first_failing(gate)
    assert first["class"] == "regression" and first["case"].startswith("hf-roundtrip["), first
    assert "_planted_attribute_no_bridge_defines" in first["detail"]
    assert "raised at megatron/bridge/models/conversion/model_bridge.py" in first["detail"]  # the frame that decided
    assert verdict.startswith("# Bump gate: NOT SAFE")
    assert "Could not evaluate" not in verdict  # never filed as a harness limit


def test_a_candidate_package_that_does_not_import_fails_with_its_traceback_first(tmp_path, monkeypatch, tree, baseline):
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "import", MIXED, baseline_results=baseline)
    assert code == 1, verdict
    first = _first_failing(gate)
    assert first["class"] == "does-not-import" and first["case"] == "import megatron.bridge", first
    head = verdict.split("\n## ")[1]  # the first section after the head and its counts
    assert head.startswith("megatron.bridge does not import in the candidate") and "_planted_missing_module" in head


@pytest.mark.slow  # 59 s on 2 cores: both sides run the planted tree; the rule itself is tests/test_evidence.py's
# (an all-red baseline cannot be SAFE), and the real gate's other exit-2 paths (kill, internal-api, flaky) stay here
def test_a_baseline_red_on_every_selected_case_cannot_call_anything_safe(tmp_path, monkeypatch, tree):
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "export-attr", ONE, baseline=[str(tree)])
    assert code == 2, verdict
    assert verdict.startswith("# Bump gate: NOT EVALUATED (exit 2)")
    assert "baseline is red on every selected case" in gate["error"]
    assert "**1 baseline-red case(s)**" in verdict.split("\n## ")[0]


@pytest.mark.slow  # 32 s on 2 cores; the rule itself: tests/test_evidence.py test_a_run_that_died_names_where
def test_a_candidate_run_killed_mid_way_is_no_verdict_and_names_where_it_died(tmp_path, monkeypatch, tree, baseline):
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "kill", HF, baseline_results=baseline)
    assert code == 2, verdict
    assert "the candidate run did not finish" in gate["error"] and "it died in or before hf-roundtrip[" in gate["error"]


@pytest.mark.slow  # 37 s on 2 cores; the rule itself: tests/test_classify.py test_a_public_api_the_candidate_removed_is_a_breaking_change_that_fails
def test_a_public_api_the_candidate_removed_is_a_breaking_change(tmp_path, monkeypatch, tree, baseline):
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "public-api", ONE, baseline_results=baseline)
    assert code == 1, verdict
    first = _first_failing(gate)
    assert first["class"] == "api-break" and "save_hf_pretrained" in first["detail"], first
    assert "looked up at harness/" in first["detail"]  # the harness's own call made the lookup
    # the one baseline of every slice here, cut down to this gate's single case
    used = json.loads((tmp_path / "gate" / "baseline" / "results.json").read_text())
    assert [r["id"] for r in used["results"]] == [ONE] and used["restricted_from"] == 7, used.get("restricted_from")


@pytest.mark.slow  # 32 s on 2 cores; the rule itself: tests/test_classify.py and tests/test_compare.py (internal API holes)
def test_an_internal_api_the_harness_reaches_for_is_a_hole_that_keeps_safe_off_unless_accepted(
        tmp_path, monkeypatch, tree, baseline, capsys):
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "internal-api", PEFT, baseline_results=baseline)
    first_lines = verdict.split("\n## ")[0]
    holes = [f for f in gate["findings"] if f["class"] == "not-evaluated"]
    hole = "peft-export[bridge_peft-hf-llama-tp1pp1dp1cp1->tp2pp1dp1cp1-canonical_lora]"
    assert [f["case"] for f in holes] == [hole], holes
    assert "CanonicalLoRA" in holes[0]["detail"]
    # the LoRA cases of the same kind were evaluated and nothing regressed, but one case the baseline
    # had green was not seen on the candidate: no SAFE for it (issue 44: nothing unseen is certified)
    assert code == 2, verdict
    assert verdict.startswith("# Bump gate: NOT EVALUATED (exit 2)")
    assert "**1 case(s) green on the baseline with no real result on the candidate**" in first_lines
    assert "a coverage hole of the harness" in first_lines and "canonical_lora" in first_lines
    # accepted by name, the same evidence is SAFE, and the verdict says what was accepted
    # (compare decides as the gate does: evidence.decide)
    out = tmp_path / "gate"
    argv = ["compare", str(out / "baseline"), str(out / "candidate")]
    assert main(argv) == 2
    assert main([*argv, "--accept-unevaluated", "*canonical_lora]"]) == 0
    printed = capsys.readouterr().out
    assert "accepted** by `--accept-unevaluated '*canonical_lora]'`" in printed and printed.rstrip().endswith("**SAFE**: no regression.")


def test_a_failure_that_does_not_reproduce_is_flaky_never_a_regression_nor_evidence(tmp_path, monkeypatch, tree, baseline):
    monkeypatch.setenv(f"{PLANT}_ONCE", str(tmp_path / "failed-once"))
    code, verdict, gate = _gate(tmp_path, monkeypatch, tree, "flaky", ONE, baseline_results=baseline, rerun=True)
    assert (tmp_path / "failed-once").exists()  # the first export did fail
    assert [(f["case"], f["class"], f["failing"]) for f in gate["findings"] if f["case"] == ONE] == [(ONE, "flaky", False)], gate
    flaky = next(f for f in gate["findings"] if f["class"] == "flaky")
    assert "planted: the first export fails" in flaky["detail"] and "baseline passed, candidate passed" in flaky["detail"]
    assert code == 2, verdict  # one run red, one green: no regression, and no evidence either
    assert "flaky: its failing finding did not reproduce" in verdict.split("\n## ")[0]
    assert "## Not reproduced (flaky) (1)" in verdict


def test_the_verdict_page_and_a_sweep_of_its_two_runs_in_a_browser(regressed, tmp_path):
    """verdict.html of the real gate above, and the sweep page of its two runs (`sweep --from-results`),
    as headless chromium builds them: the verdict and counts first, failing cases before passing
    ones, one grid cell per case, links that land, a screenshot that is not blank."""
    out, code, verdict, gate = regressed
    page = out / "verdict.html"
    dom = browser.dump_dom(page)
    h1 = next(e for e in dom.elements() if e.tag == "h1").all_text()
    assert h1.startswith("Bump gate: NOT SAFE") and h1.endswith("(exit 1)"), h1  # the verdict first
    failing = [f for f in gate["findings"] if f["failing"]]
    counts = dom.counts()
    assert counts["failing finding(s)"] == len(failing) == sum(gate["coverage"]["failing"].values())
    assert counts["evaluated on both sides"] == len(gate["coverage"]["evaluated"])
    ids = {grid.anchor(r["id"]) for side in ("baseline", "candidate")
           for r in json.loads((out / side / "results.json").read_text())["results"]}
    cells = dom.cells("grid-kind")
    assert sorted(cells) == sorted(ids)  # one cell per case of either side
    assert set(dom.cells("grid-kind", flagged=True)) == {grid.anchor(f["case"]) for f in failing}  # outlined: a failing finding
    blocks = dom.case_blocks("data-rank")
    assert blocks[0] == "failing" and browser.ranked(blocks, RANKS), blocks
    assert dom.index(dom.by_id("failing")) < dom.index(dom.by_id("grid")) < dom.index(dom.by_id("cases"))
    assert dom.dangling() == []
    assert browser.not_blank(browser.screenshot(page, tmp_path / "verdict.png"))

    sweep_out = tmp_path / "sweep"
    assert main(["sweep", "--from-results", f"baseline={out / 'baseline'}", f"candidate={out / 'candidate'}",
                 "--out", str(sweep_out)]) == 0
    sweep = browser.dump_dom(sweep_out / "sweep.html")
    cells = sweep.cells("grid-release")
    assert len(cells) == 2 * len(ids) and set(cells) == ids  # release x case: one cell per case and release
    assert {grid.anchor(f["case"]) for f in failing} <= set(sweep.cells("grid-release", flagged=True))  # changed there
    assert sweep.dangling() == []  # each cell lands on its case's row
    assert browser.not_blank(browser.screenshot(sweep_out / "sweep.html", tmp_path / "sweep.png"))
