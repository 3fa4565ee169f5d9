"""Restored state starts from decoys (issue item 4): bridge_training's rng-state check compares the
RNG states after a load with the save's, and the loading job used to start from the same seed with
nothing drawing in between, so a load that restored no tracker state passed. Every generator now
starts from a decoy before the load (harness.backends.bridge_training.RngDecoy): planting a no-op
`CudaRNGStatesTracker.set_states` in the ranks turns the check red, the unplanted run stays green."""

from __future__ import annotations

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case


def noop_tracker_set_states() -> None:
    """Rank hook: megatron's RNG tracker keeps whatever states it holds when a load restores them
    (the CPU shim binds the class method when it seeds the tracker, after the hooks ran)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    CudaRNGStatesTracker.set_states = lambda self, states: None


def _resume(src: str = "dp2", dst: str = "dp2") -> CaseSpec:
    opts = {"sharding": "fully_reshardable", "lr_schedule": "warmup-cosine"}
    return CaseSpec("resume", "gpt-gqa", "bridge_training", Topology.parse(src), Topology.parse(dst),
                    options=tuple(sorted(opts.items())), timeout_s=200)


def test_a_load_that_restores_no_tracker_state_fails_rng_state_and_the_real_one_passes(tmp_path):
    planted = run_case(_resume(), RunOptions(workdir=tmp_path, rank_hooks=("test_restore_decoys:noop_tracker_set_states",)))
    rng = planted.check("rng-state")
    assert rng.status == "failed" and "tracker not restored" in rng.detail, planted.failure_text()
    assert "python" not in rng.detail.split("not restored")[0]  # only the tracker stayed at its decoy
    real = run_case(_resume(), RunOptions(workdir=tmp_path))
    assert real.check("rng-state").status == "passed" and "each from a decoy" in real.check("rng-state").detail, real.failure_text()
    assert real.check("train-state").status == "passed", real.failure_text()  # flops: Bridge 0.6.2 rounds it to float32


def _verl(rng=None, before=None, sched=None, sched_before=None):
    from harness.cases.ranks.verl_checkpoint import VerlOut

    return VerlOut([], [], [], rng=rng or {"torch": "a", "tracker": "t0"}, rng_before=before, scheduler=sched, scheduler_before=sched_before)


def test_verl_rng_and_scheduler_prove_nothing_where_the_state_before_the_load_was_the_saved_one():
    """verl's rng and scheduler judges: a loaded rank recorded at the saved state before its load
    proves nothing (not-run, saying so); from a decoy the same comparison passes; no loaded rank fails."""
    from harness.cases import verl_checkpoint as vc

    decoy = {"torch": "d", "tracker": "d0"}
    assert vc.rng_check([_verl()], [_verl(before=decoy)]).status == "passed"
    same = vc.rng_check([_verl()], [_verl(before={"torch": "a", "tracker": "t0"})])
    assert same.status == "not-run" and "already equalled the saved one" in same.detail
    assert vc.rng_check([_verl()], [_verl(rng=decoy, before=decoy)]).status == "failed"  # a load that restored nothing
    assert vc.rng_check([_verl()], []).status == "failed" and "no rank loaded" in vc.rng_check([_verl()], []).detail
    fresh, trained = {"state": {"num_steps": 0.0}, "lr": [1e-4]}, {"state": {"num_steps": 2.0}, "lr": [1e-3]}
    assert vc.scheduler_check([_verl(sched=trained)], [_verl(sched=trained, sched_before=fresh)]).status == "passed"
    at_zero = vc.scheduler_check([_verl(sched=fresh)], [_verl(sched=fresh, sched_before=fresh)])
    assert at_zero.status == "not-run" and "already equalled the saved one" in at_zero.detail
    assert vc.scheduler_check([_verl(sched=trained)], [_verl(sched=fresh, sched_before=fresh)]).status == "failed"
    assert vc.scheduler_check([_verl(sched=trained)], []).status == "failed"


def test_a_convert_case_without_a_converter_runs_no_check_and_passes_none(tmp_path, monkeypatch):
    """convert with no Megatron-LM converter to run: every check is not-run, naming why; none
    passes (the runner then records the case not-run, never passed)."""
    from harness.cases.convert import CASE
    from harness.compat import megatron_lm as mlm

    monkeypatch.setenv(mlm.ENV, str(tmp_path))  # a Megatron-LM checkout without tools/checkpoint
    spec = CaseSpec("convert", "gpt-gqa", "mcore_dist", Topology.parse("tp1"), Topology.parse("tp1"), timeout_s=120)
    r = run_case(spec, RunOptions(workdir=tmp_path))
    assert {c.name for c in r.checks} >= set(CASE.checks), r.failure_text()
    convert_checks = [c for c in r.checks if c.name in CASE.checks]
    assert all(c.status == "not-run" and "no Megatron-LM converter to run" in c.detail for c in convert_checks), r.failure_text()
    assert r.status != "passed"
