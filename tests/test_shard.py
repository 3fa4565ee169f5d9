"""A matrix split across runners (`--shard I/N`) and joined again (`merge`): every case in exactly
one part, the same split on every runner, balanced by durations when given; a merge refuses a part
that died, a case run twice, a case nobody ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.orchestration import shard
from harness.orchestration.matrix import load_matrix
from harness.report.merge import MergeError, merge

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke():
    return load_matrix(ROOT / "matrices" / "smoke.yaml").select(None)


@pytest.mark.parametrize("total", [1, 2, 3, 5])
def test_every_case_is_in_exactly_one_shard_and_the_split_is_stable(smoke, total):
    parts = shard.split(smoke, total)
    ids = [s.id for p in parts for s in p]
    assert sorted(ids) == sorted(s.id for s in smoke) and len(ids) == len(set(ids))
    assert [[s.id for s in p] for p in parts] == [[s.id for s in p] for p in shard.split(list(smoke), total)]
    order = {s.id: i for i, s in enumerate(smoke)}
    assert all([order[s.id] for s in p] == sorted(order[s.id] for s in p) for p in parts)  # matrix order kept
    loads = [sum(shard.estimate(s) for s in p) for p in parts]
    assert max(loads) - min(loads) <= max(shard.estimate(s) for s in smoke)


@pytest.mark.parametrize("total", [2, 3])
def test_cases_sharing_a_source_stay_in_one_shard_within_20_percent(smoke, total):
    """A source saved once per run (harness.run.reuse) is saved once per split too: every source
    group of the smoke matrix (its fan-out included) lands in one shard, and the shards' estimated
    loads stay within 20% of their mean."""
    parts = shard.split(smoke, total)
    where: dict[str, set[int]] = {}
    for i, part in enumerate(parts):
        for s in part:
            where.setdefault(shard.source_group(s), set()).add(i)
    assert sum(len(v) > 1 for v in where.values()) == 0
    assert max(len([s for s in smoke if shard.source_group(s) == g]) for g in where) >= 10, "the matrix has a real fan-out"
    loads = [sum(shard.estimate(s) for s in p) for p in parts]
    assert (max(loads) - min(loads)) <= 0.2 * sum(loads) / total


def test_a_group_heavier_than_the_cap_is_cut():
    from harness.core.spec import CaseSpec
    from harness.core.topology import Topology

    specs = [CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology.parse("tp2"), Topology.parse(t))
             for t in ("tp1", "pp2", "dp2", "tp4", "pp4", "dp4", "tp2pp2", "tp2dp2", "pp2dp2", "tp1pp1")]
    parts = shard.split(specs, 2)
    assert all(parts) and abs(len(parts[0]) - len(parts[1])) <= 2, "one group of 10 equal cases still splits evenly"


def test_durations_decide_the_balance(smoke):
    heavy = smoke[-1].id
    parts = shard.split(smoke, 2, {heavy: 10_000.0})
    assert [s.id for s in parts[0]] == [heavy] and len(parts[1]) == len(smoke) - 1


@pytest.mark.parametrize("text", ["2", "0/2", "3/2", "a/b", "1/0"])
def test_a_bad_shard_is_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        shard.parse_shard(text)


def _part(path: Path, ids, complete=True, matrix="m"):
    doc = {"matrix": matrix, "complete": complete, "wall_s": 1.0, "finished": "t",
           "results": [{"id": i, "status": "passed", "phases": {"total": 1.0}} for i in ids]}
    path.write_text(json.dumps(doc))
    return {**doc, "_path": str(path)}


def test_merge_joins_the_parts_and_refuses_what_is_not_one_run(tmp_path):
    a, b = _part(tmp_path / "a.json", ["x", "y"]), _part(tmp_path / "b.json", ["z"])
    doc = merge([a, b], ["z", "x", "y"])
    assert [r["id"] for r in doc["results"]] == ["z", "x", "y"] and doc["summary"]["passed"] == 3
    for parts, expected, words in (
        ([a, _part(tmp_path / "c.json", ["y"])], None, "case y is in two parts"),
        ([a, _part(tmp_path / "d.json", ["z"], complete=False)], None, "incomplete run"),
        ([a], ["x", "y", "z"], "1 case(s) of the matrix in no part"),
        ([a, _part(tmp_path / "e.json", ["z"], matrix="other")], None, "different matrices"),
    ):
        with pytest.raises(MergeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            merge(parts, expected)


def test_two_shards_run_and_merge_into_the_whole_matrix(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp1', 'dp2 -> tp2', 'tp2 -> dp2']}]")
    for i in (1, 2):
        assert main(["run", str(matrix), "--shard", f"{i}/2", "--report", str(tmp_path / f"r{i}")]) == 0
    out = tmp_path / "merged"
    assert main(["merge", str(tmp_path / "r1"), str(tmp_path / "r2"), "--matrix", str(matrix), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["passed"] == 3 and (out / "results.md").read_text()
    assert main(["merge", str(tmp_path / "r1"), "--matrix", str(matrix), "--out", str(tmp_path / "half")]) == 2
