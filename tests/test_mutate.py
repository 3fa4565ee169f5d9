"""`ckpt-harness mutate`, a whole campaign on tests/mutation_target.py: a real instrumented run of a
one-case slice whose backend (tests/doubles.py ThroughMutationTarget) passes the loaded weights
through the target module, then one fresh run per covered mutant. Four known mutants: one the slice
kills, one it runs and cannot see (a survivor), one no case runs (not covered, a blind spot), one the
compiler cannot tell from the original (equivalent, never run). The report classifies each, counts
the rates without the equivalent one, and a second call resumes without running anything again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.backends import ENV as BACKENDS_ENV
from harness.cli import main
from harness.faults.mutants import generate

MATRIX = """
name: mutate-test
entries:
  - case: reshard-weights
    backends: [through-target]
    models: [gpt-tied]
    pairs: ["tp1 -> tp1"]
"""
CASE = "reshard-weights[through-target-gpt-tied-tp1pp1dp1cp1->tp1pp1dp1cp1]"


def _pick(operator: str, original: str, replacement: str):
    (m,) = [m for m in generate("mutation_target") if (m.operator, m.original.strip(), m.replacement.strip())
            == (operator, original, replacement)]
    return m


def test_a_campaign_classifies_killed_survived_not_covered_and_equivalent(tmp_path, monkeypatch):
    monkeypatch.setenv(BACKENDS_ENV, "through-target=doubles:ThroughMutationTarget")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(MATRIX)
    out = tmp_path / "campaign"
    out.mkdir()
    known = {
        "killed": _pick("off-by-one", "end", "(end) - 1"),  # take() drops the last weight: the load check fails
        "survived": _pick("constant", "1", "2"),  # the extra element of an uneven split: one rank, no remainder
        "not-covered": _pick("compare-flip", ">", "<="),  # in never_called()
        "equivalent": _pick("drop-statement", "dump(state)", "pass"),  # under `if False:`
    }
    # the campaign's own resume file, written as `mutate --sample` would have (these four, in this order)
    (out / "mutants.json").write_text(json.dumps({"targets": ["mutation_target"], "sample": None, "seed": 0, "generated": 4,
                                                  "mutants": [m.to_dict() for m in known.values()]}))
    argv = ["mutate", "--target", "mutation_target", "--matrix", str(matrix), "--out", str(out), "--jobs", "2", "--no-corpus"]
    assert main(argv) == 0
    doc = json.loads((out / "mutate.json").read_text())
    got = {r["id"]: r for r in doc["mutants"]}
    assert {o: got[m.id]["outcome"] for o, m in known.items()} == {o: o for o in known}
    assert got[known["killed"].id]["findings"] and got[known["killed"].id]["cases"] == [CASE]
    assert got[known["not-covered"].id]["cases"] == [] and got[known["survived"].id]["cases"] == [CASE]
    overall = doc["overall"]
    assert (overall["kill_rate"], overall["coverage_rate"]) == (0.5, round(2 / 3, 4)), overall  # equivalent left out
    md = (out / "mutate.md").read_text()
    assert md.startswith("# Mutation campaign: 50.0% of covered mutants killed, 66.7% of sampled mutants covered")
    survivors = md.split("## Survivors (1)")[1].split("## Not covered")[0]
    assert f"mutation_target.py:{known['survived'].line}" in survivors and CASE in survivors
    assert "-    end = start + per + (1 if rank < extra else 0)" in survivors and "+    end = start + per + (2 if" in survivors
    assert known["not-covered"].id in md.split("## Not covered (1)")[1].split("## Equivalent")[0]
    assert (out / "mutate.png").stat().st_size > 1000
    # the whole population, beside the sample: never_called() is on no run line, take() is
    every = generate("mutation_target")
    whole = doc["population"]["mutation_target"]
    assert whole["generated"] == len(every) and 0 < whole["run"] < len(every) - 2
    assert f"| mutation_target | {len(every)} | {whole['run']} |" in md
    # resumed: every outcome is read back, nothing runs again
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("mutants/*/outcome.json")}
    assert len(stamps) == 4 and main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("mutants/*/outcome.json")} == stamps


def test_another_campaign_in_the_same_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "c"
    out.mkdir()
    (out / "mutants.json").write_text(json.dumps({"targets": ["other"], "sample": 3, "seed": 1, "mutants": []}))
    assert main(["mutate", "--target", "mutation_target", "--matrix", "x.yaml", "--out", str(out)]) == 2
    assert "holds a campaign of ['other']" in capsys.readouterr().err


def test_an_unknown_target_is_a_clear_error(tmp_path, capsys):
    assert main(["mutate", "--target", "no.such.module", "--out", str(tmp_path / "c")]) == 2
    assert "no.such.module: not found on sys.path" in capsys.readouterr().err


@pytest.mark.parametrize("raw, words", [("x", "is not NAME=module:attr"), ("x=nocolon", "is not NAME=module:attr")])
def test_a_malformed_backends_variable_names_the_item(monkeypatch, raw, words):
    from harness import backends

    monkeypatch.setenv(BACKENDS_ENV, raw)
    with pytest.raises(ValueError, match=words):
        backends.available()
