"""reshard-optimizer and resume can fail: corrupted optimizer state, a lost config knob,
a load that should have refused, an expected failure that fails for another reason."""

import dataclasses
import types

from doubles import use_doubles

from harness.core.spec import CaseSpec, XFail
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(
    test_corrupt_optimizer="doubles:CorruptOptimizerAfterLoad",
    test_weight_off_main="doubles:ModelWeightOffMainParam",
)


def _spec(case="reshard-optimizer", src="dp2", dst="dp1", expect="pass", **opts):
    opts.setdefault("sharding", "fully_reshardable")
    return CaseSpec(case, "gpt-gqa", opts.pop("backend", "mcore_dist"), Topology.parse(src), Topology.parse(dst),
                    options=tuple(sorted(opts.items())), expect=expect, timeout_s=120)


def _checks(r):
    return {c.name: c.status for c in r.checks}




def test_fully_reshardable_dp_change_passes_every_check():
    r = run_case(_spec())
    assert r.status == "passed", r.failure_text()
    assert _checks(r) == {**dict.fromkeys(["propagation", "optimizer-state", "step", "model-weights", "strategy"], "passed"),
                          "weights-match-main-params": "not-run"}  # fp32: no main/model split; strategy: the content metadata read back
    assert r.memory["save"]["0"]["shard_bytes"] > 0 and "load" in r.memory


def test_one_bit_of_exp_avg_flipped_after_load_fails_optimizer_state():
    r = run_case(_spec(backend="test_corrupt_optimizer"))
    assert r.status == "failed"
    assert _checks(r)["optimizer-state"] == "failed" and _checks(r)["model-weights"] == "passed"
    (m,) = r.check("optimizer-state").mismatches
    assert m.key.startswith("optimizer.state.exp_avg.") and m.actual == "tp1pp1dp1cp1"


def test_a_config_knob_that_never_reaches_ddp_fails_propagation():
    # the knob is dropped on the way to DDP, as in verl PR #5775: a rank hook (by import path) breaks the build
    r = run_case(_spec(use_distributed_optimizer=False), RunOptions(rank_hooks=("doubles:drop_distributed_optimizer_knob",)))
    assert _checks(r)["propagation"] == "failed"
    assert "use_distributed_optimizer asked False, built True" in r.check("propagation").detail


def test_a_load_expected_to_refuse_that_completes_fails():
    r = run_case(_spec(expect="refuse"))
    assert r.status == "failed" and "expected to refuse but completed" in r.check("refusal").detail


def test_a_refusal_through_an_unlisted_exception_fails():
    ok = run_case(_spec(src="tp2", dst="tp1", expect="refuse", sharding="dp_reshardable"))
    assert ok.status == "passed" and "CheckpointingException" in ok.check("refusal").detail
    assert "change DP only" in ok.check("refusal").detail
    bad = run_case(_spec(src="tp2", dst="tp1", expect="refuse", sharding="dp_reshardable", refuse_with=["ValueError"]))
    assert bad.status == "failed" and "not one of ['ValueError']" in bad.check("refusal").detail


def test_xfail_must_fail_for_the_named_reason():
    spec = dataclasses.replace(_spec(sharding="dp_reshardable"), xfail=XFail("step reset", match=r"check step failed"))
    assert run_case(spec).status == "xfailed"
    wrong = dataclasses.replace(spec, xfail=XFail("step reset", match=r"KeyError: 'step'"))
    r = run_case(wrong)
    assert r.status == "failed" and any("not as expected" in n for n in r.notes)


def test_resume_same_topology_is_bitwise():
    r = run_case(_spec("resume", src="dp2", dst="dp2"))
    assert r.status == "passed", r.failure_text()
    assert r.check("losses").tolerance.kind == "bitwise" and r.check("losses").max_abs_diff == 0.0


