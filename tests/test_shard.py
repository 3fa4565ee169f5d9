"""A matrix split across runners (`--shard I/N`) and joined again (`merge`): every case in exactly
one part, the same split on every runner, balanced by durations when given; a merge refuses a part
that died, a case run twice, a case nobody ran."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.parity import BITWISE, Mismatch
from harness.core.result import CaseResult, Check
from harness.orchestration.matrix import load_matrix
from harness.orchestration.schedulers import _balance as shard
from harness.report import grid
from harness.report import results as report
from harness.report.merge import FILES, MergeError, merge

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


def _record(case_id: str, status: str = "passed") -> dict:
    """A results.json record as a run writes it; a failed one with a check and its mismatch."""
    checks = [Check("loaded-canonical", "failed" if status == "failed" else "passed", "1 mismatch(es)", 1e-3, BITWISE,
                    [Mismatch("decoder.w", "value", "canonical", "tp2", 1e-3)] if status == "failed" else [])]
    return CaseResult(case_id, "reshard-weights", "gpt-gqa", "mcore_dist", "tp1", "tp2", status=status, checks=checks,
                      phases={"total": 1.0}, xfail_reason="a named defect" if status == "xfailed" else None,
                      not_run_reason="needs cuda" if status == "not-run" else None).to_dict()


def _part(path: Path, ids, complete=True, matrix="m", status=lambda i: "passed"):
    doc = {"matrix": matrix, "complete": complete, "wall_s": 1.0, "finished": "t",
           "results": [_record(i, status(i)) for i in ids]}
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
        ([a, {**_part(tmp_path / "f.json", []), "results": [{"id": "z", "status": "passed"}]}], None, "case z is not a case result"),
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
    assert len(ET.parse(out / "junit.xml").getroot().findall("testcase")) == 3 and (out / "report.html").stat().st_size
    assert main(["merge", str(tmp_path / "r1"), "--matrix", str(matrix), "--out", str(tmp_path / "half")]) == 2
    assert not (tmp_path / "half").exists()


def test_a_record_reads_back_as_the_result_that_wrote_it():
    for status in ("passed", "failed", "xfailed", "not-run"):
        record = _record(f"c-{status}", status)
        back = CaseResult.from_dict(json.loads(json.dumps(record)))
        assert back.to_dict() == record and back.failure_text() == CaseResult.from_dict(record).failure_text()
    assert CaseResult.from_dict({**_record("c"), "a-later-field": 1}).id == "c"  # a newer harness's record still reads
    with pytest.raises(TypeError, match="case"):
        CaseResult.from_dict({k: v for k, v in _record("c").items() if k != "case"})


def _tiny_matrix(tmp_path: Path) -> tuple[Path, list[str]]:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("entries: [{case: reshard-weights, models: [gpt-gqa, gpt-tied], pairs: ['tp1 -> tp1', 'dp2 -> tp2', 'tp2 -> dp2']}]")
    return matrix, [s.id for s in load_matrix(matrix).select(None)]


def test_the_merged_junit_and_html_hold_every_case_of_every_part_once(tmp_path):
    matrix, ids = _tiny_matrix(tmp_path)
    statuses = dict(zip(ids, ["passed", "failed", "xfailed", "not-run", "passed", "passed"]))
    parts = [[s.id for s in p] for p in shard.split(load_matrix(matrix).select(None), 3)]
    paths = [str(_part(tmp_path / f"p{i}.json", p, matrix=str(matrix), status=statuses.get)["_path"]) for i, p in enumerate(parts)]
    out = tmp_path / "merged"
    assert main(["merge", *paths, "--matrix", str(matrix), "--out", str(out)]) == 1  # one case failed
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    root = ET.parse(out / "junit.xml").getroot()
    names = [tc.get("name") for tc in root.findall("testcase")]
    assert names == ids and root.get("tests") == "6" and root.get("failures") == "1" and root.get("skipped") == "2"
    # each testcase is the one `run --junit` writes for that case
    single = ET.fromstring(report.junit_xml([CaseResult.from_dict(_record(i, statuses[i])) for i in ids], "s", 1.0))
    assert [ET.tostring(tc) for tc in root.findall("testcase")] == [ET.tostring(tc) for tc in single.findall("testcase")]
    assert "decoder.w" in root.find("testcase/failure").text
    html = (out / "report.html").read_text()
    # each case's details once (what the grid and the tables link to), its id shown
    assert [html.count(f'<details id="{escape(grid.anchor(i))}"') for i in ids] == [1] * len(ids)
    assert all(f"<code>{escape(i)}</code>" in html for i in ids)


@pytest.mark.parametrize("plant", ["duplicate", "missing", "foreign"])
def test_a_refused_merge_writes_nothing(tmp_path, plant):
    matrix, ids = _tiny_matrix(tmp_path)
    halves = {"duplicate": (ids[:4], ids[3:]), "missing": (ids[:3], ids[4:]), "foreign": (ids[:3], ids[3:] + ["not-a-case"])}[plant]
    paths = [str(_part(tmp_path / f"p{i}.json", h, matrix=str(matrix))["_path"]) for i, h in enumerate(halves)]
    out = tmp_path / "merged"
    assert main(["merge", *paths, "--matrix", str(matrix), "--out", str(out)]) == 2
    assert not out.exists()
