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
from harness.plan.collect import DTYPE_BYTES, Record, coordinate_ranks
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


def test_coordinate_ranks_are_one_per_tp_pp_ep():
    assert coordinate_ranks(Topology.parse("tp2pp2dp2")) == [0, 1, 4, 5]
    assert len(coordinate_ranks(Topology.parse("tp8pp8dp16"))) == 64
    assert coordinate_ranks(Topology.parse("tp1pp2dp4ep2")) == [0, 1, 4, 5]
    with pytest.raises(PlanInputError, match="cp 1"):
        coordinate_ranks(Topology.parse("tp2cp2"))


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