def test_bf16_weight_loaded_off_its_main_param_fails_weights_match_main_params():
    # real worlds, bf16 resume across a DP change: the model section comes back one bf16 ulp off on
    # rank 0 while the fp32 main params load right. The next step copies the main params down, so the
    # toleranced losses and final weights cannot see it; weights-match-main-params names key and side.
    r = run_case(_spec("resume", src="dp2", dst="dp1", dtype="bf16", backend="test_weight_off_main"))
    assert r.status == "failed"
    assert _checks(r) == {"propagation": "passed", "losses": "passed", "lr": "passed", "grad-norm": "passed", "final-weights": "passed",
                          "strategy": "passed", "weights-match-main-params": "failed"}
    (m,) = r.check("weights-match-main-params").mismatches
    assert m.kind == "value" and m.actual == "bf16 weights@load@tp1pp1dp1cp1" and m.key == "decoder.final_layernorm.weight"


def test_step_check_reads_the_adam_step_as_megatron_core_loaded_it():
    # issue item 6: with unshare_adam_step on the check still sees the sharing the load left (and names the
    # workaround that undid it); with it off, the same load fails the step check alone
    on = run_case(_spec())
    assert on.check("step").status == "passed"
    assert "as loaded, 26 param(s) share" in on.check("step").detail and "workaround unshare_adam_step" in on.check("step").detail
    off = run_case(_spec(workarounds=["prime_adam", "load_no_grad", "fully_reshardable_step", "vpp_overlap_p2p"]))
    assert off.status == "failed" and [n for n, st in _checks(off).items() if st == "failed"] == ["step"]
    assert "as loaded, 26 param(s) share another param's Adam step tensor" in off.check("step").detail


# --------------------------------------------------------------------------- primed state: never a plausible value


def test_primed_adam_state_is_a_sentinel_and_a_step_left_at_it_reads_never_loaded():
    """prime_adam writes values no load writes (step -0.5, NaN moments), so the step check tells a step
    the load never wrote from one it reset to 0; the harness then sets it to 0 to train on."""
    import torch

    from harness.cases.ranks.train_phase import TrainOut, step_check
    from harness.models import training

    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([p])
    wrapped = types.SimpleNamespace(optimizer=adam)  # what megatron's optimizer wrapper offers
    training.prime_optimizer_state(wrapped)
    state = adam.state[p]
    assert float(state["step"]) == training.PRIMED_STEP and training.never_loaded(training.PRIMED_STEP) and state["exp_avg"].isnan().all()
    assert not any(training.never_loaded(x) for x in (0.0, 1.0, 2.0))  # what a load writes
    assert training.loop.settle_unloaded_steps(wrapped) == 1 and float(state["step"]) == 0.0

    def judged(loaded_values, never=0):
        saved = [TrainOut([], [], [], steps={"values": [2.0], "shared_step_tensors": 0})]
        view = {"values": loaded_values, "shared_step_tensors": 0, "rewritten_by": [], "never_loaded": never}
        return step_check(saved, [TrainOut([], [], [], steps=view, steps_as_loaded=view)], "dp2", "dp1")

    never = judged([training.PRIMED_STEP, 2.0], never=1)
    assert never.failed and "1 param(s) still hold a step no load writes (primed -0.5): the load never wrote their step" in never.detail
    reset = judged([0.0, 2.0])  # a load that wrote 0: a reset, not named as never loaded
    assert reset.failed and "never wrote" not in reset.detail
    assert judged([2.0]).status == "passed"


def test_a_never_stepped_optimizer_is_saved_at_step_1_not_0():
    """verl's steps: 0 jobs save what one zero-gradient Adam step leaves: a load that resets the step
    to 0 then differs from the saved step."""
    import torch

    from harness.models import training

    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([p])
    training.stepped_once_state(types.SimpleNamespace(optimizer=adam))
    assert float(adam.state[p]["step"]) == 1.0 and not adam.state[p]["exp_avg"].any()
