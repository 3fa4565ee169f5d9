"""`ckpt-harness compare` on hand-made results.json documents: every finding class, the exit codes,
the thresholds as flags, and unreadable inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.gate import compare as cmp

MiB = 2**20
TOL = "atol=1e-05 rtol=1e-05 (TP change reorders fp32 reductions)"


def check(name: str, status: str = "passed", diff: float | None = None, tol: str = "bitwise", detail: str = "") -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "max_abs_diff": diff, "tolerance": tol, "mismatches": []}


def case(cid: str, status: str = "passed", checks: list[dict] | None = None, error: str | None = None,
         memory: dict | None = None, total: float = 1.0, xfail_reason: str | None = None, notes: list[str] | None = None) -> dict[str, Any]:
    return {"id": cid, "case": cid.split("/")[0], "status": status, "checks": checks if checks is not None else [check("loaded-canonical")],
            "error": error, "memory": memory or {}, "phases": {"total": total}, "xfail_reason": xfail_reason, "notes": notes or []}


def doc(*cases: dict[str, Any], bridge: str = "0.6.2") -> dict[str, Any]:
    return {"matrix": "matrices/smoke.yaml", "wall_s": 10.0,
            "versions": {"python": "3.12.1", "torch": "2.14.1", "megatron-core": "0.19.2", "megatron-bridge": bridge},
            "summary": {}, "results": list(cases)}


def mem(**phase_rank_mib: float) -> dict[str, Any]:
    """mem(save_0=100) -> {"save": {"0": {"peak_delta": 100 MiB}}}"""
    out: dict[str, Any] = {}
    for key, mib in phase_rank_mib.items():
        phase, rank = key.rsplit("_", 1)
        out.setdefault(phase, {})[rank] = {"peak_delta": int(mib * MiB), "baseline_rss": 0}
    return out


def kinds(findings: list[cmp.Finding], case_id: str | None = None) -> list[str]:
    return [f.kind for f in findings if case_id is None or f.case == case_id]


def test_identical_runs_have_no_finding_and_are_safe():
    d = doc(case("a", checks=[check("logits", diff=3e-7, tol=TOL)], memory=mem(save_0=100)), case("b", "xfailed"))
    findings = cmp.compare(d, d)
    assert findings == [] and cmp.exit_code(findings) == 0
    assert cmp.verdict(findings).startswith("**SAFE**")


def test_regression_passed_to_failed_names_the_checks():
    base = doc(case("a", checks=[check("logits"), check("step")]))
    cand = doc(case("a", "failed", checks=[check("logits"), check("step", "failed", detail="3 mismatch(es): value")]))
    [f] = cmp.compare(base, cand)
    assert (f.kind, f.base, f.candidate, f.failing) == ("regression", "passed", "failed", True)
    assert "step" in f.detail and "logits" not in f.detail.split("now fail:")[1]


def test_a_defect_that_errors_instead_and_a_new_failing_check_inside_a_failed_case():
    base = doc(case("x", "xfailed", checks=[check("step", "failed")]),
               case("f", "failed", checks=[check("step", "failed"), check("losses")]))
    cand = doc(case("x", "error", checks=[], error="world timed out after 180 s"),
               case("f", "failed", checks=[check("step", "failed"), check("losses", "failed")]))
    findings = cmp.compare(base, cand)
    [x] = [f for f in findings if f.case == "x"]
    # a known defect that fails another way: failing, counted apart from green -> red
    assert x.kind == "defect-changed" and x.failing and "xfailed -> error" in x.detail and "world timed out" in x.detail
    [f] = [f for f in findings if f.case == "f"]
    assert f.kind == "regression" and "losses" in f.detail and cmp.exit_code(findings) == 1


def test_xfail_that_now_fails_another_check_is_a_regression():
    """A known defect must not hide a new failure in the same case (xfail without `checks:`)."""
    base = doc(case("x", "xfailed", checks=[check("step", "failed"), check("model-weights")]))
    cand = doc(case("x", "xfailed", checks=[check("step", "failed"), check("model-weights", "failed")]))
    [f] = cmp.compare(base, cand)
    assert f.kind == "regression" and "model-weights" in f.detail


def test_new_refusal_names_the_exception_and_fails_the_gate():
    base = doc(case("load", checks=[check("optimizer-state")]))
    cand = doc(case("load", "error", checks=[], error="rank 1 raised:\nTraceback (most recent call last):\n  ...\n"
                    "megatron.core.dist_checkpointing.core.CheckpointingException: Global shape mismatch"))
    [f] = cmp.compare(base, cand)
    assert f.kind == "new-refusal" and f.failing and "CheckpointingException: Global shape mismatch" in f.detail
    assert cmp.exit_code([f]) == 1


def test_new_refusal_through_a_failed_refusal_check_detail():
    base = doc(case("r", checks=[check("refusal", tol="-")]))
    cand = doc(case("r", "failed", checks=[check("refusal", "failed", tol="-", detail="refused through an unlisted exception: CheckpointingException: no shard")]))
    [f] = cmp.compare(base, cand)
    assert f.kind == "new-refusal" and "CheckpointingException" in f.detail and "refusal" in f.detail
    # a KeyError inside the loader is a crash, never a refusal: a plain regression
    cand = doc(case("r", "failed", checks=[check("refusal", "failed", tol="-", detail="refused through an unlisted exception: KeyError: 'step'")]))
    [g] = cmp.compare(base, cand)
    assert g.kind == "regression" and g.failing and "KeyError" in g.detail


def test_fixed_upstream_says_drop_the_xfail_and_does_not_fail():
    base = doc(case("k", "xfailed", checks=[check("step", "failed")], xfail_reason="KeyError 'step'"))
    cand = doc(case("k", "failed", checks=[check("step")], error="XPASS(strict): expected to fail (KeyError 'step') but passed; "
                    "if upstream fixed it, remove the xfail from the matrix"))
    findings = cmp.compare(base, cand)
    assert kinds(findings) == ["fixed-upstream"] and cmp.exit_code(findings) == 0
    assert "drop the xfail" in findings[0].detail and "not a regression" in findings[0].detail


def test_appeared_and_disappeared_cases_warn_and_a_lost_judging_check_fails():
    base = doc(case("gone"), case("kept", checks=[check("logits", diff=0.0, tol=TOL), check("resave-plain"),
                                                  check("memory-budget:save")]))
    cand = doc(case("new"), case("kept", checks=[check("logits", "not-run", tol="-", detail="no HF class")]))
    findings = cmp.compare(base, cand)
    assert sorted((f.case, f.kind) for f in findings) == [
        ("gone", "disappeared"), ("kept", "check-lost"), ("kept", "check-lost"), ("kept", "disappeared"), ("new", "appeared")]
    assert cmp.exit_code(findings) == 1  # a green case no longer judged on what the baseline judged it on
    details = " ".join(f.detail for f in findings if f.case == "kept")
    assert "check logits passed on base, not run on the candidate (no HF class)" in details
    assert "check resave-plain passed on base, absent" in details
    # an auxiliary check (a memory budget) lost only warns
    [aux] = [f for f in findings if f.case == "kept" and f.kind == "disappeared"]
    assert "memory-budget:save" in aux.detail and not aux.failing


def test_fixed_case_is_reported_not_failing():
    findings = cmp.compare(doc(case("a", "error", checks=[], error="boom")), doc(case("a")))
    assert kinds(findings) == ["fixed"] and cmp.exit_code(findings) == 0


@pytest.mark.parametrize(
    ("base_diff", "cand_diff", "why"),
    [(1e-6, 2e-5, "exceeds atol=1e-05"), (1e-8, 2e-7, "grew 20.0x"), (0.0, 1e-9, "was 0 on base"), (None, 3e-5, "exceeds atol")],
)
def test_diff_growth_on_toleranced_checks(base_diff, cand_diff, why):
    base = doc(case("t", checks=[check("logits", diff=base_diff, tol=TOL)]))
    cand = doc(case("t", checks=[check("logits", diff=cand_diff, tol=TOL)]))
    [f] = cmp.compare(base, cand)
    assert f.kind == "diff-growth" and f.failing and why in f.detail and (f.base, f.candidate) == (base_diff, cand_diff)


@pytest.mark.parametrize(("base_diff", "cand_diff"), [(1e-7, 5e-7), (2e-5, 2e-5), (3e-6, 1e-6), (0.0, 0.0)])
def test_no_diff_growth_within_factor_or_when_shrinking(base_diff, cand_diff):
    base = doc(case("t", checks=[check("losses", diff=base_diff, tol="atol=2e-05 rtol=0.0001 (why)")]))
    cand = doc(case("t", checks=[check("losses", diff=cand_diff, tol="atol=2e-05 rtol=0.0001 (why)")]))
    assert cmp.compare(base, cand) == []


def test_bitwise_checks_are_not_diff_growth():
    """A bitwise check with a diff is a failed check already; only its status change counts."""
    base = doc(case("b", checks=[check("logits", diff=0.0), check("export-bitwise", diff=0.0)]))
    cand = doc(case("b", checks=[check("logits", diff=1e-3), check("export-bitwise", diff=1.0, tol="exact")]))
    assert cmp.compare(base, cand) == []


def test_memory_growth_needs_both_percent_and_mib():
    base = doc(case("m1", memory=mem(save_0=100, load_1=100)), case("m2", memory=mem(save_0=1000)), case("m3", memory=mem(save_0=10)))
    cand = doc(case("m1", memory=mem(save_0=150, load_1=105)), case("m2", memory=mem(save_0=1040)), case("m3", memory=mem(save_0=40)))
    findings = cmp.compare(base, cand)
    [f] = findings
    assert (f.case, f.kind) == ("m1", "memory-growth") and "save@rank0" in f.detail and "+50%" in f.detail
    assert (f.base, f.candidate) == (100 * MiB, 150 * MiB)
    looser = cmp.compare(base, cand, cmp.Thresholds(memory_pct=3, memory_mib=16))
    assert sorted(f.case for f in looser) == ["m1", "m2", "m3"]


def test_time_growth_is_reported_never_failing():
    base = doc(case("slow", total=10.0), case("tiny", total=2.0))
    cand = doc(case("slow", total=20.0), case("tiny", total=6.0))
    findings = cmp.compare(base, cand)
    assert [(f.case, f.kind) for f in findings] == [("slow", "time-growth")] and cmp.exit_code(findings) == 0


def test_markdown_lists_versions_then_failing_then_fixed_then_the_rest_then_verdict():
    base = doc(case("a"), case("k", "xfailed"), case("gone"), case("slow", total=10.0))
    cand = doc(case("a", "failed", checks=[check("loaded-canonical", "failed")]),
               case("k", "failed", error="XPASS(strict): expected to fail"), case("slow", total=30.0), bridge="0.7.0rc1")
    md = cmp.markdown(base, cand, cmp.compare(base, cand))
    assert md.index("| megatron-bridge | 0.6.2 | 0.7.0rc1 **(changed)** |") < md.index("### Failing findings")
    assert "| megatron-core | 0.19.2 | 0.19.2 |" in md
    assert md.index("### Failing findings") < md.index("### Fixed upstream") < md.index("### Other findings")
    assert md.index("`a`") < md.index("`k`") < md.index("`gone`")
    assert md.splitlines()[-1].startswith("**NOT SAFE**: 1 failing finding(s) in 1 case(s), 1 fixed upstream")


def write(path: Path, d: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(d))
    return path


def test_cli_exit_codes_and_outputs(tmp_path, capsys):
    base = write(tmp_path / "base", doc(case("a"), case("m", memory=mem(save_0=10))))
    same = write(tmp_path / "same", doc(case("a"), case("m", memory=mem(save_0=10))))
    assert main(["compare", str(base), str(same / "results.json")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("**SAFE**: no regression.")

    worse = write(tmp_path / "worse", doc(case("a", "error", checks=[], error="KeyError: 'step'"), case("m", memory=mem(save_0=40))))
    out = tmp_path / "out"
    assert main(["compare", str(base), str(worse), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "| `a` | regression | passed -> error: KeyError: 'step' |" in printed  # a crash, not a refusal
    assert (out / "compare.md").read_text().strip() == printed.strip()
    j = json.loads((out / "compare.json").read_text())
    assert j["exit_code"] == 1 and j["candidate"]["versions"]["megatron-bridge"] == "0.6.2"
    assert j["findings"] == [{"case": "a", "class": "regression", "failing": True,
                              "detail": j["findings"][0]["detail"], "base": "passed", "candidate": "error"}]
    page = (out / "compare.html").read_text()  # the gate's verdict page: the verdict, the regression, a cell a case
    assert "ckpt-harness compare: NOT SAFE, 1 failing finding(s) (exit 1)" in page and 'id="f-regression"' in page
    assert page.count('class="gc') == 2 and page.count('class="gc flag"') == 1
    # The thresholds are flags: 30 MiB of growth fails once --memory-mib is below it.
    assert main(["compare", str(base), str(worse), "--memory-mib", "16", "--out", str(out)]) == 1
    j = json.loads((out / "compare.json").read_text())
    assert [f["class"] for f in j["findings"]] == ["regression", "memory-growth"] and j["thresholds"]["memory_mib"] == 16


def test_cli_diff_factor_flag(tmp_path, capsys):
    base = write(tmp_path / "b", doc(case("t", checks=[check("logits", diff=1e-8, tol=TOL)])))
    cand = write(tmp_path / "c", doc(case("t", checks=[check("logits", diff=2e-7, tol=TOL)])))
    assert main(["compare", str(base), str(cand)]) == 1
    assert main(["compare", str(base), str(cand), "--diff-factor", "100"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("content", [None, "{not json", '{"results": "nope"}', '{"results": [{"id": 1}]}',
                                     '{"results": [{"id": "a", "status": "passed"}, {"id": "a", "status": "failed"}]}'])
def test_cli_unreadable_input_exits_2_naming_the_file(tmp_path, capsys, content):
    good = write(tmp_path / "good", doc(case("a")))
    bad = tmp_path / "bad" / "results.json"
    if content is not None:
        bad.parent.mkdir()
        bad.write_text(content)
    assert main(["compare", str(good), str(bad if content is None else bad.parent)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err


def test_a_moved_internal_api_is_a_coverage_hole_not_a_refusal():
    """megatron.training.models.gpt is no API users call: the harness's driver lacks this release
    (not-evaluated, listed, never blamed on the candidate); a public one is an api-break (test_classify)."""
    from harness.gate.compare import compare

    base = {"versions": {}, "results": [{"id": "c", "status": "passed", "checks": []}]}
    cand = {"versions": {}, "results": [{"id": "c", "status": "error", "checks": [], "error":
            "API not available in megatron-core 0.18.2: ModuleNotFoundError: No module named 'megatron.training.models.gpt'\nTraceback"}]}
    (f,) = compare(base, cand)
    assert f.kind == "not-evaluated" and not f.failing and "no driver for megatron-core 0.18.2" in f.detail


def test_tolerances_are_structured_and_old_string_documents_still_compare():
    """results.json carries {kind, atol, rtol, why, label}; a document older harness code wrote (a
    string) reads the same, so a gate against old results still sees diff growth past atol."""
    from harness.core.parity import BITWISE, Tolerance
    from harness.core.result import CaseResult, Check
    from harness.gate.compare import compare

    tol = Tolerance(1e-5, 1e-5, "TP change reorders fp32 sums")
    r = CaseResult("c", "reshard-weights", "m", "b", "s", "t", status="passed",
                   checks=[Check("logits", "passed", "", 2e-6, tol), Check("loaded-canonical", "passed", "", 0.0)])
    new = r.to_dict()
    assert new["checks"][0]["tolerance"] == {"kind": "allclose", "atol": 1e-5, "rtol": 1e-5,
                                             "why": "TP change reorders fp32 sums", "label": str(tol)}
    assert new["checks"][1]["tolerance"]["kind"] == "bitwise"
    assert Tolerance.from_json(new["checks"][0]["tolerance"]) == tol and Tolerance.from_json("bitwise") == BITWISE
    old = {"id": "c", "status": "passed", "checks": [{"name": "logits", "status": "passed", "max_abs_diff": 2e-6,
                                                      "tolerance": "atol=1e-05 rtol=1e-05 (TP change reorders fp32 sums)"}]}
    assert Tolerance.from_json(old["checks"][0]["tolerance"]) == tol
    grown = {**new, "checks": [{**new["checks"][0], "max_abs_diff": 3e-5}]}
    (f,) = [f for f in compare({"results": [old]}, {"results": [grown]}) if f.kind == "diff-growth"]
    assert "exceeds atol=1e-05" in f.detail
    try:
        Check("x", "passed", "", None, "bitwise")
    except TypeError as exc:
        assert "Tolerance" in str(exc)
    else:
        raise AssertionError("a string tolerance must be refused")


TB = ('Traceback (most recent call last):\n  File "/x/site-packages/megatron/core/dist_checkpointing/{mod}.py", line 9, in f\n'
      '    raise {exc}("boom")\n{exc}: boom\n')


@pytest.mark.parametrize(("base_checks", "cand_checks", "why"), [
    ([check("step", "failed", diff=1e-3)], [check("step", "failed", diff=1e3)], "grew 1000000.0x"),
    ([check("step", "failed", diff=1e-3)], [check("step", "failed", diff=float("nan"))], "became nan"),
    ([check("step", "failed", diff=1e-3)], [check("step", "failed", diff=float("inf"))], "became inf"),
    ([check("step", "failed"), check("losses", "failed")], [check("step", "failed")], "fails other checks: losses, step on base, step"),
])
def test_a_known_defect_cannot_get_worse_or_change_form_unseen(base_checks, cand_checks, why):
    base = doc(case("x", "xfailed", checks=base_checks, xfail_reason="step reset"))
    cand = doc(case("x", "xfailed", checks=cand_checks, xfail_reason="step reset"))
    findings = cmp.compare(base, cand)
    assert [f.kind for f in findings] == ["defect-changed"] and why in findings[0].detail, findings
    assert cmp.exit_code(findings) == 1
    # the same defect, no worse: nothing
    assert cmp.compare(base, base) == []


def test_a_known_defect_that_raises_another_error_or_from_another_module_changed():
    def errs(mod: str, exc: str) -> dict:
        return doc(case("x", "xfailed", checks=[], error=TB.format(mod=mod, exc=exc)))

    same = cmp.compare(errs("mapping", "CheckpointingException"), errs("mapping", "CheckpointingException"))
    assert same == []
    for cand in (errs("mapping", "KeyError"), errs("exchange_utils", "CheckpointingException")):
        [f] = cmp.compare(errs("mapping", "CheckpointingException"), cand)
        assert f.kind == "defect-changed" and "raises differently" in f.detail and f.failing
    [f] = cmp.compare(errs("mapping", "KeyError"), errs("exchange_utils", "KeyError"))
    assert "KeyError raised in megatron.core.dist_checkpointing.mapping on base" in f.detail
    assert "KeyError raised in megatron.core.dist_checkpointing.exchange_utils on the candidate" in f.detail


def test_a_named_defect_no_longer_met_is_a_changed_defect_not_a_regression():
    """xfailed -> failed with another message of the same defect: failing, but counted apart."""
    base = doc(case("x", "xfailed", checks=[check("step", "failed")], xfail_reason="step reset"))
    cand = doc(case("x", "failed", checks=[check("step", "failed")], xfail_reason="step reset",
                    notes=["failed, but not as expected: no match for 'reset to 0' (step reset)"]))
    [f] = cmp.compare(base, cand)
    assert f.kind == "defect-changed" and "no match for 'reset to 0'" in f.detail and f.failing


def test_an_xpass_counts_as_fixed_only_when_every_judging_check_compared_and_passed():
    base = doc(case("k", "xfailed", checks=[check("step", "failed"), check("logits")]))
    fixed = doc(case("k", "failed", checks=[check("step"), check("logits"), check("memory-budget:save", "not-run")],
                     error="XPASS(strict): expected to fail"))
    assert kinds(cmp.compare(base, fixed)) == ["fixed-upstream"]
    for checks, why in (([check("step", "not-run"), check("logits")], "check(s) step not run"),
                        ([check("logits")], "check(s) step the baseline ran are absent"),
                        ([], "the candidate recorded no judging check")):
        cand = doc(case("k", "failed", checks=checks, error="XPASS(strict): expected to fail"))
        findings = cmp.compare(base, cand)
        assert kinds(findings)[0] == "defect-changed" and why in findings[0].detail and cmp.exit_code(findings) == 1


def test_a_defect_in_the_form_declared_for_the_candidates_release_is_no_change_but_may_not_grow():
    from harness.judge.status import KNOWN_FORM

    base = doc(case("x", "xfailed", checks=[check("step", "failed", diff=1.0)]))
    note = [f"{KNOWN_FORM}megatron-bridge<0.6 (matrix known_on)"]
    cand = doc(case("x", "xfailed", checks=[check("optimizer-state", "failed")], notes=note))
    assert cmp.compare(base, cand) == []  # someone looked at this form: it is declared
    assert kinds(cmp.compare(base, doc(case("x", "xfailed", checks=[check("optimizer-state", "failed")])))) == ["defect-changed"]
    worse = doc(case("x", "xfailed", checks=[check("step", "failed", diff=1e3)], notes=note))
    assert kinds(cmp.compare(base, worse)) == ["defect-changed"]


def test_a_finding_quotes_the_rank_that_raised_not_the_peers_that_followed():
    err = ("rank 0 of 2 raised:\nTraceback (most recent call last):\n  File \"/x/megatron/bridge/a.py\", line 1, in f\n"
           "RuntimeError: planted: the export fails\n(then rank 1 failed: RuntimeError: [gloo/transport/tcp/pair.cc:534] "
           "Connection reset by peer)")
    [f] = cmp.compare(doc(case("a")), doc(case("a", "error", checks=[], error=err)))
    assert f.kind == "new-refusal" and "RuntimeError: planted: the export fails" in f.detail and "gloo" not in f.detail
