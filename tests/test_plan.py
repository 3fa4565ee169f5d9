"""`ckpt-harness plan` (harness/plan/): the validator over planted records, the predictions against
sums taken directly, bad input, a tiny model end to end and the llama3-70b preset (slow)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from math import prod
from pathlib import Path

import pytest

from harness.core.topology import Topology
from harness.plan import validate
from harness.plan.cli import EXIT_BAD_INPUT, EXIT_INVALID, EXIT_OK, assemble
from harness.plan import collect, memory, predict, report
from harness.plan.collect import DTYPE_BYTES, Record, coordinate_ranks, pipeline_split, topology_records
from harness.plan.model import PlanInputError, load_model

TINY = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64, "torch_dtype": "bfloat16"}


def _rec(key, shape, offset, local, rank, replica=(0, 0, 0)):
    return Record(key=key, global_shape=shape, global_offset=offset, local_shape=local, dtype="bfloat16",
                  replica_id=replica, rank=rank, coord=(rank, 0, 0))


def _split(key="w", shape=(4, 8), tp=2, dp=2):
    """A (4, 8) tensor split on axis 1 over tp ranks, replicated over dp."""
    n = shape[1] // tp
    return [_rec(key, shape, (0, t * n), (shape[0], n), t + tp * d, (0, 0, d)) for d in range(dp) for t in range(tp)]


def test_a_whole_plan_has_no_problems():
    assert validate.coverage_problems(_split()) == []


def test_a_planted_gap_is_reported():
    recs = [r for r in _split() if r.rank != 1]  # tp rank 1's shard of w, every dp replica
    (problem,) = validate.coverage_problems(recs)
    assert problem.startswith("w: gap") and "16 of 32" in problem and "index 4 on axis 1" in problem


def test_a_planted_overlap_is_reported():
    recs = _split() + [_rec("w", (4, 8), (0, 2), (4, 4), 9)]  # a main replica over both halves
    problems = validate.coverage_problems(recs)
    assert problems and all("overlap" in p for p in problems) and "9" in problems[0]


def test_boxes_outside_the_shape_and_disagreements_are_reported():
    assert "leaves the global shape" in validate.coverage_problems([_rec("w", (4,), (2,), (4,), 0)])[0]
    assert "disagree on the global shape" in validate.coverage_problems(
        [_rec("w", (4,), (0,), (4,), 0), _rec("w", (8,), (0,), (8,), 1)])[0]


def test_the_load_side_names_missing_unexpected_and_mismatched_keys():
    saved = _split("a") + _split("b")
    loading = _split("a", shape=(4, 16)) + _split("c")
    assert validate.load_problems(saved, loading) == {
        "missing": ["c"], "unexpected": ["b"],
        "mismatched": ["a: saved (4, 8) bfloat16, load asks (4, 16) bfloat16"]}
    plan = assemble({}, Topology.parse("tp2dp2"), Topology.parse("tp2dp2"), "fully_reshardable", saved, loading, 0.0)
    assert plan["exit_code"] == EXIT_INVALID and plan["verdict"] == "INVALID"


def test_dp_reshardable_optimizer_state_cannot_change_tp_or_pp():
    recs = _split()
    src, dst = Topology.parse("tp2dp2"), Topology.parse("tp1dp4")
    assert assemble({}, src, dst, "fully_reshardable", recs, recs, 0.0)["exit_code"] == EXIT_OK
    plan = assemble({}, src, dst, "dp_reshardable", recs, recs, 0.0)
    assert plan["exit_code"] == EXIT_INVALID and "dp_reshardable" in plan["optimizer"]
    assert assemble({}, src, Topology.parse("tp2dp4"), "dp_reshardable", recs, recs, 0.0)["exit_code"] == EXIT_OK


def test_coordinate_ranks_are_one_per_tp_pp_etp_ep():
    assert coordinate_ranks(Topology.parse("tp2pp2dp2")) == [0, 1, 4, 5]
    assert len(coordinate_ranks(Topology.parse("tp8pp8dp16"))) == 64
    assert coordinate_ranks(Topology.parse("tp1pp2dp4ep2")) == [0, 1, 4, 5]
    assert coordinate_ranks(Topology.parse("tp2pp2cp2dp2")) == [0, 1, 8, 9]  # cp ranks are replicas, after tp
    assert coordinate_ranks(Topology.parse("tp2dp4ep2etp1")) == [0, 1]  # etp1: ep is the low part of the rank
    assert len(coordinate_ranks(Topology.parse("tp2pp2dp32ep8etp1"))) == 16
    with pytest.raises(PlanInputError, match="etp=2 does not divide tp=1"):
        coordinate_ranks(Topology.parse("tp1dp4ep2etp2"))


def test_model_input_errors_name_the_file_and_key(tmp_path):
    assert load_model("llama3-70b").num_layers == 80 and load_model("llama3-70b").num_query_groups == 8
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in TINY.items() if k != "intermediate_size"}))
    with pytest.raises(PlanInputError, match=r"config.json: missing key\(s\) \['intermediate_size'\]"):
        load_model(str(bad))
    with pytest.raises(PlanInputError, match="neither a preset"):
        load_model("no-such-model")


def test_vocab_padding_follows_megatron_lm():
    m = load_model("llama3-70b", vocab_divisible_by=128)
    assert (m.padded_vocab(8), m.padded_vocab(4)) == (129024, 128512)


def _main(argv):
    from harness.cli import main

    return main(["plan", *argv])


def test_a_bad_topology_exits_2_naming_it(tmp_path, capsys):
    assert _main(["--model", "llama3-70b", "--from", "tp8xx8", "--to", "tp4pp16dp16", "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "tp8xx8" in capsys.readouterr().err
    assert _main(["--model", "llama3-70b", "--from", "tp8pp7", "--to", "tp4", "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "tp8pp7" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()


def test_a_tiny_model_plans_end_to_end_and_its_bytes_are_the_direct_sums(tmp_path):
    from harness.plan.collect import topology_records

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    assert _main(["--model", str(cfg), "--from", "tp2pp2dp2", "--to", "tp1pp4dp2", "--out", str(out)]) == EXIT_OK
    plan = json.loads((out / "plan.json").read_text())
    assert plan["verdict"] == "VALID" and "VALID" in (out / "plan.md").read_text()
    model = load_model(str(cfg))
    for side, topo in (("save", "tp2pp2dp2"), ("load", "tp1pp4dp2")):
        recs = topology_records(model, Topology.parse(topo))
        assert validate.coverage_problems(recs) == []
        weights = {r.key: prod(r.global_shape) * DTYPE_BYTES[r.dtype] for r in recs}  # norms may be fp32
        s = plan[side]
        assert s["checkpoint_weight_bytes"] == sum(weights.values())
        assert s["max_written_per_rank"] == max(
            sum(prod(r.local_shape) * DTYPE_BYTES[r.dtype] for r in recs if r.rank == k and not any(r.replica_id)) for k in {r.rank for r in recs})
        assert s["max_read_per_rank"] == max(
            sum(prod(r.local_shape) * DTYPE_BYTES[r.dtype] for r in recs if r.rank == k) for k in {r.rank for r in recs})
    # planted faults into the real records: one rank's shard of one key dropped, then duplicated
    recs = topology_records(model, Topology.parse("tp2pp2dp2"))
    victim = next(r for r in recs if r.key.endswith("linear_qkv.weight") and r.coord[0] == 1)
    dropped = [r for r in recs if r is not victim]
    assert any(victim.key in p and "gap" in p for p in validate.coverage_problems(dropped))
    twice = recs + [replace(victim, rank=99)]
    assert any(victim.key in p and "overlap" in p for p in validate.coverage_problems(twice))


@pytest.mark.slow
def test_llama3_70b_plans_end_to_end(tmp_path):
    t0 = time.perf_counter()
    out = tmp_path / "out"
    assert _main(["--model", "llama3-70b", "--from", "tp8pp8dp16", "--to", "tp4pp16dp16", "--out", str(out)]) == EXIT_OK
    plan = json.loads((out / "plan.json").read_text())
    assert plan["save"]["coordinates"] == 64 and plan["load"]["coordinates"] == 64
    assert 70e9 < plan["save"]["parameters"] < 71e9
    assert plan["save"]["checkpoint_weight_bytes"] == plan["load"]["checkpoint_weight_bytes"]
    print(f"llama3-70b plan: {time.perf_counter() - t0:.1f} s")


def test_a_target_that_cannot_hold_the_model_fails_before_anything_is_built(tmp_path, capsys, monkeypatch):
    """Qwen3-235B has 4 kv heads: tp8 cannot hold it. The source (256 coordinates of a 235B MoE, minutes)
    must not be built first: the bad target is named at once."""
    from harness.plan import collect

    built = []
    monkeypatch.setattr(collect, "rank_records", lambda *a, **k: built.append(a) or [])
    assert _main(["--model", "qwen3-235b-a22b", "--from", "tp4pp2dp128ep32", "--to", "tp8pp2dp64ep16", "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "tp8pp2dp64cp1ep16" in capsys.readouterr().err and built == []


# ---------------------------------------------------------------- cp, vpp, etp, mixed MoE layers, uneven pp, MLA
def _tiny(**fields):
    from harness.plan.model import PlanModel

    base = dict(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=256, seq_length=64)
    return PlanModel(**{**base, **fields})


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_size=64)


def _layers(recs, key, rank):
    """The layer-axis offsets of `key` that `rank` holds."""
    return sorted({r.global_offset[0] for r in recs if r.key == key and r.rank == rank})


def test_a_vpp_plan_has_the_vpp1_keys_with_interleaved_global_layers(monkeypatch):
    model, qkv = _tiny(), "decoder.layers.self_attention.linear_qkv.weight"
    flat, vpp = (topology_records(model, Topology.parse(t)) for t in ("tp1pp2dp2", "tp1pp2dp2vpp2"))
    assert validate.coverage_problems(vpp) == [] and validate.key_table(vpp) == validate.key_table(flat)
    assert validate.load_problems(flat, vpp) == {"missing": [], "unexpected": [], "mismatched": []}
    assert _layers(flat, qkv, 0) == [0, 1] and _layers(vpp, qkv, 0) == [0, 2]  # chunk i: layers i*2 + pp*1
    # planted: every chunk built as virtual stage 0 (the mapping get_model's vp_stage=i gives, lost)
    from megatron.core.models import gpt

    real = gpt.GPTModel
    monkeypatch.setattr(gpt, "GPTModel", lambda *a, vp_stage=None, **k: real(*a, vp_stage=0, **k))
    assert any("overlap" in p for p in validate.coverage_problems(topology_records(model, Topology.parse("tp1pp2dp2vpp2"))))


def test_a_cp2_plan_validates_and_its_ranks_hold_what_cp1_ranks_hold(monkeypatch):
    model = _tiny()
    cp1, cp2 = Topology.parse("tp2pp2dp2"), Topology.parse("tp2pp2cp2dp2")
    one, two = topology_records(model, cp1), topology_records(model, cp2)
    assert validate.coverage_problems(two) == [] and validate.key_table(two) == validate.key_table(one)
    a, b = predict.summary(one, cp1), predict.summary(two, cp2)
    for k in ("coordinates", "checkpoint_weight_bytes", "parameters", "max_written_per_rank", "max_read_per_rank"):
        assert a[k] == b[k], k
    assert 2 * a["total_read_all_ranks"] == b["total_read_all_ranks"]  # twice the ranks read
    assert b["per_coordinate"][0]["optimizer"] * 2 == a["per_coordinate"][0]["optimizer"]  # over dp*cp
    # planted: the hand arithmetic of cp 1 (stage = tp * dp ranks) picks pp0's cp rank 1 for pp rank 1
    real = collect.rank_coordinates
    monkeypatch.setattr(collect, "rank_coordinates", lambda topo: real(replace(topo, cp=1)))
    assert any("gap" in p for p in validate.coverage_problems(topology_records(model, cp2)))


def _f32(key: str, numel: int, coord: tuple[int, int, int]) -> Record:
    """A main-replica fp32 record of `numel` elements at a (tp, pp, ep) coordinate."""
    return Record(key=key, global_shape=(numel,), global_offset=(0,), local_shape=(numel,), dtype="float32",
                  replica_id=(0, 0, 0), rank=0, coord=coord)


def test_the_optimizer_shards_over_dp_times_cp_and_experts_over_expert_dp():
    """megatron-core's distributed optimizer shards over the data-parallel group with context parallel
    (dp x cp) and expert parameters over the expert-data-parallel group: at equal dp a cp2 rank holds
    half a cp1 rank's share (dividing by dp alone does not), and etp1 at tp2 has expert-dp
    world / (etp*ep*pp) = 4 at tp2dp4ep2 (dp / ep = 2 maps ranks as if etp were tp)."""
    n, fp = 4096, "dp_reshardable+fully_parallel"
    dense = [_f32("decoder.layers.mlp.linear_fc1.weight", n, (t, 0, 0)) for t in range(2)]
    cp1, cp2 = Topology.parse("tp2dp2"), Topology.parse("tp2cp2dp2")
    a, b = predict.summary(dense, cp1), predict.summary(dense, cp2)
    assert [r["optimizer"] for r in a["per_coordinate"]] == [12 * n // 2] * 2
    assert [r["optimizer"] for r in b["per_coordinate"]] == [12 * n // 4] * 2
    assert (a["max_written_per_rank_fully_parallel"], b["max_written_per_rank_fully_parallel"]) == (4 * n // 2, 4 * n // 4)
    assert (a["total_read_all_ranks"], b["total_read_all_ranks"]) == (4 * n * 4, 4 * n * 8)
    # host memory: a fully-parallel dp_reshardable save stages weights / dp*cp + 12 B x params / dp*cp
    save = lambda s: s["host_memory"]["strategies"][fp]["save_peak_per_rank"]  # noqa: E731
    assert (save(a), save(b)) == (16 * n // 2, 16 * n // 4)
    assert {d for _, d, _ in memory.topology_layout(cp2)} == {0, 1, 2, 3}  # the rank in the dp x cp group

    topo = Topology.parse("tp2dp4ep2etp1")
    assert topo.expert_dp == 4
    experts = [_f32("decoder.layers.mlp.experts.experts.linear_fc1.weight", n, c) for c in ((0, 0, 0), (1, 0, 1))]
    s = predict.summary(experts, topo)
    assert [r["optimizer"] for r in s["per_coordinate"]] == [12 * n // 4] * 2
    assert save(s) == 16 * n // 4 and s["max_written_per_rank_fully_parallel"] == 4 * n // 4
    assert s["total_read_all_ranks"] == 4 * n * 8  # every rank of the world reads its coordinate's box
    assert {e for _, _, e in memory.topology_layout(topo)} == {0, 1, 2, 3}
    # the cp 1 / etp = tp layout of old still answers its own callers (tests/test_plan_memory.py, benchmarks)
    assert [memory.rank_layout(r, 2, 2, 1) for r in range(8)] == memory.topology_layout(Topology.parse("tp2pp2dp2"))


def test_caveats_show_at_the_top_of_plan_md():
    recs = _split()
    plan = assemble({"name": "m", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "num_query_groups": 1,
                     "ffn_hidden_size": 8, "vocab_size": 8, "num_moe_experts": None, "dtype": "bfloat16"},
                    Topology.parse("tp2cp2dp2"), Topology.parse("tp2dp2ep1"), "fully_reshardable", recs, recs, 0.0)
    assert plan["caveats"] == []  # cp and etp are modelled now
    assert "Caveats" not in report.markdown(plan)
    md = report.markdown({**plan, "caveats": ["tp2cp2dp2: planted"]})
    assert "- tp2cp2dp2: planted" in md and md.index("Caveats") < md.index("| topology |")


def test_an_etp1_plan_at_tp2_splits_experts_by_etp_and_the_rest_by_tp(monkeypatch):
    model, topo = _tiny(**MOE), Topology.parse("tp2dp4ep2etp1")
    recs = topology_records(model, topo)
    assert validate.coverage_problems(recs) == []
    assert len({r.rank for r in recs}) == len({r.coord for r in recs}) == 2  # (tp, ep) = (0, 0) and (1, 1)
    fc1 = [r for r in recs if r.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    shared = [r for r in recs if r.key == "decoder.layers.mlp.shared_experts.linear_fc1.weight"]
    assert {r.local_shape[2] for r in fc1} == {32}  # each GLU half whole: etp 1
    assert {r.local_shape[1] for r in shared} == {64 // 2}  # each GLU half of the shared expert over tp 2
    assert {r.global_offset[1] for r in fc1 if r.rank == 1} == {2, 3}  # rank 1 is ep rank 1: experts 2, 3
    at_tp = topology_records(model, Topology.parse("tp2dp4ep2"))
    assert {r.local_shape[2] for r in at_tp if r.key == fc1[0].key} == {16}
    # planted: the expert side mapped as if etp were tp: two built ranks share a coordinate (bytes counted twice)
    real = collect.rank_coordinates
    monkeypatch.setattr(collect, "rank_coordinates", lambda t: real(replace(t, etp=t.tp)))
    bad = topology_records(model, topo)
    assert len({r.rank for r in bad}) != len({r.coord for r in bad})


def test_a_mixed_moe_layer_freq_model_plans_its_dense_layers_dense(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                               "mlp_only_layers": [3], "first_k_dense_replace": 1}))
    model = load_model(str(cfg))
    assert model.moe_layer_freq == (0, 1, 1, 0)
    recs = topology_records(model, Topology.parse("tp2pp2dp2ep2"))
    keys = validate.key_table(recs)
    assert validate.coverage_problems(recs) == []
    for dense in (0, 3):
        assert keys[f"decoder.layers.{dense}.mlp.linear_fc1.weight"][0] == (256, 64)
        assert not any(k.startswith(f"decoder.layers.{dense}.mlp.experts") for k in keys)
    for moe in (1, 2):
        assert keys[f"decoder.layers.{moe}.mlp.experts.experts.linear_fc1.weight"][0] == (4, 64, 64)
    # planted: the pattern ignored (the planner before it read moe_layer_freq): every layer MoE
    flat = validate.key_table(topology_records(replace(model, moe_layer_freq=None), Topology.parse("tp2pp2dp2ep2")))
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in flat


def test_uneven_pipeline_stages_plan_with_megatron_cores_split():
    model = _tiny(num_layers=5)
    auto = dict(first="auto", last="auto")
    assert pipeline_split(model, Topology.parse("pp2"), **auto) == (3, 2)
    assert pipeline_split(replace(model, num_layers=61), Topology.parse("pp8dp32"), **auto) == (7, 6)
    assert pipeline_split(replace(model, num_layers=61), Topology.parse("pp16dp16"), **auto) == (3, 2)
    assert pipeline_split(_tiny(), Topology.parse("pp2"), **auto) == pipeline_split(model, Topology.parse("pp2")) == (None, None)
    with pytest.raises(PlanInputError, match="--first-stage-layers"):  # uneven only on request
        topology_records(model, Topology.parse("tp1pp2dp1"))
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    one, two = topology_records(model, Topology.parse("tp1pp1dp2")), topology_records(model, Topology.parse("tp1pp2dp1"), **auto)
    assert validate.coverage_problems(two) == [] and validate.key_table(two) == validate.key_table(one)
    assert _layers(two, qkv, 0) == [0, 1, 2] and _layers(two, qkv, 1) == [3, 4]
    with pytest.raises(PlanInputError, match="megatron-core refuses"):
        topology_records(model, Topology.parse("tp1pp2dp1"), first=4, last=2)


def test_an_mla_model_builds_for_any_caller(tmp_path):
    """MLA's CPU adaptations live where the model is built (collect), not in the CLI."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "num_key_value_heads": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
                               "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                               "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                               "v_head_dim": 16}))
    model = load_model(str(cfg))
    recs = topology_records(model, Topology.parse("tp2pp2dp2ep2"))
    keys = validate.key_table(recs)
    assert validate.coverage_problems(recs) == [] and "decoder.layers.0.mlp.linear_fc1.weight" in keys
    assert any("linear_kv_down_proj" in k for k in keys)
