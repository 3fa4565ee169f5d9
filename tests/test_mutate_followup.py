"""A follow-up campaign (`mutate --after DIR`): the same mutants as DIR's, only those DIR did not settle
run again over a new selection, and the report is the union of both selections' outcomes."""

from __future__ import annotations

import json

import pytest

from harness.gate import mutate_report, mutate_results
from harness.gate.mutate import MutateError


def _campaign(d, outcomes: dict[int, str], ids=("m0", "m1", "m2", "m3")):
    d.mkdir(parents=True, exist_ok=True)
    (d / "mutants.json").write_text(json.dumps({"targets": ["t"], "sample": 4, "seed": 1, "mutants": [{"id": i} for i in ids]}))
    for i, outcome in outcomes.items():
        f = d / "mutants" / f"{i:04d}" / "outcome.json"
        f.parent.mkdir(parents=True)
        case = f"case-{d.name}-{i}"
        f.write_text(json.dumps({"index": i, "id": ids[i], "module": "t", "function": "f", "operator": "constant", "path": "p",
                                 "line": i, "diff": "", "outcome": outcome, "cases": [] if outcome == "not-covered" else [case],
                                 "ran": [] if outcome == "not-covered" else [case],
                                 "findings": [{"case": case, "failing": True}] if outcome == "killed" else []}))
    return d


def test_a_follow_up_runs_what_the_first_left_and_reports_the_union(tmp_path):
    first = _campaign(tmp_path / "c1", {0: "killed", 1: "survived", 2: "not-covered", 3: "not-covered"})
    out = tmp_path / "c2"
    skip = mutate_results.follow_up(out, first)
    assert skip == {0} and json.loads((out / "mutants.json").read_text()) == json.loads((first / "mutants.json").read_text())
    # the new selection kills the survivor, covers one blind spot without killing it, leaves the other
    _campaign(out, {1: "killed", 2: "survived", 3: "not-covered"})
    records = mutate_results.union(mutate_results.records_of(out)[0], mutate_results.records_of(first)[0], first)
    assert [r["outcome"] for r in records] == ["killed", "killed", "survived", "not-covered"]
    assert records[0]["campaign"] == str(first) and "campaign" not in records[1]
    assert records[1]["cases"] == ["case-c1-1", "case-c2-1"]  # covering cases of both selections
    stable = {"case-c1-0": True, "case-c2-1": True}
    overall = mutate_report.write(records, out, ["t"], stable=stable)
    assert (overall["killed"], overall["covered"], overall["kill_rate"], overall["coverage_rate"]) == (2, 3, round(2 / 3, 4), 0.75)
    assert f"A follow-up joined with the campaign in {first}" in (out / "mutate.md").read_text()
    # the first campaign's kill needs its own confirmation: without it, it is covered, not killed
    assert mutate_report.write(records, out, ["t"], stable={"case-c2-1": True})["unconfirmed"] == 1


def test_a_follow_up_of_nothing_or_of_another_campaign_is_refused(tmp_path):
    with pytest.raises(MutateError, match="no campaign there"):
        mutate_results.follow_up(tmp_path / "c2", tmp_path / "none")
    first = _campaign(tmp_path / "c1", {})
    other = _campaign(tmp_path / "c2", {}, ids=("x0", "x1", "x2", "x3"))
    with pytest.raises(MutateError, match="holds another campaign's mutants"):
        mutate_results.follow_up(other, first)


def test_a_follow_up_of_two_campaigns_skips_what_either_settled_and_joins_all_three(tmp_path):
    c1 = _campaign(tmp_path / "c1", {0: "killed", 1: "survived", 2: "not-covered", 3: "not-covered"})
    c2 = tmp_path / "c2"
    assert mutate_results.follow_up(c2, c1) == {0}
    _campaign(c2, {1: "killed", 2: "not-covered", 3: "not-covered"})
    c3 = tmp_path / "c3"
    skip = frozenset().union(*(mutate_results.follow_up(c3, d) for d in (c1, c2)))
    assert skip == {0, 1}  # each one's kills; c2's own records hold only what it ran
    _campaign(c3, {2: "survived", 3: "not-covered"})
    records = mutate_results.records_of(c3)[0]
    for before in (c1, c2):
        records = mutate_results.union(records, mutate_results.records_of(before)[0], before)
    assert [r["outcome"] for r in records] == ["killed", "killed", "survived", "not-covered"]
    assert [r.get("campaign") for r in records] == [str(c1), str(c2), None, None]
