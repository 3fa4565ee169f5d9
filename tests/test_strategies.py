"""mcore_dist save/load strategies (backend options) and gradient buckets: every option is
validated with a clear error, every new check can go red (a double per fault), and the memory
phases they add are recorded. No timing is asserted."""

from __future__ import annotations

import pytest
from doubles import use_doubles

from harness.backends import get_backend, ref_of
from harness.backends._mcore_events import event_problems as _event_problems
from harness.backends.mcore_dist import McoreDistOptions
from harness.core import memory
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.judge.checks import async_finalize_check
from harness.orchestration.matrix import MatrixError, load_matrix
from harness.orchestration.runner import RunOptions, run_case

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(
    test_skip_async_finalize="doubles:SkipAsyncFinalize",
    test_default_strategies="doubles:DefaultStrategies",
    test_corrupt_second_save="doubles:CorruptSecondSave",
)


def _write(tmp_path, body: str):
    path = tmp_path / "m.yaml"
    path.write_text(body)
    return path


def _entry(tmp_path, case="resume", pairs="['dp2 -> dp2']", options="{sharding: fully_reshardable}", backend_options="{}",
           backends="[mcore_dist]", model="gpt-gqa"):
    return _write(tmp_path, f"entries: [{{case: {case}, models: [{model}], backends: {backends}, pairs: {pairs}, "
                            f"options: {options}, backend_options: {backend_options}}}]")


def _spec(case="resume", src="dp2", dst="dp2", backend="mcore_dist", backend_options=None, **opts):
    opts.setdefault("sharding", "fully_reshardable")
    return CaseSpec(case, "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    backend_options=tuple(sorted((backend_options or {}).items())), timeout_s=150)


def _checks(r):
    return {c.name: c.status for c in r.checks}


# ------------------------------------------------------------------ validation (matrix load)


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend_options="{async_save: threads}"), "option 'async_save': expected one of 'none', 'mcore', 'nvrx', got 'threads'"),
    (dict(backend_options="{load_strategy: fully_parallel}", pairs="['dp2 -> tp2']"),
     "load_strategy 'fully_parallel' distributes the load over the DP x CP group, which has one rank at target tp2pp1dp1cp1"),
    (dict(backend_options="{save_strategy: fully_parallel}", pairs="['tp2 -> dp2']"),
     "save_strategy 'fully_parallel' distributes the save over the DP x CP group, which has one rank at source tp2pp1dp1cp1"),
    (dict(backend_options="{exchange_algo: gather_object}"), "exchange_algo 'gather_object' .* needs load_strategy 'fully_parallel'"),
    (dict(backend_options="{cache_metadata: true}"), "cache_metadata caches what a previous save of the same job computed.*saves: 2"),
    (dict(case="reshard-weights", options="{}", backend_options="{async_save: mcore}"),
     "async_save 'mcore': case reshard-weights does not run an async save's finalize step"),
    (dict(case="reshard-weights", options="{}", backend_options="{cache_metadata: true}"), "cache_metadata .* saves once"),
    (dict(case="hf-roundtrip", options="{}", backends="[bridge_hf]", model="hf-llama", backend_options="{load_strategy: fully_parallel}"),
     "backend bridge_hf takes strict; unknown option\\(s\\) \\['load_strategy'\\]"),
    (dict(options="{saves: 4}"), "option 'saves' must be 1, 2 or 3"),
    (dict(options="{overlap_param_gather: true}"), "'overlap_param_gather' needs use_distributed_optimizer: true and overlap_grad_reduce: true"),
    (dict(options="{overlap_grad_reduce: true, overlap_param_gather: true, use_distributed_optimizer: false}"),
     "'overlap_param_gather' needs use_distributed_optimizer"),
])
def test_each_strategy_and_bucket_option_is_validated_with_a_clear_error(tmp_path, kwargs, message):
    with pytest.raises(MatrixError, match=message) as exc:
        load_matrix(_entry(tmp_path, **kwargs))
    assert "entries[0]" in str(exc.value)


def test_nvrx_without_nvidia_resiliency_ext_is_not_run_with_the_reason_and_never_launches(tmp_path, monkeypatch):
    import importlib.util

    from harness.backends import mcore_dist
    from harness.orchestration.runner import RunOptions, not_run_reason

    real = importlib.util.find_spec
    monkeypatch.setattr(mcore_dist.importlib.util, "find_spec", lambda name, *a: None if name == mcore_dist.NVRX_MODULE else real(name, *a))
    (spec,) = load_matrix(_entry(tmp_path, backend_options="{async_save: nvrx}")).cases
    r = run_case(spec)
    assert r.status == "not-run" and r.phases["total"] == 0.0 and not r.memory  # nothing launched
    assert "needs nvidia-resiliency-ext" in r.not_run_reason
    # installed: the same entry runs (no reason)
    monkeypatch.setattr(mcore_dist.importlib.util, "find_spec", lambda name, *a: object() if name == mcore_dist.NVRX_MODULE else real(name, *a))
    assert not_run_reason(spec, RunOptions(dist_backend="gloo")) is None


