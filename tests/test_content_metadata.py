"""Content metadata (issue 18 item 3, audit rows 1 and 9): a training save passes the job's
sharded_state_dict metadata as Megatron-LM builds it, and the load builds the sharded state from
what the checkpoint says; the `strategy` check fails when the round trip loses or changes it."""

from __future__ import annotations

from harness.backends._mcore_events import event_problems as _event_problems
from harness.backends.mcore_dist import McoreDist, McoreDistOptions
from harness.models.training.views import users_metadata

JOB = users_metadata("fully_reshardable", False)


def test_users_metadata_is_megatron_lms():
    assert JOB == {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": False,
                   "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert users_metadata("dp_reshardable", True) == {"distrib_optim_sharding_type": "dp_reshardable",
                                                       "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert "distrib_optim_sharding_type" not in users_metadata(None, False)


def _events(read):
    save = {"op": "save", "n": 1, "strategy": "default", "group": None, "dp_cp": 1, "plan_reuse": None, "validated": True, "async": "none",
            "backend": "mcore_dist"}
    return {"save": {"0": [save]}, "load": {"0": [{"op": "content_metadata", "read": read, "job": JOB, "backend": "mcore_dist"}]}}


def test_a_lost_or_changed_content_metadata_fails_the_strategy_check():
    on = McoreDist()
    assert on.strategy_check(_events(dict(JOB))).status == "passed"
    lost = on.strategy_check(_events(None))
    assert lost.status == "failed" and "holds no content metadata" in lost.detail
    changed = on.strategy_check(_events({**JOB, "distrib_optim_sharding_type": "dp_reshardable"}))
    assert changed.status == "failed" and "differs from what the job saves" in changed.detail
    # written without it on purpose (as before Core 0.13): nothing to read back, nothing wrong
    off = McoreDistOptions(content_metadata=False)
    assert _event_problems(off, {"op": "content_metadata", "read": None, "job": JOB}) == []


def test_no_training_load_and_default_options_ask_nothing():
    save_only = {"save": _events(None)["save"]}
    assert McoreDist().strategy_check(save_only) is None
