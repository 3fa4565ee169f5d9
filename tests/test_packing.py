"""GPU packing on one node (harness.orchestration.schedulers.packing): the planner never gives two running
cases one GPU nor more GPUs than the node has, starts the largest case that fits first, refuses a
case bigger than the node; the executor runs cases at once in their own workers, each with its set
in CUDA_VISIBLE_DEVICES, and the report says where and when each ran. CPU only: gloo and made-up
node sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.core.schedule import Placement, summaries, summarize
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_cases
from harness.orchestration.schedulers import packing
from harness.orchestration.schedulers.packing import Job, pick_gpus, plan
from harness.report.results import markdown

ROOT = Path(__file__).resolve().parent.parent


def _overlapping(placements: list[Placement]) -> list[tuple[int, int]]:
    """Pairs of placements that run at the same time (a set freed at t may start again at t)."""
    return [(i, j) for i, a in enumerate(placements) for j, b in enumerate(placements)
            if i < j and a.start_s < b.end_s and b.start_s < a.end_s]


def _assert_valid(placements: list[Placement], node: int, needs: list[int]) -> None:
    for p, need in zip(placements, needs):
        assert len(p.gpus) == need == len(set(p.gpus)) and all(0 <= g < node for g in p.gpus), (p, need)
    for i, j in _overlapping(placements):
        assert not set(placements[i].gpus) & set(placements[j].gpus), (placements[i], placements[j])
    for p in placements:  # never more than the node at any instant
        assert sum(len(q.gpus) for q in placements if q.start_s <= p.start_s < q.end_s) <= node


jobs_st = st.lists(st.tuples(st.integers(1, 10), st.floats(0.1, 50.0, allow_nan=False)), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(jobs_st, st.integers(1, 8))
def test_the_plan_never_shares_a_gpu_and_starts_the_largest_that_fits(raw, node):
    jobs = [Job(i, f"c{i}", need, seconds) for i, (need, seconds) in enumerate(raw)]
    out = plan(jobs, node)
    assert set(out.refused) == {j.index for j in jobs if j.need > node}
    assert all(f"needs {jobs[i].need} GPUs" in r and f"has {node}" in r for i, r in out.refused.items())
    assert set(out.placements) | set(out.refused) == {j.index for j in jobs} and not set(out.placements) & set(out.refused)
    placed = sorted(out.placements, key=lambda i: (out.placements[i].start_s, i))
    _assert_valid([out.placements[i] for i in placed], node, [jobs[i].need for i in placed])
    for i in placed:  # each placement lasts its job's estimate
        assert out.placements[i].end_s - out.placements[i].start_s == pytest.approx(jobs[i].seconds)
    # greedy list scheduling, largest first: when a job starts, every job ahead of it in the order
    # (more GPUs; as many and longer) that had not started yet did not fit the GPUs free then
    rank = {j.index: (-j.need, -j.seconds, j.id, j.index) for j in jobs}
    for i in placed:
        t = out.placements[i].start_s
        held = sum(jobs[k].need for k in placed if out.placements[k].start_s <= t < out.placements[k].end_s
                   and (out.placements[k].start_s < t or rank[k] < rank[i]))
        for k in placed:
            if rank[k] < rank[i] and out.placements[k].start_s > t:
                assert jobs[k].need > node - held, (jobs[k], jobs[i], t)
    # no GPU idles while a waiting job would fit: whenever a job waits, too few GPUs are free
    for i in placed:
        t = out.placements[i].start_s
        held = sum(jobs[k].need for k in placed if out.placements[k].start_s <= t < out.placements[k].end_s)
        waiting = [k for k in placed if out.placements[k].start_s > t]
        assert all(jobs[k].need > node - held for k in waiting)


def test_the_order_is_largest_then_longest_and_a_node_sized_case_runs_alone():
    jobs = [Job(0, "one", 1, 5.0), Job(1, "eight", 8, 2.0), Job(2, "four-long", 4, 9.0), Job(3, "four", 4, 3.0), Job(4, "nine", 9, 1.0)]
    out = plan(jobs, 8)
    p = out.placements
    assert list(out.refused) == [4] and "needs 9 GPUs" in out.refused[4]
    assert (p[1].start_s, p[1].gpus) == (0.0, tuple(range(8)))  # the 8-GPU case first, alone
    assert p[2].start_s == p[3].start_s == 2.0 and p[2].gpus == (0, 1, 2, 3) and p[3].gpus == (4, 5, 6, 7)
    assert p[0].start_s == 5.0 and p[0].gpus == (4,)  # the short 4 frees its set first


def test_a_case_waits_while_its_source_is_being_written():
    """Cases of one source group (harness.run.reuse saves it once per run): the second does not
    take GPUs to wait on the store's lock while the first writes; an unrelated case goes first."""
    jobs = [Job(0, "a-writer", 2, 5.0, "g"), Job(1, "b-reuser", 2, 5.0, "g"), Job(2, "other", 2, 4.0, "h")]
    p = plan(jobs, 4).placements
    assert p[0].start_s == p[2].start_s == 0.0 and p[1].start_s == 5.0, "not at 4.0, when the other one frees its GPUs"
    p = plan([Job(0, "a-writer", 2, 5.0, "g"), Job(1, "b-reuser", 2, 1.0, "g")], 4).placements
    assert p[1].start_s == 5.0, "after its writer, even with GPUs free"


