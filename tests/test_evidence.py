"""harness.gate.evidence: what a gate may count, on hand-made results documents, each rule with the
input that would make the gate say SAFE without it."""

from __future__ import annotations

from harness.gate.compare import Finding, compare
from harness.gate.evidence import complete_problem, coverage, decide, exit_code, shim_findings

PINS = {"megatron-core": "0.19.2", "megatron-bridge": "0.6.2"}


def doc(*cases: tuple[str, str], complete: bool = True, selected: list[str] | None = None, shims: dict | None = None) -> dict:
    ids = [c for c, _ in cases]
    return {"versions": PINS, "complete": complete, "selected": ids if selected is None else selected,
            "results": [{"id": c, "status": s, "checks": [], "compat_shims": (shims or {}).get(c, [])} for c, s in cases]}


def verdict(base: dict, cand: dict) -> tuple[int, object]:
    found = compare(base, cand) + shim_findings(base, cand)
    cover = coverage(base, cand, found)
    return exit_code(found, cover), cover


def test_a_whole_green_run_with_evidence_for_every_kind_is_safe():
    base = doc(("a[1]", "passed"), ("b[1]", "xfailed"))
    code, cover = verdict(base, doc(("a[1]", "passed"), ("b[1]", "xfailed")))
    assert code == 0 and cover.evaluated == ["a[1]", "b[1]"] and cover.unevaluated_kinds == []


def test_a_run_that_died_names_where():
    assert complete_problem(doc(("a[1]", "passed")), "candidate") is None
    died = doc(("a[1]", "passed"), complete=False, selected=["a[1]", "b[1]", "c[1]"])
    assert complete_problem(died, "candidate") == ("the candidate run did not finish: 1 of 3 selected case(s) have a "
                                                    "result; it died in or before b[1] (missing too: c[1])")
    assert "did not finish" in complete_problem(doc(("a[1]", "passed"), complete=False), "candidate")
    assert "name no selection" in complete_problem({**doc(("a[1]", "passed")), "selected": None}, "baseline")
    assert "did not finish" in complete_problem(doc(complete=True, selected=["a[1]"]), "candidate")  # empty results


def test_a_red_baseline_is_no_evidence_and_an_all_red_one_cannot_be_safe():
    code, cover = verdict(doc(("a[1]", "error"), ("a[2]", "failed")), doc(("a[1]", "passed"), ("a[2]", "passed")))
    assert code == 2 and cover.evaluated == [] and cover.baseline_red == ["a[1]", "a[2]"]
    assert "**2 baseline-red case(s)**" in "\n".join(cover.lines())
    # one green case of the kind is evidence; the red one is counted, never hidden
    code, cover = verdict(doc(("a[1]", "error"), ("a[2]", "passed")), doc(("a[1]", "passed"), ("a[2]", "passed")))
    assert code == 0 and cover.baseline_red == ["a[1]"] and "baseline-red" in "\n".join(cover.lines())


def test_a_case_kind_with_nothing_evaluated_is_no_verdict():
    hole = "API not available in megatron-bridge 0.5.1: AttributeError: module 'x' has no attribute 'y' (looked up at h.py:1 in f)"
    base = doc(("a[1]", "passed"), ("b[1]", "passed"))
    cand = doc(("a[1]", "passed"), ("b[1]", "not-applicable"))
    cand["results"][1]["not_applicable_reason"] = hole
    cand["versions"] = {**PINS, "megatron-bridge": "0.5.1"}
    code, cover = verdict(base, cand)
    assert code == 2 and cover.unevaluated_kinds == ["b"] and cover.holes == ["b[1]"]
    lines = cover.lines()
    assert lines[1].startswith("- **1 case(s) green on the baseline with no real result on the candidate**")
    assert "a coverage hole of the harness" in lines[2] and "`b[1]`" in lines[2]
    assert any(ln.startswith("- **No evidence for 1 case kind(s)**: b") for ln in lines)


def test_cases_not_run_on_a_side_are_counted_first():
    code, cover = verdict(doc(("a[1]", "passed"), ("a[2]", "not-run")), doc(("a[1]", "passed"), ("a[2]", "not-run")))
    assert code == 0 and cover.not_run == ["a[2]"] and "**1 case(s) not run or not applicable on a side**" in "\n".join(cover.lines())


