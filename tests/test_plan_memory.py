"""The plan's host-memory model (harness/plan/memory.py) against measurement.

Default tier (no world, no model build): the model meets the peaks recorded by
`python -m benchmarks.memory_calibration` (tests/data/memory_calibration_gpt-25m.json) within
memory.BOUND; models planted with a known mistake miss them; the check refuses empty input; and at
verl's scale (Qwen2.5-32B, coordinate inputs recorded from `plan`) a fully_reshardable save needs
more host memory than a dp_reshardable one, past a 1 TiB host where dp_reshardable is not (verl #5705).
The `memory` tier measures again: the calibration at DP 2 in fresh worlds, every strategy in the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.plan import memory

DATA = Path(__file__).resolve().parent / "data"
TiB = 2**40


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _coords(doc: dict, topo: str) -> dict:
    return {tuple(int(x) for x in k.split(",")): memory.CoordInputs(**v) for k, v in doc["inputs"][topo].items()}


def _predicted_rows(doc: dict, peaks=None) -> list[dict]:
    """The recorded measurements with the model's predictions for the same rank (`peaks`: a
    stand-in for memory.rank_peaks, to plant a wrong model)."""
    peaks = peaks or memory.rank_peaks
    setup = memory.Setup(device="cpu", fp32_model=True)
    rows = []
    for r in doc["rows"]:
        topo = f"tp1pp1dp{r['dp']}cp1"
        coords = _coords(doc, topo)
        coord, d, e = memory.rank_layout(r["rank"], 1, r["dp"], 1)
        p = peaks(coords[coord], r["dp"], r["dp"], d, e, r["strategy"], setup)
        rows.append({**r, "predicted": p[f"{r['phase']}_delta"]})
    return rows


def test_the_model_meets_the_recorded_measurements():
    doc = _load("memory_calibration_gpt-25m.json")
    rows = _predicted_rows(doc)
    assert {r["strategy"] for r in rows} == set(memory.STRATEGY_NAMES)
    assert {r["phase"] for r in rows} == {"save", "load"} and {r["dp"] for r in rows} == {1, 2}
    assert memory.calibration_problems(rows) == []


def _as_dp_reshardable(c, dp, edp, d, e, strategy, setup):
    """Planted: fully_reshardable costs what dp_reshardable costs (the old plan: 'both formats hold
    it so in memory') - its gather of the whole optimizer state on the host ignored."""
    twin = "dp_reshardable+fully_parallel" if strategy.endswith("fully_parallel") else "dp_reshardable"
    return memory.rank_peaks(c, dp, edp, d, e, twin, setup)


def _only_rank0_gathers(c, dp, edp, d, e, strategy, setup):
    """Planted: every fully_reshardable save gathers on DP rank 0 only (as if always mem-efficient)."""
    if strategy.startswith("fully_reshardable") and "mem_efficient" not in strategy:
        strategy = strategy.replace("fully_reshardable", "fully_reshardable+mem_efficient")
    return memory.rank_peaks(c, dp, edp, d, e, strategy, setup)


@pytest.mark.parametrize("planted", [_as_dp_reshardable, _only_rank0_gathers])
def test_a_planted_wrong_model_fails_the_same_bound(planted):
    doc = _load("memory_calibration_gpt-25m.json")
    problems = memory.calibration_problems(_predicted_rows(doc, planted))
    assert problems and all("fully_reshardable" in p for p in problems)
    if planted is _only_rank0_gathers:  # DP rank 1 of the all-gather is what it misses
        assert any("dp2 rank 1 save" in p for p in problems)


def test_the_check_fails_on_empty_or_unmeasured_input():
    assert memory.calibration_problems([]) == ["no calibration rows: nothing was measured"]
    (problem,) = memory.calibration_problems([{"strategy": "dp_reshardable", "dp": 2, "rank": 0, "phase": "save",
                                               "predicted": 2**30, "measured": None, "error": "SIGKILL"}])
    assert "no measurement (SIGKILL)" in problem
    row = {"strategy": "s", "dp": 1, "rank": 0, "phase": "save", "predicted": 10 * 2**30, "measured": 2**30}
    assert "10.00, outside" in memory.calibration_problems([row])[0]
    assert memory.calibration_problems([{**row, "predicted": 2**30}]) == []


def _node_peaks(topo: str, dp: int, setup: memory.Setup = memory.Setup()) -> dict[str, int]:
    doc = _load("memory_calibration_qwen2.5-32b.json")
    tp, pp = doc["topologies"][topo]
    table = memory.inputs_table(_coords(doc, topo), tp, pp, dp, 1, setup)["strategies"]
    return {name: row["save_peak_per_node"] for name, row in table.items()} | {
        f"{name}@rank": row["save_peak_per_rank"] for name, row in table.items()}


@pytest.mark.parametrize("topo", ["tp8pp1", "tp4pp2", "tp4pp1"])
@pytest.mark.parametrize("dp", [2, 4, 8, 16])
def test_fully_reshardable_needs_more_host_than_dp_reshardable_at_scale(topo, dp):
    for bucket in (None, 40_000_000):  # one bucket per buffer, or Megatron-LM's overlap_grad_reduce buckets
        peaks = _node_peaks(topo, dp, memory.Setup(bucket_numel=bucket))
        for fp in ("", "+fully_parallel"):
            assert peaks[f"fully_reshardable{fp}"] > 2 * peaks[f"dp_reshardable{fp}"]
            assert peaks[f"fully_reshardable{fp}@rank"] > 2 * peaks[f"dp_reshardable{fp}@rank"]


@pytest.mark.parametrize("dp", [2, 4, 8, 16])
def test_verl_5705_a_32b_fully_reshardable_save_outgrows_a_1_tib_host(dp):
    """verl set dist_ckpt_optim_fully_reshardable False (#5705) after host OOMs saving >30B models
    (#5154/#5670): at TP4 a node's fully_reshardable save peaks past 1 TiB (1.5-1.8 TiB), with or
    without a fully-parallel save, where dp_reshardable's stays under half of it; at TP8 (and TP4
    PP2) fully_reshardable still needs ~0.8-0.9 TiB a node, dp_reshardable under 0.25 TiB."""
    tp4 = _node_peaks("tp4pp1", dp)
    assert tp4["fully_reshardable"] > TiB and tp4["fully_reshardable+fully_parallel"] > TiB
    assert tp4["dp_reshardable"] < TiB / 2 and tp4["dp_reshardable+fully_parallel"] < TiB / 2
    tp8 = _node_peaks("tp8pp1", dp)
    assert tp8["fully_reshardable"] > 0.75 * TiB > TiB / 4 > tp8["dp_reshardable"]


def test_the_plan_carries_the_strategy_table_in_json_and_markdown():
    """assemble (planted records, no build): both sides get host_memory for every strategy, the old
    keys stay, plan.md shows the table; a node sums its ranks."""
    from harness.core.topology import Topology
    from harness.plan import report
    from harness.plan.cli import assemble
    from harness.plan.collect import Record

    recs = [Record(key="w", global_shape=(8, 1024), global_offset=(0, 512 * t), local_shape=(8, 512), dtype="bfloat16",
                   replica_id=(0, 0, 0), rank=t, coord=(t, 0, 0)) for t in range(2)]  # one rank per coordinate, as built
    plan = assemble({"name": "x", "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "num_query_groups": 1,
                     "ffn_hidden_size": 1, "vocab_size": 1, "num_moe_experts": None, "moe_router_topk": 0,
                     "dtype": "bfloat16"}, Topology(tp=2, dp=4), Topology(tp=2, dp=4), "fully_reshardable", recs, recs, 0.0)
    for side in ("save", "load"):
        table = plan[side]["host_memory"]["strategies"]
        assert set(table) == set(memory.STRATEGY_NAMES) and "max_host_bytes_per_rank" in plan[side]
    row = plan["save"]["host_memory"]["strategies"]["fully_reshardable"]
    # 4096 params a rank, one bucket: world 12 B x 4096 + local shards 12 B x 4096 / 4 + 12 B x 4096
    assert row["save_peak_per_rank"] == 12 * 4096 * 2 + 12 * 4096 // 4
    assert row["save_peak_per_node"] == 8 * row["save_peak_per_rank"]  # 8 ranks, every one gathers
    md = report.markdown(plan)
    assert "## Host memory per save/load strategy" in md and "| fully_reshardable+mem_efficient+fully_parallel |" in md


def test_multi_latent_attention_configs_are_read():
    from harness.plan.model import load_model

    m = load_model("deepseek-v3")
    assert m.multi_latent_attention and (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
                                         m.v_head_dim, m.first_k_dense) == (1536, 512, 128, 64, 128, 3)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_shared_expert_size) == (256, 8, 2048)
    assert not load_model("qwen2.5-32b").multi_latent_attention


@pytest.mark.slow
def test_the_recorded_32b_inputs_are_what_plan_builds():
    """The Qwen2.5-32B inputs above come from the plan's own build (meta device, fake process group)."""
    from harness.core.topology import Topology
    from harness.plan.collect import topology_records
    from harness.plan.model import load_model

    doc = _load("memory_calibration_qwen2.5-32b.json")
    model = load_model("qwen2.5-32b")
    for topo, (tp, pp) in doc["topologies"].items():
        coords = memory.coordinate_inputs(topology_records(model, Topology(tp=tp, pp=pp, dp=2)))
        assert coords == _coords(doc, topo), topo


@pytest.mark.memory
def test_the_model_meets_a_fresh_measurement(tmp_path):
    """Every strategy saved and loaded in its own world (gpt-25m, DP 2): predicted/measured in the bound."""
    from benchmarks.memory_calibration import run

    doc = run("gpt-25m", [2], tmp_path)
    assert len(doc["rows"]) == 6 * 2 * 2 and doc["problems"] == []
    assert (tmp_path / "calibration.md").is_file()