def test_gpus_are_picked_contiguous_when_they_can_be():
    assert pick_gpus({0, 1, 3, 4, 5}, 3) == (3, 4, 5)
    assert pick_gpus({0, 2, 4, 6}, 2) == (0, 2)
    with pytest.raises(ValueError, match="3 GPUs asked of 2 free"):
        pick_gpus({1, 2}, 3)


def test_the_summary_is_gpu_seconds_held_over_the_node_times_the_wall():
    ps = [Placement((0, 1), 4, 0.0, 10.0), Placement((2,), 4, 0.0, 5.0), Placement((2, 3), 4, 5.0, 8.0)]
    s = summarize(ps)
    assert s.wall_s == 10.0 and s.serial_s == 18.0 and s.cases == 3 and s.peak_gpus == 4
    assert s.busy_fraction == pytest.approx((2 * 10 + 1 * 5 + 2 * 3) / (4 * 10))
    assert s.serial_busy_fraction == pytest.approx(31 / (4 * 18))
    assert summarize([Placement((0,), 4, 0.0, 1.0), Placement((0,), 4, 1.0, 2.0)]).peak_gpus == 1  # a freed set reused
    with pytest.raises(ValueError, match="different sizes"):
        summarize([Placement((0,), 4, 0.0, 1.0), Placement((0,), 8, 0.0, 1.0)])


@settings(max_examples=100, deadline=None)
@given(jobs_st, st.integers(1, 8))
def test_the_busy_fraction_is_what_the_plan_held(raw, node):
    jobs = [Job(i, f"c{i}", need, seconds) for i, (need, seconds) in enumerate(raw)]
    out = plan(jobs, node)
    if not out.placements:
        return
    s = out.summary()
    fitting = [j for j in jobs if j.need <= node]
    wall = max(p.end_s for p in out.placements.values())
    assert s.busy_fraction == pytest.approx(sum(j.need * j.seconds for j in fitting) / (node * wall))
    assert 0 < s.busy_fraction <= 1 + 1e-9 and s.serial_s == pytest.approx(sum(j.seconds for j in fitting))


def test_the_report_groups_one_line_per_packed_run():
    recs = [Placement((0, 1), 4, 0.0, 10.0, run_started=1.0).to_json(), None, Placement((0,), 4, 0.0, 2.0, run_started=3.0).to_json(),
            Placement((2, 3), 4, 0.0, 10.0, run_started=1.0).to_json(), Placement((0,), 8, 0.0, 4.0, run_started=2.0).to_json()]
    got = summaries(recs)  # a merged report: one line per shard's run, even of nodes of one size
    assert [(s.node_gpus, s.cases, s.busy_fraction) for s in got] == [(4, 2, 1.0), (8, 1, 0.125), (4, 1, 0.25)]
    doc = {"results": [{"id": f"c{i}", "status": "passed", "placement": r} for i, r in enumerate(recs)], "summary": {"passed": 4}}
    md = markdown(doc)
    assert "schedule: 2 case(s) packed on a 4-GPU node: wall 10.0 s vs 20.0 s one at a time (2.00x); GPUs busy 100.0%" in md
    assert "schedule: 1 case(s) packed on a 8-GPU node" in md and "GPUs busy 12.5%" in md


def _spec(src: str, dst: str, tag: str = "") -> CaseSpec:
    return CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology.parse(src), Topology.parse(dst), tag=tag, timeout_s=120)


