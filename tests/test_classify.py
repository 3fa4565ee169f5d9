"""Partial environments (issue 18 item 4): a red candidate case is the candidate's fault only when
the candidate is to blame. Hand-made results.json documents through compare, as the gate sees them."""

from __future__ import annotations

from harness.gate import classify
from harness.gate.compare import compare, exit_code

PINS = {"torch": "2.14.1", "megatron-core": "0.19.2", "megatron-bridge": "0.6.2", "transformers": "5.12.1"}


def doc(versions: dict, **cases: tuple[str, str]) -> dict:
    return {"versions": versions, "results": [
        {"id": cid, "status": status, "error": error or None, "checks": []} for cid, (status, error) in cases.items()]}


def run(cand_versions: dict, status: str, error: str):
    base = doc(PINS, **{"reshard-optimizer[x]": ("passed", "")})
    cand = doc(cand_versions, **{"reshard-optimizer[x]": (status, error)})
    return compare(base, cand), cand


def test_an_api_missing_in_a_package_unchanged_on_both_sides_is_never_the_candidate():
    cand_v = {**PINS, "megatron-core": "0.18.2", "megatron-bridge": "0.5.1"}
    (f,), _ = run(cand_v, "error", "API not available in torch 2.14.1: AttributeError: 'DistributedOptimizer' object "
                                   "has no attribute 'optimizer_state_keys'\nWorldError: rank 0 raised")
    assert f.kind == "not-evaluated" and not f.failing
    assert "same version on both sides" in f.detail and "torch 2.14.1" in f.detail


def test_a_public_api_the_candidate_removed_is_a_breaking_change_that_fails():
    cand_v = {**PINS, "megatron-bridge": "0.3.1", "megatron-core": "0.16.1"}
    (f,), _ = run(cand_v, "error", "API not available in megatron-bridge 0.3.1: AttributeError: 'AutoBridge' object "
                                   "has no attribute 'save_hf_adapter'")
    assert f.kind == "api-break" and f.failing and "save_hf_adapter" in f.detail
    assert exit_code([f]) == 1


def test_an_internal_api_the_harness_reaches_for_is_a_coverage_hole():
    cand_v = {**PINS, "megatron-core": "0.18.2", "megatron-bridge": "0.5.1"}
    (f,), _ = run(cand_v, "error", "API not available in megatron-core 0.18.2: AttributeError: 'DistributedOptimizer' "
                                   "object has no attribute 'prepare_model_params_for_param_sync'")
    assert f.kind == "not-evaluated" and "no driver for megatron-core 0.18.2" in f.detail


def test_a_bridge_core_pair_that_is_no_release_set_excuses_only_the_harness_own_lookups():
    cand_v = {**PINS, "megatron-core": "0.18.2"}  # Bridge 0.6.2 was built against Core 0.19
    # an error raised deep in the Bridge on this pair is what whoever installs the pair hits: red, the pair named
    (f,), _ = run(cand_v, "error", 'File "/v/site-packages/megatron/bridge/models/x.py", line 1\nRuntimeError: something deep in the Bridge')
    assert f.failing and "not a valid release set" in f.detail
    # a Bridge case whose error is an API the harness reached for, which the paired-for Core has and this one lacks
    (g,), _ = run(cand_v, "not-applicable", "API not available in megatron-core 0.18.2: ModuleNotFoundError: No module named "
                  "'megatron.core._rank_utils'\nFile \"/v/site-packages/megatron/bridge/__init__.py\"")
    assert g.kind == "not-evaluated" and "not a valid release set" in g.detail


def test_a_core_only_case_beside_an_invalid_pair_is_judged_as_any_other():
    """Core 0.15.3 beside the pinned Bridge 0.6.2: an mcore_dist case that errors in Core is a real result."""
    cand_v = {**PINS, "megatron-core": "0.15.3"}
    (f,), _ = run(cand_v, "error", "NameError: name 'warnings' is not defined")
    assert f.kind in ("regression", "new-refusal") and f.failing


def test_a_package_the_table_does_not_list_is_known_unchanged_from_the_pip_freeze():
    base = {**doc(PINS, **{"r[x]": ("passed", "")}), "environment": {"pip_freeze": ["pyarrow==26.0.1", "numpy==2.5.5"]}}
    cand = {**doc({**PINS, "megatron-core": "0.15.3"}, **{"r[x]": ("error", "API not available in pyarrow 26.0.1: ImportError: "
                                                                         "pyarrow requires NumPy 2.0 or newer, found 1.26.4")}),
            "environment": {"pip_freeze": ["pyarrow==26.0.1", "numpy==1.26.4"]}}
    (f,) = compare(base, cand)
    assert f.kind == "not-evaluated" and "same version on both sides" in f.detail and "pyarrow 26.0.1" in f.detail


def test_a_wrong_value_stays_a_regression_and_a_valid_pair_error_stays_red():
    cand_v = {**PINS, "megatron-core": "0.19.1"}
    (f,), _ = run(cand_v, "failed", "")
    assert f.kind == "regression" and f.failing
    (g,), _ = run(cand_v, "error", "RuntimeError: boom")
    assert g.kind in ("regression", "new-refusal") and g.failing


def test_evaluated_counts_only_real_results_on_a_green_baseline():
    from harness.gate.evidence import evaluated_ids

    base = doc(PINS, **{"reshard-optimizer[x]": ("passed", "")})
    cand_v = {**PINS, "megatron-core": "0.18.2"}
    findings, cand = run(cand_v, "not-applicable", "API not available in megatron-core 0.18.2: AttributeError: "
                         "'DistributedOptimizer' object has no attribute 'x'")  # a hole: nothing seen
    assert evaluated_ids(base, cand, findings) == []
    findings, cand = run(cand_v, "error", "RuntimeError: x")  # a real result
    assert evaluated_ids(base, cand, findings) == ["reshard-optimizer[x]"]
    red = doc(PINS, **{"reshard-optimizer[x]": ("error", "RuntimeError: baseline broken")})
    assert evaluated_ids(red, cand, findings) == []  # a red baseline is no evidence either way


def test_missing_name_reads_each_error_form():
    assert classify.missing_name("AttributeError: module 'x' has no attribute 'GroupedLinear'") == "GroupedLinear"
    assert classify.missing_name("ImportError: cannot import name 'save_hf_adapter' from 'a.b'") == "save_hf_adapter"
    assert classify.missing_name("ModuleNotFoundError: No module named 'megatron.core.dist_checkpointing.strategies.base'") == "base"
    assert classify.missing_name("ValueError: nothing missing") is None
