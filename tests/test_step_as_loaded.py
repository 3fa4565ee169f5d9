"""The Adam step check judges the state as upstream's load left it, not as a workaround rewrote it
(issue item 6): planted shared or wrong step tensors turn it red, and a rewrite it was not told
about cannot turn it green."""

from pathlib import Path
from types import SimpleNamespace

import torch

from harness.cases.ranks.train_phase import TrainOut, step_check
from harness.models.training import TrainingJob, adam_steps, load_training, unshare_adam_step


def _out(values=(2.0,), shared=0, as_loaded=None):
    return TrainOut([], [], [], steps={"values": list(values), "shared_step_tensors": shared}, steps_as_loaded=as_loaded)


def _loaded(values=(2.0,), shared=26, rewritten_by=()):
    return {"values": list(values), "shared_step_tensors": shared, "rewritten_by": list(rewritten_by)}


def test_sharing_a_workaround_undid_passes_and_says_so():
    c = step_check([_out()], [_out(as_loaded=_loaded(rewritten_by=["unshare_adam_step"]))], "dp2", "dp1")
    assert c.status == "passed", c.detail
    assert "as loaded, 26 param(s) share another param's Adam step tensor" in c.detail
    assert "workaround unshare_adam_step gave each param its own" in c.detail


def test_sharing_left_for_training_fails():
    c = step_check([_out()], [_out(shared=26, as_loaded=_loaded())], "dp2", "dp1")
    assert c.status == "failed" and "share another param's Adam step tensor" in c.detail


def test_sharing_rewritten_by_no_recorded_workaround_fails():
    # the state after the load holds no sharing, but nothing says who removed what the load left
    c = step_check([_out()], [_out(as_loaded=_loaded())], "dp2", "dp1")
    assert c.status == "failed"


def test_a_wrong_step_as_loaded_fails_even_when_the_state_was_repaired_later():
    c = step_check([_out()], [_out(values=(2.0,), as_loaded=_loaded(values=(0.0,), shared=0))], "dp2", "dp1")
    assert c.status == "failed" and "at dp1: [0.0]" in c.detail


def test_without_a_load_record_the_view_itself_is_judged():
    assert step_check([_out()], [_out()], "w", "dp1").status == "passed"
    assert step_check([_out()], [_out(shared=3)], "w", "dp1").status == "failed"


class _SharingLoad:
    """A backend whose load leaves one step tensor in every param's Adam state, as megatron-core
    0.19.2's DistributedOptimizer.load_state_dict does without Apex/TE."""

    def load_training(self, ctx, job, directory):
        step = torch.tensor(2.0)
        for st in job.optimizer.optimizer.state.values():
            st["step"] = step


def _job(n=4):
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(n)]
    adam = torch.optim.Adam(params)
    for p in params:
        adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    return TrainingJob([], SimpleNamespace(optimizer=adam))


def test_load_training_records_the_sharing_before_the_workaround_rewrites_it():
    job = _job()
    as_loaded = load_training(None, _SharingLoad(), job, Path("."), ("unshare_adam_step",))
    assert as_loaded == {"values": [2.0], "shared_step_tensors": 3, "rewritten_by": ["unshare_adam_step"]}
    assert adam_steps(job.optimizer)["shared_step_tensors"] == 0  # what training goes on with


def test_load_training_without_the_workaround_leaves_upstreams_sharing():
    job = _job()
    as_loaded = load_training(None, _SharingLoad(), job, Path("."), ())
    assert as_loaded["shared_step_tensors"] == 3 and as_loaded["rewritten_by"] == []
    assert adam_steps(job.optimizer)["shared_step_tensors"] == 3
    assert unshare_adam_step(job.optimizer) == 3 and unshare_adam_step(job.optimizer) == 0
