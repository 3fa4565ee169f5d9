"""`not-applicable` (issue 18 item 2): a release that lacks an API a case needs is not-applicable to
it, with the API line as its reason, never a crash; on the project's pins the same missing API stays
an `error` (there every API the harness calls exists, so a missing one is the harness's defect).
Each layer that reads a status is checked: the envelope, expected failures, reports, the CLI exit
code, compare + classify (the gate), and the sweep table."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from harness.core.result import CaseResult, api_missing_parts
from harness.core.spec import XFail
from harness.gate import classify
from harness.gate.compare import compare, exit_code
from harness.gate.evidence import evaluated_ids
from harness.gate.sweep.table import outcome
from harness.orchestration import runner
from harness.orchestration.runner import RunOptions, apply_expected_failure, case_envelope
from harness.report import results as report

GONE = "No module named 'megatron.core.dist_checkpointing.gone'"


def _run_envelope(tmp_path, monkeypatch, moved: set[str], exc: Exception) -> CaseResult:
    monkeypatch.setattr(runner, "moved_from_pins", lambda: moved)
    r = CaseResult("reshard-optimizer[x]", "reshard-optimizer", "gpt-gqa", "mcore_dist", "tp1", "tp2")
    with case_envelope(r, RunOptions(workdir=tmp_path)):
        raise exc
    return r


def test_a_missing_api_in_a_moved_package_is_not_applicable_with_the_api_line(tmp_path, monkeypatch):
    r = _run_envelope(tmp_path, monkeypatch, {"megatron-core"}, ModuleNotFoundError(GONE))
    assert r.status == "not-applicable" and r.hole_reason == r.not_applicable_reason
    assert r.not_applicable_reason.startswith("API not available in megatron-core ") and "moved megatron-core" in r.not_applicable_reason
    assert "Traceback (most recent call last)" in r.error  # the evidence is kept


@pytest.mark.parametrize("moved, exc", [
    (set(), ModuleNotFoundError(GONE)),  # the pins' own venv: nothing moved, a missing API is the harness's error
    ({"megatron-bridge"}, ModuleNotFoundError(GONE)),  # another package moved
    ({"megatron-core"}, KeyError("step")),  # not a missing API at all
])
def test_anything_else_stays_an_error(tmp_path, monkeypatch, moved, exc):
    r = _run_envelope(tmp_path, monkeypatch, moved, exc)
    assert r.status == "error" and r.not_applicable_reason is None


def test_moved_from_pins_reads_the_release_set_of_the_env():
    env = {"overrides": [{"name": "megatron_core"}], "release_set": {
        "resolved": [{"name": "transformers"}, {"name": "huggingface-hub"}], "dropped": [{"name": "Datasets"}]}}
    assert report.moved_from_pins(env) == {"megatron-core", "transformers", "huggingface-hub", "datasets"}
    assert report.moved_from_pins({"overrides": [], "release_set": {}}) == set()


def _na(error_line: str) -> CaseResult:
    return CaseResult("c[x]", "reshard-optimizer", "m", "b", "s", "t", status="not-applicable",
                      error=f"{error_line}\nTraceback ...", not_applicable_reason=error_line)


API = "API not available in megatron-core 0.16.1: ImportError: cannot import name 'x' from 'megatron.core._rank_utils'"


def test_an_expected_failure_is_met_only_when_the_defect_is_that_missing_api():
    r = _na(API)
    apply_expected_failure(XFail("an unrelated defect", checks=("step",)), r)
    assert r.status == "not-applicable" and any("not judged" in n for n in r.notes)
    r = _na(API)
    apply_expected_failure(XFail("a removed module", match=r"cannot import name 'x'"), r)
    assert r.status == "xfailed"


def test_reports_skip_it_with_its_reason_and_the_run_stays_green(tmp_path):
    from harness.cli import _summarize

    ok = CaseResult("a[x]", "c", "m", "b", "s", "t", status="passed")
    results = [ok, _na(API)]
    assert report.counts(results)["not-applicable"] == 1
    root = ET.parse(report.write_junit(results, tmp_path / "j.xml", "s", 1.0)).getroot()
    assert root.get("skipped") == "1" and root.get("errors") == "0"
    assert next(root.iter("skipped")).get("message") == f"not applicable: {API}"
    assert f"| not-applicable ({API}) |" in report.markdown(report.document(results, "m.yaml", 1.0))
    assert _summarize(results, "t", 1.0, None, "t") == 0
    assert _summarize([*results, CaseResult("e[x]", "c", "m", "b", "s", "t", status="error", error="boom")], "t", 1.0, None, "t") == 1


PINS = {"torch": "2.14.1", "megatron-core": "0.19.2", "megatron-bridge": "0.6.2"}


def _gate(base_status: str, cand: CaseResult, cand_versions: dict):
    base = {"versions": PINS, "results": [{"id": cand.id, "status": base_status, "checks": []}]}
    cdoc = {"versions": cand_versions, "results": [cand.to_dict()]}
    return compare(base, cdoc), cdoc


def test_the_gate_counts_a_removed_public_api_as_a_break_and_an_internal_one_as_a_hole():
    old = {**PINS, "megatron-core": "0.16.1", "megatron-bridge": "0.3.1"}
    (f,), cdoc = _gate("passed", _na("API not available in megatron-bridge 0.3.1: AttributeError: 'AutoBridge' object has no attribute 'save_hf_adapter'"), old)
    assert f.kind == "api-break" and f.failing and exit_code([f]) == 1
    base = {"versions": PINS, "results": [{"id": "c[x]", "status": "passed", "checks": []}]}
    assert evaluated_ids(base, cdoc, [f]) == ["c[x]"]  # a break for users is a real result
    (g,), cdoc = _gate("passed", _na(API), old)
    assert g.kind == "not-evaluated" and not g.failing and evaluated_ids(base, cdoc, [g]) == []
    # the reverse (an older base lacks the API): listed, never a regression nor a fix
    base = {"versions": old, "results": [_na(API).to_dict()]}
    (h,) = compare(base, {"versions": PINS, "results": [{"id": "c[x]", "status": "passed", "checks": []}]})
    assert h.kind == "not-run" and not h.failing and "not applicable to the base" in h.detail


def test_the_sweep_table_shows_it_as_a_hole_with_its_reason():
    assert outcome(_na(API).to_dict()) == ("not-applicable", API)
    assert api_missing_parts(API) == ("megatron-core", "0.16.1", "ImportError: cannot import name 'x' from 'megatron.core._rank_utils'")


def _own_tb() -> str:
    """A rank traceback through torch's launcher into the harness's own frame that made the lookup."""
    return ('Traceback (most recent call last):\n'
            '  File "/v/lib/python3.12/site-packages/torch/multiprocessing/spawn.py", line 90, in _wrap\n'
            f'  File "{runner.__file__}", line 1, in run_case\n')


def test_a_method_missing_on_an_upstream_object_is_blamed_on_its_class_not_on_the_last_frame():
    """The message names no module, and the last site-packages frame is torch's launcher: the gate blamed
    'torch 2.14.1' for Core 0.18's DistributedOptimizer and Bridge 0.3.1's AutoBridge."""
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401  (imported, as in a run that built one)

    got = runner.api_unavailable("AttributeError", "'DistributedOptimizer' object has no attribute 'optimizer_state_keys'", _own_tb())
    assert got.startswith("API not available in megatron-core "), got
    # a class no upstream module defines names no package: not a missing API
    assert runner.api_unavailable("AttributeError", "'Nowhere' object has no attribute 'x'", _own_tb()) is None


def test_a_class_attribute_missing_is_blamed_on_the_class_package():
    """"type object 'ModelType' has no attribute 'encoder_and_decoder'" read by the harness: megatron-core's
    enum. (Read by a Bridge frame, the same lookup is Bridge's own error: tests/test_status.py.)"""
    import megatron.core.enums  # noqa: F401

    got = runner.api_unavailable("AttributeError", "type object 'ModelType' has no attribute 'encoder_and_decoder'", _own_tb())
    assert got.startswith("API not available in megatron-core "), got