@pytest.mark.parametrize("backend", ["gloo", "auto"])  # auto (a GPU run's): forkserver workers; gloo: forked ones
def test_the_executor_runs_cases_at_once_each_in_its_own_set(backend):
    from doubles import fake_packed_case

    specs = [_spec("tp1", "tp1"), _spec("dp2", "tp2"), _spec("tp2", "dp2"), _spec("tp4", "tp1"), _spec("dp8", "tp1"),
             _spec("tp1", "tp1", tag="dies")]
    seen = []
    results = packing.run_packed(specs, RunOptions(dist_backend=backend), fake_packed_case, 4, on_result=seen.append)
    assert [r.id for r in results] == [s.id for s in specs] and len(seen) == len(specs)
    assert results[4].status == "not-run" and "needs 8 GPUs" in results[4].not_run_reason and results[4].placement is None
    assert seen[0] is results[4]  # refused before anything starts
    assert results[5].status == "error" and "died (exit code 7)" in results[5].error and results[5].placement
    ran = [r for r in results if r.placement]
    places = [Placement.from_json(r.placement) for r in ran]
    _assert_valid(places, 4, [packing.need_of(s) for s, r in zip(specs, results) if r.placement])
    assert _overlapping(places), "no two cases ran at once"
    for r, p in zip(ran, places):
        devices = ",".join(map(str, p.gpus))
        assert p.devices == devices
        if r.status == "passed":  # what the worker's environment said
            assert f"CUDA_VISIBLE_DEVICES={devices}" in r.notes and f"CKPT_HARNESS_GPUS={devices}" in r.notes
    four = places[ran.index(results[3])]
    assert four.start_s <= min(p.start_s for p in places)  # the largest first
    assert len({p.run_started for p in places}) == 1


def test_a_packed_run_refuses_what_cannot_hold(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="--gpus-per-node 4 but this process sees 2 GPU"):
        packing.check_node(4, "nccl")
    with pytest.raises(ValueError, match="--gpus-per-node 4 but this process sees 2 GPU"):
        packing.check_node(4, "auto")
    packing.check_node(2, "nccl")
    packing.check_node(4, "gloo")  # labels only: the worlds run on CPU
    with pytest.raises(ValueError, match="multi-node"):
        packing.check_node(2, "nccl", "torchrun", "srun torchrun")
    with pytest.raises(ValueError, match="cannot take --jobs"):
        run_cases([_spec("tp1", "tp1")], RunOptions(), jobs=2, gpus_per_node=2)


def test_sets_map_onto_the_processs_own_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-abc,7")
    assert packing._devices((1, 2), packing.visible_devices()) == "5,GPU-abc"
    assert packing._devices((1, 2), []) == "1,2"


def test_list_prints_the_predicted_schedule(tmp_path, capsys):
    from harness.cli import main

    matrix = tmp_path / "m.yaml"
    matrix.write_text("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp1', 'dp2 -> tp2', 'tp1 -> dp8']}]")
    assert main(["list", str(matrix), "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("refused: needs 8 GPUs") and "dp8" in out[0]
    assert out[1].startswith("gpus 0,1 ") and out[2].startswith("gpus 2 ") and out[-1].startswith("predicted: 2 case(s)")


def test_a_real_packed_run_on_gloo_gives_each_rank_its_set(tmp_path):
    """The CLI as CI runs it (one process, fork workers), made-up 4-GPU node, gloo worlds on CPU: two
    2-rank cases at once on disjoint sets, the 1-rank case after, the 8-rank case refused; every rank
    of every world inherits its case's set."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['dp2 -> tp2', 'tp2 -> dp2', 'tp1 -> tp1', 'tp1 -> dp8']}]")
    log = tmp_path / "ranks"
    log.mkdir()
    env = {**os.environ, "CKPT_HARNESS_TEST_GPU_LOG": str(log)}
    cmd = [sys.executable, "-m", "harness.cli", "run", str(matrix), "--gpus-per-node", "4", "--dist-backend", "gloo",
           "--rank-hook", "doubles:record_gpu_env", "--report", str(tmp_path / "r")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    by = {r["target"]: r for r in doc["results"]}
    assert by["tp1pp1dp8cp1"]["status"] == "not-run" and "needs 8 GPUs" in by["tp1pp1dp8cp1"]["not_run_reason"]
    ran = [r for r in doc["results"] if r["placement"]]
    assert len(ran) == 3 and all(r["status"] == "passed" for r in ran)
    places = [Placement.from_json(r["placement"]) for r in ran]
    _assert_valid(places, 4, [2, 2, 1])
    assert _overlapping(places[:2]), "the two 2-rank cases did not run at once"
    assert "schedule: 3 case(s) packed on a 4-GPU node" in proc.stdout
    ranks = [json.loads(f.read_text()) for f in log.iterdir()]
    # worlds: save (source ranks), load (target ranks), read (1 rank) per case
    assert len(ranks) == (2 + 2 + 1) * 2 + (1 + 1 + 1)
    for rec in ranks:
        assert rec["cuda_visible_devices"] == ""  # gloo ranks hide their GPUs (harness.run.world) ...
        home = [p for p in places if p.run_started + p.start_s <= rec["time"] <= p.run_started + p.end_s]
        assert any(rec["gpus"] == ",".join(map(str, p.gpus)) for p in home), (rec, home)  # ... and keep their set
    for p in places:
        assert any(rec["gpus"] == p.devices for rec in ranks)
