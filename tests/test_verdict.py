"""A case's verdict: every source's checks reach the result in one place (the envelope asks each
source once, harness.judge.status.conclude decides), and they can turn it red."""

from __future__ import annotations

from harness.core.memory import Budget, PhaseMemory
from harness.core.result import CaseResult, Check, CheckSource, WorldRecord
from harness.core.spec import XFail
from harness.judge.budgets import Budgets
from harness.judge.status import conclude
from harness.orchestration.runner import RunOptions, case_envelope


class _Source:
    def __init__(self, *checks: Check, after_error: bool = False) -> None:
        self.found, self.after_error = list(checks), after_error

    def checks_of(self, record: WorldRecord) -> list[Check]:
        return list(self.found)


def _result(*checks: Check) -> CaseResult:
    return CaseResult(id="c[x]", case="c", model="m", backend="b", source="tp1", target="tp1", checks=list(checks))


def test_a_source_that_fails_fails_the_case():
    r = _result(Check("weights", "passed"))
    conclude(r, [Check("strategy", "failed", "ran fully_parallel, asked dp_reshardable")])
    assert r.status == "failed" and [c.name for c in r.failed_checks] == ["strategy"]


def test_sources_alone_cannot_pass_a_case_that_judged_nothing():
    r = _result()
    conclude(r, [Check("memory-budget:save@rank0", "passed")])
    assert r.status == "error" and "no check that judges it" in r.error
    r = _result()
    conclude(r, [])
    assert r.status == "error"


def test_a_name_two_sources_record_is_kept_once_the_first():
    r = _result(Check("weights", "passed"))
    conclude(r, [Check("strategy", "passed", "first"), Check("strategy", "failed", "second")])
    assert [(c.name, c.detail) for c in r.checks] == [("weights", ""), ("strategy", "first")] and r.status == "passed"


def test_after_an_error_only_the_sources_that_judge_errors_are_asked(tmp_path):
    r = _result()
    with case_envelope(r, RunOptions(workdir=tmp_path)) as env:
        env.sources += [_Source(Check("strategy", "failed", "x")), _Source(Check("source-unchanged", "failed", "y"), after_error=True)]
        raise RuntimeError("rank 1 died")
    assert r.status == "error" and [c.name for c in r.checks] == ["source-unchanged"] and "rank 1 died" in r.error


def test_the_expected_failure_applies_after_the_sources():
    r = _result(Check("weights", "passed"))
    conclude(r, [Check("strategy", "failed")], XFail("known", checks=("strategy",)))
    assert r.status == "xfailed"
    r = _result(Check("weights", "passed"))
    conclude(r, [], XFail("known", checks=("strategy",)))
    assert r.status == "failed"  # XPASS(strict)


def test_budgets_judge_what_the_case_measured():
    mem = PhaseMemory("save", baseline_rss=0, peak_rss=64 * 1024 * 1024, samples=3).to_dict()
    r = WorldRecord(memory={"save": {"0": mem}})
    budgets = Budgets([Budget("save", 0, max_peak_delta_mib=1), Budget("load", 0, max_peak_delta_mib=1)])
    checks = {c.name: c for c in budgets.checks_of(r)}
    assert checks["memory-budget:save@rank0"].status == "failed"
    assert checks["memory-budget:load@rank0"].status == "failed" and "measured no 'load'" in checks["memory-budget:load@rank0"].detail
    assert Budgets([]).checks_of(r) == []
    assert all(isinstance(s, CheckSource) for s in (budgets, _Source()))


def test_the_envelope_concludes_with_what_the_body_put_in_its_sources(tmp_path):
    r = _result()
    with case_envelope(r, RunOptions(workdir=tmp_path), xfail=XFail("known", checks=("strategy",))) as env:
        env.sources.append(_Source(Check("strategy", "failed", "planted")))
        r.checks.append(Check("weights", "passed"))
    assert r.status == "xfailed" and [c.name for c in r.checks] == ["weights", "strategy"]