def test_a_workaround_the_candidate_alone_needs_is_a_warning_and_one_it_dropped_is_listed():
    base = doc(("a[1]", "passed"), shims={"a[1]": ["old shim"]})
    cand = doc(("a[1]", "passed"), shims={"a[1]": ["new shim"]})
    found = shim_findings(base, cand)
    assert [(f.case, f.kind, f.failing) for f in found] == [("workaround new shim", "new-workaround", False),
                                                            ("workaround old shim", "workaround-dropped", False)]
    assert "in 1 case(s) (`a[1]`)" in found[0].detail
    code, cover = decide(base, cand, found)
    assert code == 0 and cover.warnings == {"new-workaround": 1}
    assert cover.lines()[-1] == "- 1 warning(s): new-workaround 1 (listed below)."
    assert shim_findings(base, doc(("a[1]", "passed"), shims={"a[1]": ["old shim"]})) == []
    # one finding per workaround, however many cases: a verdict of 1,000 rows hides what matters
    many = [(f"a[{i}]", "passed") for i in range(50)]
    found = shim_findings(doc(*many), doc(*many, shims={f"a[{i}]": ["new shim"] for i in range(50)}))
    assert len(found) == 1 and found[0].candidate == 50 and "in 50 case(s)" in found[0].detail


def test_a_workaround_hiding_a_defect_that_the_candidate_alone_needs_is_failing():
    """Its green results ran with an upstream defect patched that the baseline did not have."""
    from harness.compat import registry

    hides = registry.by_kind("hides")[0]
    base = doc(("a[1]", "passed"))
    cand = doc(("a[1]", "passed"), shims={"a[1]": [hides.label]})
    found = shim_findings(base, cand)
    assert [(f.kind, f.failing) for f in found] == [("hides-workaround", True)]
    assert f"shown without it by {hides.shown_by}" in found[0].detail
    code, cover = decide(base, cand, found)
    assert code == 1 and cover.failing == {"hides-workaround": 1}
    assert cover.lines()[1] == "- **1 failing finding(s)**: hides-workarounds needed 1."
    # the same workaround on both sides is the baseline's too: no finding
    assert shim_findings(cand, cand) == []


def test_a_baseline_green_case_with_no_real_result_on_the_candidate_keeps_safe_off_unless_accepted():
    base = doc(("a[1]", "passed"), ("a[2]", "passed"), ("b[1]", "xfailed"))
    hole = doc(("a[1]", "passed"), ("a[2]", "not-applicable"), ("b[1]", "xfailed"))  # the harness's own limit
    hole["results"][1]["not_applicable_reason"] = ("API not available in megatron-core 0.19.2: AttributeError: module "
                                                   "'x' has no attribute 'y' (looked up at h.py:1 in f)")
    for cand in (doc(("a[1]", "passed"), ("a[2]", "not-run"), ("b[1]", "xfailed")),   # a module the candidate lacks
                 hole, doc(("a[1]", "passed"), ("b[1]", "xfailed"))):                   # the case vanished
        found = compare(base, cand)
        code, cover = decide(base, cand, found)
        assert code == 2 and list(cover.blocking) == ["a[2]"], cover  # kind `a` has evidence: counted per case
        assert "green on the baseline with no real result" in cover.lines()[1]
        # accepted by name: recorded, and no longer blocking
        code, cover = decide(base, cand, found, accept=["a[2*"])
        assert code == 0 and cover.accepted == {"a[2]": "a[2*"} and not cover.blocking
        assert any("accepted** by `--accept-unevaluated 'a[2*'`" in ln for ln in cover.lines())
    # a pattern that names another case accepts nothing
    cand = doc(("a[1]", "passed"), ("a[2]", "not-run"), ("b[1]", "xfailed"))
    assert decide(base, cand, compare(base, cand), accept=["b["])[0] == 2
    # not run on both sides: not green on the baseline, no evidence lost
    both = doc(("a[1]", "passed"), ("a[2]", "not-run"), ("b[1]", "xfailed"))
    assert decide(both, both, compare(both, both))[0] == 0


def test_exit_code_without_coverage_is_no_verdict():
    assert exit_code([], None) == 2
    assert exit_code([Finding("a[1]", "regression", "x")], None) == 1
