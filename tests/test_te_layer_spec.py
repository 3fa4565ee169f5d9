"""`layer_spec: te`: derived requirements (not-run without TE, naming the module), the CP>1
logits path (zigzag split and gather, in-process), and the contract rules; the TE forward itself
runs only on the nightly GPU tier."""

from __future__ import annotations

import pytest
import torch

from harness.cases.reshard_weights import (
    LOGITS_CP_TOLERANCE,
    WeightsOut,
    logits_check,
    logits_tolerance,
)
from harness.core import requires
from harness.core.topology import Topology
from harness.models.mcore import cp_positions, cp_unshard
from harness.orchestration.runner import RunOptions, run_case


@pytest.mark.parametrize("seq, cp", [(16, 1), (16, 2), (16, 4), (128, 8)])
def test_cp_split_is_megatrons_zigzag_and_gathers_back(seq, cp):
    parts = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))  # every position on exactly one rank
    if cp == 2:
        assert parts[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and parts[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.randn(2, seq, 5)
    assert torch.equal(cp_unshard([x[:, p] for p in parts], seq), x)


def test_te_entries_derive_te_and_cuda(tmp_path, matrix_error):
    from harness.orchestration.matrix import load_matrix

    p = tmp_path / "m.yaml"
    p.write_text("entries:\n  - {case: reshard-weights, models: [gpt-gqa], pairs: ['cp2 -> cp1'], options: {layer_spec: te}}\n"
                 "  - {case: resume, models: [gpt-gqa], pairs: ['tp2 -> tp1'], axes: {layer_spec: [local, te]}}\n")
    specs = load_matrix(p).cases
    assert [s.requires for s in specs] == [("cuda", "te"), (), ("cuda", "te")]
    assert "layer_spec 'te' with cp > 1" in matrix_error(
        "{case: reshard-optimizer, models: [gpt-gqa], pairs: ['cp2 -> cp1'], options: {layer_spec: te}}")
    assert "option 'layer_spec': expected one of 'local', 'te'" in matrix_error(
        "{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], options: {layer_spec: transformer-engine}}")


def test_a_te_case_without_transformer_engine_is_not_run_naming_the_module(monkeypatch):
    from harness.core.spec import CaseSpec

    monkeypatch.setattr(requires, "probe", lambda: requires.Machine(8, True, "No module named 'transformer_engine'", 512.0))
    spec = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(cp=2), Topology(), options=(("layer_spec", "te"),))
    r = run_case(spec, RunOptions())  # built in code: the runner derives te from the option as the loader does
    assert r.status == "not-run" and r.not_run_reason == "needs Transformer-Engine: No module named 'transformer_engine'"


def _out(logits):
    return WeightsOut([], logits, 0)


def test_logits_run_at_cp_gt_1_with_te_and_are_not_run_with_the_local_spec():
    a = torch.randn(2, 16, 8)
    cp2, cp1 = Topology(cp=2), Topology()
    assert logits_check([_out(a)], [_out(a)], cp2, cp1).status == "not-run"
    te = logits_check([_out(a)], [_out(a + 1e-6)], cp2, cp1, layer_spec="te")
    assert te.status == "passed" and te.tolerance.label.startswith("atol=1e-05")
    bad = logits_check([_out(a)], [_out(a + 1e-2)], cp2, cp1, layer_spec="te")
    assert bad.status == "failed"
    assert logits_tolerance(cp2, cp1, "fp32") is LOGITS_CP_TOLERANCE and logits_tolerance(cp2, cp2, "fp32") is None


def test_a_cp_change_shares_the_tp_rule_by_construction():
    """CP cannot be measured on CPU (no CP forward without TE): its bound is the TP bound, the same
    numbers, never a copy that could drift."""
    from harness.cases.reshard_weights import (
        LOGITS_CP_TOLERANCE_BF16,
        LOGITS_TP_TOLERANCE,
        LOGITS_TP_TOLERANCE_BF16,
    )

    assert (LOGITS_CP_TOLERANCE.atol, LOGITS_CP_TOLERANCE.rtol) == (LOGITS_TP_TOLERANCE.atol, LOGITS_TP_TOLERANCE.rtol)
    assert (LOGITS_CP_TOLERANCE_BF16.atol, LOGITS_CP_TOLERANCE_BF16.rtol) == (LOGITS_TP_TOLERANCE_BF16.atol,
                                                                            LOGITS_TP_TOLERANCE_BF16.rtol)
