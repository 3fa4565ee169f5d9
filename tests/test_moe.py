"""MoE (gpt-moe*, marker moe): expert parallelism is checked like every other split. Each new
path can go red: an expert weight one ulp off at one EP rank fails loaded-canonical, an expert
main param corrupted in the expert optimizer fails optimizer-state; what cannot run here is a
named load-time error, never a silent substitute."""

from dataclasses import replace

import pytest
from doubles import use_doubles

from harness.backends import resolve
from harness.core.spec import CaseSpec
from harness.core.topology import Topology, TopologyError
from harness.core.zoo import get_model
from harness.orchestration.runner import run_case
from harness.run.envelope import RunEnv

EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(
    test_corrupt_expert="doubles:CorruptExpertAfterLoad",
    test_corrupt_expert_main_param="doubles:CorruptExpertMainParamAfterLoad",
)


def _spec(case, src, dst, backend="mcore_dist", model="gpt-moe", **opts):
    return CaseSpec(case, model, backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    timeout_s=120)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_checkpoint_keys_and_global_shapes_do_not_depend_on_ep(tmp_path):
    """Every EP size writes the same keys with the same global shapes: experts sit on a global
    expert axis (SequentialMLP.sharded_state_dict), so canonical weights exist for every expert."""
    from harness.cases.reshard_weights import _Phase, _rank_phase

    model = get_model("gpt-moe-shared")
    seen = {}
    for topo in ("dp1", "dp2ep2", "dp4ep4", "tp2ep2etp1"):
        t = Topology.parse(topo)
        outs = RunEnv(tmp_path / topo, timeout_s=120).launch("keys", _rank_phase,
                                                               _Phase(model, t, resolve("mcore_dist"), None, None, False), t)
        seen[topo] = {(s.key, s.global_shape) for o in outs for s in o.shards}
        experts = {s.index[1] for o in outs for s in o.shards if s.key == EXPERT_FC1}
        assert experts == {0, 1, 2, 3}, (topo, experts)  # every global expert held by some rank
    assert (EXPERT_FC1, (4, 4, 64, 64)) in seen["dp1"]
    assert "decoder.layers.mlp.router.weight" in {k for k, _ in seen["dp1"]}
    assert any("shared_experts" in k for k, _ in seen["dp1"])
    assert seen["dp2ep2"] == seen["dp1"] == seen["dp4ep4"] == seen["tp2ep2etp1"]


def test_moe_reshard_across_ep_passes_and_logits_stay_bitwise():
    r = run_case(_spec("reshard-weights", "dp2ep2", "dp4ep4"))
    assert r.status == "passed", r.failure_text()
    assert r.check("logits").tolerance.kind == "bitwise"  # EP change, TP and etp kept


def test_an_expert_weight_one_ulp_off_at_one_ep_rank_fails_loaded_canonical():
    r = run_case(_spec("reshard-weights", "tp2", "dp2ep2", backend="test_corrupt_expert"))
    assert r.status == "failed"
    checks = _checks(r)
    assert checks["source-canonical"] == checks["checkpoint-canonical"] == "passed"
    assert checks["loaded-canonical"] == "failed" and checks["resave-plain"] == "failed"
    (m,) = r.check("loaded-canonical").mismatches
    assert m.key == EXPERT_FC1 and m.actual == "tp1pp1dp2cp1ep2" and 0 < m.max_abs_diff < 1e-6


def test_an_expert_main_param_corrupted_in_the_expert_optimizer_fails_optimizer_state():
    # dp4ep4 -> dp2ep2: the expert optimizer is the chain's second member on both sides; the flip
    # is in the last rank's loaded state, so the optimizer view must assemble expert-DP shards right
    r = run_case(_spec("reshard-optimizer", "dp4ep4", "dp2ep2", backend="test_corrupt_expert_main_param",
                       sharding="fully_reshardable"))
    assert r.status == "failed"
    assert _checks(r)["propagation"] == _checks(r)["step"] == "passed"
    (m,) = r.check("optimizer-state").mismatches
    assert m.key == "optimizer.state.param." + EXPERT_FC1 and m.actual == "tp1pp1dp2cp1ep2" and m.max_abs_diff > 0
    # fp32: the distributed optimizer's main params are views of the model params, so the weight moved too
    (w,) = r.check("model-weights").mismatches
    assert w.key == EXPERT_FC1