def test_default_options_call_dist_checkpointing_exactly_as_before():
    b = get_backend("mcore_dist")
    assert b.strategy == McoreDistOptions() and b._save_strategy_obj() is None and b._load_strategy_obj() is None
    assert b.strategy_check({}) is None and not b.saves_async


# ------------------------------------------------------------------ judges (in-process, synthetic)


def test_async_finalize_check_fails_for_each_way_a_finalize_goes_wrong():
    ok = {"directory": "c", "complete_before": False, "complete_after": True}
    assert async_finalize_check([[ok], [ok]], ["c"], {"c": True}).status == "passed"
    cases = {
        "never finalized on rank(s) [1]": ([[ok], []], {"c": True}),
        "already a complete checkpoint before its finalize step": ([[{**ok, "complete_before": True}], [ok]], {"c": True}),
        "not a complete checkpoint after its finalize step": ([[ok], [{**ok, "complete_after": False}]], {"c": True}),
        "not a complete checkpoint when the job ended": ([[ok], [ok]], {"c": False}),
    }
    for why, (records, now) in cases.items():
        check = async_finalize_check(records, ["c"], now)
        assert check.status == "failed" and why in check.detail, (why, check.detail)


def _save_event(n=1, **kw):
    return {"op": "save", "n": n, "strategy": "fully_parallel", "group": 2, "dp_cp": 2, "plan_reuse": None, "validated": True,
            "async": "none", "distribution": "computed", **kw}


def test_strategy_event_judge_names_every_mismatch():
    fp = McoreDistOptions(save_strategy="fully_parallel", load_strategy="fully_parallel")
    assert _event_problems(fp, _save_event()) == []
    assert "ran the default save strategy" in _event_problems(fp, _save_event(strategy="default"))[0]
    assert "group of 4 ranks, the DP x CP group has 2" in _event_problems(fp, _save_event(group=4))[0]
    load = {"op": "load", "strategy": "fully_parallel", "group": 2, "dp_cp": 2, "exchanges": 0}
    assert "no tensor exchange" in _event_problems(fp, load)[0]
    assert _event_problems(fp, {**load, "exchanges": 1}) == []
    gather = McoreDistOptions(load_strategy="fully_parallel", exchange_algo="gather_object")
    assert _event_problems(gather, {**load, "exchanges": 1, "exchange_algos": ["gather_object"]}) == []
    assert _event_problems(gather, {**load, "exchanges": 1, "exchange_algos": ["broadcast"]}) == [
        "exchanged with broadcast, asked gather_object"]
    cached = McoreDistOptions(cache_metadata=True)
    levels = [_save_event(n, strategy="default", distribution=None, plan_reuse=min(n - 1, 2), validated=n == 1) for n in (1, 2, 3)]
    assert all(_event_problems(cached, e) == [] for e in levels)
    assert "megatron-core's cache gives save 3 level 2" in _event_problems(cached, {**levels[2], "plan_reuse": 1})[0]
    assert "validate_access_integrity=True" in _event_problems(cached, {**levels[1], "validated": True})[0]
    assert "async_save none, asked mcore" in _event_problems(McoreDistOptions(async_save="mcore"),
                                                             _save_event(strategy="default", distribution=None))[0]
    backend = get_backend(ref_of(_spec(backend_options={"async_save": "mcore"})))
    assert backend.strategy_check({}).status == "failed" and "no save ran" in backend.strategy_check({}).detail


def test_memory_keeps_a_repeated_phase_and_leaves_the_outer_hwm_to_the_outer_phase():
    memory.start_recording()
    with memory.track("save"):
        with memory.track("exchange") as inner:
            pass
    with memory.track("save"):
        pass
    phases = memory.stop_recording()
    assert sorted(phases) == ["exchange", "save", "save#2"]
    assert inner.kernel_hwm is None  # nested: sampled only


# ------------------------------------------------------------------ real runs that must go red


def test_an_async_save_whose_finalize_is_skipped_fails_the_case_and_is_never_loaded():
    r = run_case(_spec(backend="test_skip_async_finalize", backend_options={"async_save": "mcore"}, steps=1))
    assert r.status == "failed", r.failure_text()
    assert _checks(r)["async-finalize"] == "failed" and "never finalized" in r.check("async-finalize").detail
    assert "not a complete checkpoint when the job ended" in r.check("async-finalize").detail
    assert _checks(r)["losses"] == "not-run" and "load" not in r.phases  # nothing incomplete was resumed from


