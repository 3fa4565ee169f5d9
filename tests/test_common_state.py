"""common-state (cases/common_state.py): ranks that disagree on the common state at a save. The judges
against synthetic warnings (each way a warning can fall short goes red), and one real world with
megatron-core's common-state comparison planted away."""

from __future__ import annotations

import pytest

from cases.common_state import judge_loaded, judge_warned
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

GOOD = ("Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], Keys only on 1: [], "
        "Mismatched keys: [(('harness_common', 'step'), <class 'int'>, <class 'int'>), (('harness_common', 'tensor'), ...)]")


def test_the_warning_judge_passes_only_a_warning_naming_every_differing_path():
    assert judge_warned([[], [GOOD]], "value").status == "passed"
    cases = {
        "logged no common-state warning": [[], []],
        "rank 0 warned": [[GOOD], [GOOD]],
        "does not name ('harness_common', 'tensor')": [[], [GOOD.split(", (('harness_common', 'tensor')")[0]]],
        "names ('harness_common', 'tag'), which does not differ": [[], [GOOD + " ('harness_common', 'tag')"]],
        # an index past the end of a list (dict_utils' range off by one) is no differing entry either
        "names ('harness_common', 'history', 3), which does not differ": [[], [GOOD + " ('harness_common', 'history', 3)"]],
        "no rank to differ from rank 0": [[]],
    }
    for why, warnings in cases.items():
        c = judge_warned(warnings, "value")
        assert c.status == "failed" and why in c.detail, (why, c.detail)


def test_the_load_judge_wants_rank_0s_common_state_on_every_rank():
    ref = {"step": 100, "tensor": [0.0, 1.0, 2.0, 3.0], "history": [1, 2], "tag": "run-a"}
    assert judge_loaded([ref, dict(ref)], "value").status == "passed"
    c = judge_loaded([ref, {**ref, "step": 101}], "value")
    assert c.status == "failed" and "rank 1: " in c.detail
    assert judge_loaded([], "value").status == "failed" and judge_loaded([None], "value").status == "failed"


def _spec(divergence: str) -> CaseSpec:
    return CaseSpec("common-state", "gpt-gqa", "mcore_dist", Topology.parse("tp2"), Topology.parse("tp1pp2"),
                    options=(("divergence", divergence),), axes=("divergence",), timeout_s=90)


@pytest.mark.faults
def test_a_core_that_stops_comparing_the_common_state_fails_warned_only(monkeypatch):
    from megatron.core.dist_checkpointing import validation

    assert run_case(_spec("key")).status == "passed"
    monkeypatch.setattr(validation, "_validate_common_state_dict", lambda common_state_dict: None)  # forked ranks inherit it
    r = run_case(_spec("key"))
    assert r.status == "failed" and r.check("warned").status == "failed" and r.check("loaded-common").status == "passed"
    assert "rank 1 differs from rank 0 (key) and logged no common-state warning" in r.check("warned").detail


def test_a_tensor_of_another_shape_must_be_named_as_a_mismatch():
    """tensor-shape: the others' tensor has one element more; torch cannot compare it elementwise, so the
    warning must still list the tensor's path among the mismatched keys (and name no other path)."""
    shaped = ("Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], Keys only on 1: [], "
              "Mismatched keys: [(('harness_common', 'tensor'), <class 'torch.Tensor'>, <class 'torch.Tensor'>, torch.Size([4]), "
              "torch.Size([5]))]")
    assert judge_warned([[], [shaped]], "tensor-shape").status == "passed"
    silent = shaped.replace("(('harness_common', 'tensor'), <class 'torch.Tensor'>, <class 'torch.Tensor'>, torch.Size([4]), "
                            "torch.Size([5]))", "")
    c = judge_warned([[], [silent]], "tensor-shape")
    assert c.status == "failed" and "does not name ('harness_common', 'tensor')" in c.detail
    c = judge_warned([[], [GOOD]], "tensor-shape")  # the step never differed here
    assert c.status == "failed" and "names ('harness_common', 'step'), which does not differ" in c.detail