def test_expert_topologies_the_model_cannot_take_are_named():
    moe = get_model("gpt-moe")
    with pytest.raises(TopologyError, match="num_moe_experts=4 is not divisible by ep=3"):
        Topology.parse("dp3ep3").validate(moe)
    with pytest.raises(TopologyError, match="moe_ffn_hidden_size=32 is not divisible by etp=3"):
        Topology.parse("dp3etp3").validate(moe)
    with pytest.raises(TopologyError, match="moe_shared_expert_size=34 is not divisible by tp=4"):
        Topology.parse("tp4").validate(replace(get_model("gpt-moe-shared"), moe_shared_expert_size=34))


@pytest.mark.parametrize("entry, message", [
    ("{case: reshard-weights, models: [gpt-moe], pairs: ['dp2 -> dp3ep3'], backends: [mcore_dist]}",
     "num_moe_experts=4 is not divisible by ep=3"),
    ("{case: reshard-weights, models: [gpt-moe-grouped], pairs: ['dp2ep2 -> dp1'], backends: [mcore_dist]}",
     "grouped GEMM experts need layer_spec: te: megatron-core 0.19.2 builds them only as TEGroupedMLP"),
    ("{case: resume, models: [gpt-moe], pairs: ['tp2 -> dp2ep2'], backends: [mcore_dist]}",
     "a MoE model trains at tp > 1 only with sequence parallelism"),
    ("{case: reshard-optimizer, models: [gpt-moe], pairs: ['dp2ep2 -> tp2ep2etp1'], backends: [mcore_dist]}",
     "cannot train here"),
])
def test_moe_entries_that_cannot_run_here_are_matrix_load_errors(matrix_error, entry, message):
    assert message in matrix_error(entry)


def test_smoke_matrix_covers_every_kind_of_expert_change():
    from pathlib import Path

    from harness.orchestration.matrix import load_matrix

    matrices = Path(__file__).parent.parent / "matrices"  # the default suite runs both
    cases = [c for m in ("smoke.yaml", "extended.yaml") for c in load_matrix(matrices / m).cases if "moe" in c.markers]
    pairs = {c.case: set() for c in cases}
    for c in cases:
        pairs[c.case].add((c.source, c.target))
    weights = pairs["reshard-weights"]
    assert {(s.ep, d.ep) for s, d in weights} >= {(2, 1), (2, 4), (4, 2)}  # ep1 <-> ep2 <-> ep4
    assert any(s.tp == d.tp and s.etp != d.etp for s, d in weights)  # an etp change alone
    assert {c.model for c in cases} >= {"gpt-moe", "gpt-moe-shared"}
    training = pairs["reshard-optimizer"] | pairs["resume"]
    assert any(s.ep != d.ep for s, d in pairs["resume"])
    assert any(s.expert_dp != d.expert_dp for s, d in training)
    shardings = {dict(c.options).get("sharding") for c in cases if c.case == "reshard-optimizer" and c.source.ep != c.target.ep}
    assert shardings >= {"fully_reshardable", "dp_reshardable"}
    assert any(dict(c.options).get("dtype") == "bf16" for c in cases)


def test_grouped_gemm_experts_build_with_the_te_spec_and_are_not_run_without_te(tmp_path):
    """Grouped GEMM (TEGroupedMLP) exists only with the TE layer spec: with it the entry loads and
    needs te (not-run on a machine without Transformer-Engine, naming it); nothing is built instead."""
    from harness.core.requires import probe
    from harness.orchestration.matrix import load_matrix
    from harness.orchestration.runner import RunOptions, run_case

    path = tmp_path / "m.yaml"
    path.write_text("entries: [{case: reshard-weights, models: [gpt-moe-grouped], pairs: ['dp2ep2 -> dp1'], options: {layer_spec: te}}]\n")
    (spec,) = load_matrix(path).cases
    assert set(spec.requires) == {"cuda", "te"}
    if probe().te_missing:
        r = run_case(spec, RunOptions(dist_backend="gloo"))
        assert r.status == "not-run" and "Transformer-Engine" in r.not_run_reason and not r.memory