def test_async_save_passes_and_shows_its_finalize_phase():
    r = run_case(_spec(case="reshard-optimizer", dst="dp1", backend_options={"async_save": "mcore"}, steps=1))
    assert r.status == "passed", r.failure_text()
    assert _checks(r)["async-finalize"] == "passed" and _checks(r)["strategy"] == "passed"
    assert set(r.memory["save:finalize"]) == {"0", "1"} and "mcore_dist async_save: cross-process write-results queue" in r.compat_shims


def test_options_that_never_reach_the_call_fail_the_strategy_check():
    r = run_case(_spec(case="reshard-optimizer", backend="test_default_strategies", steps=1,
                       backend_options={"save_strategy": "fully_parallel", "load_strategy": "fully_parallel"}))
    assert r.status == "failed" and _checks(r)["strategy"] == "failed"
    assert "ran the default save strategy, asked fully_parallel" in r.check("strategy").detail
    assert "ran the default load strategy" in r.check("strategy").detail
    assert _checks(r)["optimizer-state"] == "passed"  # the data is right: only the strategy check sees it


def test_a_corrupt_second_save_fails_only_the_second_checkpoints_checks():
    r = run_case(_spec(backend="test_corrupt_second_save", saves=2, steps=1, backend_options={"cache_metadata": True}))
    assert r.status == "failed"
    c = _checks(r)
    assert c["losses"] == c["final-weights"] == c["strategy"] == "passed"
    assert c["resave-final-weights@2"] == "failed"


def test_saves_without_megatrons_param_sync_under_overlap_param_gather_fail():
    opts = dict(case="reshard-optimizer", dst="dp1", steps=1, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4000,
                sharding="dp_reshardable", workarounds=["prime_adam", "load_no_grad", "unshare_adam_step"])
    good = run_case(_spec(**opts))
    assert _checks(good)["model-weights"] == "passed" and _checks(good)["propagation"] == "passed", good.failure_text()
    bad = run_case(_spec(**opts), RunOptions(rank_hooks=("doubles:skip_param_sync",)))
    assert _checks(bad)["model-weights"] == "failed", bad.failure_text()


def test_the_async_writer_is_asked_for_the_way_each_core_line_takes_it():
    """`save(async_strategy=)` arrived in megatron-core 0.17; 0.15/0.16 write async with their own
    writer only. The Core sweep saw `save() got an unexpected keyword argument 'async_strategy'` on
    0.15.3 and 0.16.1; another writer there is a missing API (a hole), named as one."""
    from harness.backends.mcore_dist import async_save_kwargs
    from harness.orchestration.runner import api_unavailable

    def save_019(sharded_state_dict, checkpoint_dir, sharded_strategy=None, async_sharded_save=False, async_strategy="nvrx"):
        """megatron-core 0.19's signature (the parts that matter here)"""

    def save_016(sharded_state_dict, checkpoint_dir, sharded_strategy=None, async_sharded_save=False):
        """megatron-core 0.16's"""

    assert async_save_kwargs(save_019, "mcore") == {"async_strategy": "mcore"}
    assert async_save_kwargs(save_016, "mcore") == {}
    with pytest.raises(AttributeError) as err:
        async_save_kwargs(save_016, "nvrx")
    import traceback

    tb = "".join(traceback.format_exception(err.value))  # raised in the harness's own driver: its lookup, a hole
    assert api_unavailable("AttributeError", str(err.value), tb).startswith("API not available in megatron-core ")


def test_verify_integrity_is_asked_of_both_entries_and_its_manifest_checked():
    """Megatron-LM's verify_integrity reaches save() and load() as `verify_integrity=True` (a release
    without the keyword misses the API: a hole); a save that left no integrity.json fails the strategy
    check (the corrupt-load entries in faults.yaml show the load refusing damaged files)."""
    from harness.orchestration.runner import api_unavailable

    def save_019(sharded_state_dict, checkpoint_dir, sharded_strategy=None, verify_integrity=False):
        """megatron-core 0.19's signature (the part that matters here)"""

    def load_018(sharded_state_dict, checkpoint_dir, sharded_strategy=None, strict=None):
        """megatron-core 0.18's"""

    on = get_backend(ref_of(_spec(backend_options={"verify_integrity": True})))
    assert get_backend("mcore_dist")._integrity(save_019) == {} and on._integrity(save_019) == {"verify_integrity": True}
    with pytest.raises(AttributeError) as err:
        on._integrity(load_018)
    import traceback

    assert api_unavailable("AttributeError", str(err.value), "".join(traceback.format_exception(err.value))).startswith(
        "API not available in megatron-core ")
    opts = McoreDistOptions(verify_integrity=True)
    saved = _save_event(strategy="default", distribution=None)
    assert _event_problems(opts, {**saved, "manifest": True}) == []
    assert _event_problems(opts, {**saved, "manifest": False}) == [
        "the save wrote no integrity manifest (integrity.json), though verify_integrity asked for one"]
