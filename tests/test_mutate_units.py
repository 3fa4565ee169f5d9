"""The pieces that make a whole-gate mutation campaign fit a night, without running a case: which
covering cases a mutant runs and in what order (mutate_cases), the stop at the first kill and
--max-cases (mutate.run_mutant with a fake runner that writes the results a run would), the
stratified sample and the function filter, shards and their merge, and the warm parent's refusal
to hold a target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.faults.mutants import generate, in_functions, sample
from harness.gate import mutate, mutate_cases, mutate_results

IDS = ["reshard-weights[mcore_dist-a]", "reshard-weights[mcore_dist-b]", "reshard-weights[mcore_dist-c]",
       "resume[mcore_dist-a]", "hf-roundtrip[bridge_hf-a]", "reshard-weights[bridge_peft-a]", "resume[mcore_dist-b]"]


def _result(cid: str, status: str = "passed", total: float = 1.0) -> dict:
    return {"id": cid, "case": cid.split("[")[0], "status": status, "error": None, "memory": {}, "notes": [],
            "phases": {"total": total}, "xfail_reason": None,
            "checks": [{"name": "loaded-canonical", "status": status, "detail": "", "max_abs_diff": None,
                        "tolerance": "bitwise", "mismatches": []}]}


def _clean(seconds: dict[str, float] | None = None) -> dict:
    seconds = seconds or {}
    return {"matrix": "m.yaml", "complete": True, "selected": IDS, "versions": {}, "summary": {},
            "results": [_result(c, total=seconds.get(c, 1.0)) for c in IDS]}


def test_cases_go_round_robin_over_kinds_fastest_first_and_in_doubling_batches():
    clean = _clean({"reshard-weights[mcore_dist-a]": 9.0, "reshard-weights[mcore_dist-c]": 0.5})
    got = mutate_cases.order(IDS, clean)
    assert sorted(got) == sorted(IDS)
    # one of each (check, backend) first: weights, resume, HF export, adapters; the fastest weights case leads
    assert got[:4] == ["reshard-weights[mcore_dist-c]", "resume[mcore_dist-a]", "hf-roundtrip[bridge_hf-a]",
                       "reshard-weights[bridge_peft-a]"]
    assert got.index("reshard-weights[mcore_dist-a]") == len(got) - 1  # the slowest of the largest kind last
    assert [len(b) for b in mutate_cases.batches(list(range(11)))] == [2, 4, 5]
    assert list(mutate_cases.batches([])) == []


def test_within_a_kind_the_case_with_new_words_goes_before_faster_repeats():
    """The first campaign's capped survivors: ten fast dense resume cases ran, the slower Lion one never."""
    dense = [f"resume[mcore_dist-gpt-gqa-tp{t}pp1dp1cp1->tp1pp1dp{d}cp1-fully_reshardable]" for t in (1, 2) for d in (1, 2)]
    lion = "resume[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp1pp1dp2cp1-fully_reshardable-lion-layer-wise]"
    cases = dense + [lion]
    clean = {"results": [_result(c, total=1.0) for c in dense] + [_result(lion, total=5.0)]}
    got = mutate_cases.order(cases, clean)
    assert sorted(got) == sorted(cases) and got[0] == dense[0] and got.index(lion) == 1, got
    assert mutate_cases.words(lion) >= {"gpt", "gqa", "lion", "layer", "wise", "fully", "reshardable", "tp1pp1dp2cp1"}
    assert mutate_cases.order([], clean) == []
    assert list(mutate_cases.batches([])) == []


def _mutant():
    return next(m for m in generate("mutation_target") if m.operator == "off-by-one")


def _fake_runner(fail: set[str], calls: list[list[str]]):
    """Writes the results.json a `run` of the batch would: the cases in `fail` failed, the rest passed."""
    def run(args: list[str], env: dict, log: Path, timeout: float | None) -> tuple[int, bool]:
        ids = [args[i + 1] for i, a in enumerate(args) if a == "--id"]
        calls.append(ids)
        assert json.loads(env["CKPT_HARNESS_MUTANT"])["line"] == _mutant().line  # the mutant goes with every run
        report = Path(args[args.index("--report") + 1])
        report.mkdir(parents=True)
        (report / "results.json").write_text(json.dumps(
            {"matrix": "m.yaml", "complete": True, "versions": {}, "summary": {},
             "results": [_result(c, "failed" if c in fail else "passed") for c in ids]}))
        return (1 if fail & set(ids) else 0), False
    return run


def test_a_mutant_stops_at_its_first_kill_and_a_survivor_runs_every_covering_case(tmp_path):
    m, text = _mutant(), Path(_mutant().path).read_text()
    order = mutate_cases.order(IDS, _clean())
    calls: list[list[str]] = []
    killer = order[4]  # in the second batch (cases 3-6)
    rec = mutate.run_mutant(m, 0, text, IDS, Path("m.yaml"), tmp_path / "k", 60, _clean(), _fake_runner({killer}, calls))
    assert rec["outcome"] == "killed" and [len(c) for c in calls] == [2, 4] and rec["ran"] == order[:6]
    assert rec["findings"][0]["case"] == killer
    calls.clear()
    rec = mutate.run_mutant(m, 0, text, IDS, Path("m.yaml"), tmp_path / "s", 60, _clean(), _fake_runner(set(), calls))
    assert rec["outcome"] == "survived" and sorted(rec["ran"]) == sorted(IDS) and rec["unrun"] == 0
    assert [len(c) for c in calls] == [2, 4, 1]


def test_max_cases_leaves_a_survivor_counted_as_survived_with_its_unrun_cases(tmp_path):
    m, text = _mutant(), Path(_mutant().path).read_text()
    calls: list[list[str]] = []
    late = mutate_cases.order(IDS, _clean())[-1]  # the only killer is past the cap
    rec = mutate.run_mutant(m, 0, text, IDS, Path("m.yaml"), tmp_path, 60, _clean(), _fake_runner({late}, calls), max_cases=3)
    assert rec["outcome"] == "survived" and len(rec["ran"]) == 3 and rec["unrun"] == 4 and late not in rec["ran"]
    from harness.gate import mutate_report

    mutate_report.write([rec], tmp_path, ["mutation_target"])
    md = (tmp_path / "mutate.md").read_text()
    assert "1 survivor(s) stopped at --max-cases with 4 covering case run(s) not made" in md
    assert f"ran by 3 case(s) of {len(IDS)} covering" in md


def test_the_sample_is_shared_between_modules_and_one_module_samples_as_before():
    import random

    big, small = generate("mutation_target"), generate("doubles")[:5]
    both = sample(big + small, 12, seed=3)
    assert sum(m.module == "doubles" for m in both) == 5 and len(both) == 12  # the small one gives its spare share
    assert sample(big + small, 12, seed=3) == both and sample(big + small, 12, seed=4) != both
    picked = set(random.Random(7).sample(range(len(big)), 6))
    assert sample(big, 6, seed=7) == [m for i, m in enumerate(big) if i in picked]


def test_a_function_filter_keeps_only_its_functions_and_an_empty_one_is_refused():
    every = generate("mutation_target")
    kept = in_functions(every, "take|shard_*")
    assert kept and {m.function for m in kept} == {"take", "shard_range"}
    assert len(mutate.target_mutants("mutation_target:load")) == len(in_functions(every, "load"))
    with pytest.raises(mutate.MutateError, match="no mutant of mutation_target is in a function matching 'nothing'"):
        mutate.target_mutants("mutation_target:nothing")


def test_a_shard_needs_a_prepared_campaign_and_merge_copies_only_the_same_campaigns_outcomes(tmp_path):
    assert mutate.shard_of("2/3") == (2, 3) and mutate.shard_of(None) is None
    for bad in ("0/2", "3/2", "1/0", "bad"):
        with pytest.raises(mutate.MutateError, match="expected I/N"):
            mutate.shard_of(bad)
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "o"
    for d in (a, b):
        mutate.mutants_of(["mutation_target"], 4, 1, d)
    with pytest.raises(mutate.MutateError, match="holds no complete clean run"):
        mutate.campaign(["mutation_target"], Path("m.yaml"), None, a, 4, 1, shard=(1, 2))
    (b / "mutants" / "0001").mkdir(parents=True)
    (b / "mutants" / "0001" / "outcome.json").write_text(json.dumps({"outcome": "killed", "index": 1}))
    mutate_results.merge(a, [b])
    have, missing = mutate_results.records_of(a)
    assert [r["index"] for r in have] == [1] and [m["index"] for m in missing] == [0, 2, 3]
    mutate.mutants_of(["mutation_target"], 4, 2, other)  # another seed: other mutants
    with pytest.raises(mutate.MutateError, match="another campaign's mutants"):
        mutate_results.merge(a, [other])


def test_the_warm_parent_keeps_no_step_that_imports_a_target(tmp_path):
    from harness.gate.mutate_warm import STEPS, WarmParent

    parent = WarmParent(["transformers.modeling_utils"], mutate._clean_env(), tmp_path / "warm.log")
    try:
        assert "torch" in parent.kept and "transformers" not in parent.kept and "peft" not in parent.kept
        assert set(parent.kept) <= {name for name, _ in STEPS}
        code, timed_out = parent.run(["run", "--help"], {}, tmp_path / "h.log", 60)  # `ckpt-harness run --help`, forked
        assert (code, timed_out) == (0, False) and "--report" in (tmp_path / "h.log").read_text()
        code, _ = parent.run(["run", "no-such.yaml"], {}, tmp_path / "bad.log", 60)
        assert code == 2 and "no-such.yaml" in (tmp_path / "bad.log").read_text()
    finally:
        parent.close()


def test_a_kill_by_a_case_that_fails_without_the_mutant_too_is_unconfirmed(tmp_path):
    from harness.gate import mutate_report

    flaky, solid = IDS[0], IDS[3]
    records = [{"id": f"m{i}", "module": "mutation_target", "function": "f", "operator": "constant", "path": "p", "line": i,
                "cases": [case], "ran": [case], "diff": "", "outcome": "killed",
                "findings": [{"case": case, "class": "regression", "failing": True}]} for i, case in enumerate((flaky, solid))]
    calls: list[list[str]] = []

    def rerun(args, env, log, timeout):  # without a mutant: the flaky case fails on its own
        assert env == {}
        ids = [args[i + 1] for i, a in enumerate(args) if a == "--id"]
        calls.append(ids)
        report = Path(args[args.index("--report") + 1])
        report.mkdir(parents=True)
        (report / "results.json").write_text(json.dumps({"matrix": "m.yaml", "complete": True, "versions": {}, "summary": {},
                                                          "results": [_result(c, "failed" if c == flaky else "passed") for c in ids]}))
        return 1, False

    stable = mutate_results.confirm(tmp_path, Path("m.yaml"), _clean(), records, rerun)
    assert stable == {flaky: False, solid: True} and calls == [sorted([flaky, solid])]
    assert mutate_results.confirm(tmp_path, Path("m.yaml"), _clean(), records, rerun) == stable and len(calls) == 1  # kept
    overall = mutate_report.write(records, tmp_path, ["mutation_target"], stable=stable)
    assert (overall["killed"], overall["unconfirmed"], overall["covered"], overall["kill_rate"]) == (1, 1, 2, 0.5)
    assert "1 kill(s) unconfirmed" in (tmp_path / "mutate.md").read_text()


def test_a_shard_job_runs_the_same_campaign_with_its_own_shard():
    import argparse

    from harness.gate import mutate_cli

    parser = argparse.ArgumentParser()
    mutate_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["mutate", "--target", "a.b:f*|g,c.d", "--sample", "30", "--seed", "4", "-k=->tp2pp1dp1cp1 resume",
                              "--jobs", "2", "--max-cases", "8", "--cold", "--no-corpus", "--shards", "3", "--out", "/x/c"])
    argv = mutate_cli.shard_argv(args, 2, 3)
    assert argv[1:4] == ["-m", "harness.cli", "mutate"]
    again = parser.parse_args(argv[3:])
    same = ("target", "sample", "seed", "k", "jobs", "max_cases", "cold", "timeout", "no_corpus")
    assert {a: getattr(again, a) for a in same} == {a: getattr(args, a) for a in same}
    assert (again.shard, again.shards, str(again.out), again.matrix.is_absolute()) == ("2/3", None, "/x/c", True)


def test_a_mutant_that_keeps_every_case_then_reads_the_clean_written_corpus(tmp_path):
    m, text = _mutant(), Path(_mutant().path).read_text()
    read = {"results": [_result("golden[dist-optimizer]"), _result("golden[peft-adapter]")]}
    calls: list[list[str]] = []
    matrix_runs = _fake_runner(set(), calls)

    def runner(args, env, log, timeout):
        if args[:2] != ["golden", "check"]:
            return matrix_runs(args, env, log, timeout)
        calls.append(args)
        assert args[2].endswith("/corpus") and "--trust-pickles" in args  # the campaign's own corpus
        asked = [args[i + 1] for i, a in enumerate(args) if a == "--id"]  # only the artefacts that run the span
        assert asked in (["golden[dist-optimizer]"], ["golden[peft-adapter]"])
        report = Path(args[args.index("--report") + 1])
        report.mkdir(parents=True)
        (report / "results.json").write_text(json.dumps({"results": [
            _result("golden[dist-optimizer]", "failed"), _result("golden[peft-adapter]")]}))
        return 1, False

    rec = mutate.run_mutant(m, 0, text, IDS[:2], Path("m.yaml"), tmp_path, 60, _clean(), runner,
                            corpus=mutate.CorpusPlan(read, ["golden[dist-optimizer]"]))
    assert rec["outcome"] == "killed" and rec["findings"][0]["case"] == "golden[dist-optimizer]"
    assert len(calls) == 2 and calls[1][:2] == ["golden", "check"] and rec["cases"] == [*IDS[:2], "golden[dist-optimizer]"]
    # only the artefacts that run the span judge it: another one failing is not this mutant's kill
    rec = mutate.run_mutant(m, 0, text, [], Path("m.yaml"), tmp_path / "other", 60, _clean(), runner,
                            corpus=mutate.CorpusPlan(read, ["golden[peft-adapter]"]))
    assert rec["outcome"] == "survived" and rec["ran"] == ["golden[peft-adapter]"]


def test_a_mutant_that_survives_the_reads_writes_a_corpus_the_clean_code_reads(tmp_path):
    m, text = _mutant(), Path(_mutant().path).read_text()
    read = {"results": [_result("golden[dist-optimizer]"), _result("golden[peft-adapter]")]}
    calls: list[tuple[list[str], dict]] = []

    def runner(args, env, log, timeout):
        calls.append((args, env))
        if args[:2] == ["golden", "make"]:
            assert "CKPT_HARNESS_MUTANT" in env and args[args.index("--id") + 1] == "golden[peft-adapter]"  # the mutant writes
            Path(args[2]).mkdir(parents=True)
            (Path(args[2]) / "manifest.json").write_text("{}")
            return 0, False
        assert args[:2] == ["golden", "check"] and env == {} and "--allow-refusal" in args  # the clean code reads, as a rollback
        report = Path(args[args.index("--report") + 1])
        report.mkdir(parents=True)
        (report / "results.json").write_text(json.dumps({"results": [_result("golden[peft-adapter]", "failed")]}))
        return 1, False

    rec = mutate.run_mutant(m, 0, text, [], Path("m.yaml"), tmp_path, 60, _clean(), runner,
                            corpus=mutate.CorpusPlan(read, [], ["golden[peft-adapter]"]))
    assert rec["outcome"] == "killed" and rec["findings"][0]["case"] == "golden[peft-adapter]"
    assert [a[:2] for a, _ in calls] == [["golden", "make"], ["golden", "check"]]
    assert rec["cases"] == ["written golden[peft-adapter]"] and not (tmp_path / "mutants" / "0000" / "written").exists()


def test_report_only_refuses_a_directory_without_a_campaign_and_reports_what_one_holds(tmp_path, capsys):
    from harness.cli import main

    argv = ["mutate", "--target", "mutation_target", "--sample", "4", "--seed", "1", "--report", "--no-corpus"]
    assert main([*argv, "--out", str(tmp_path / "none")]) == 2 and "holds no campaign" in capsys.readouterr().err
    out = tmp_path / "c"
    mutate.mutants_of(["mutation_target"], 4, 1, out)
    (out / "mutants" / "0002").mkdir(parents=True)
    rec = {**json.loads((out / "mutants.json").read_text())["mutants"][2], "index": 2, "cases": ["x"], "ran": ["x"],
           "diff": "", "outcome": "survived", "findings": []}
    (out / "mutants" / "0002" / "outcome.json").write_text(json.dumps(rec))
    assert main([*argv, "--out", str(out)]) == 0  # nothing run: no clean run to confirm against
    md = (out / "mutate.md").read_text()
    assert "**3 of the campaign's 4 mutants have no outcome yet**" in md and "1 mutant(s) sampled" in md


def test_mutants_run_a_few_of_each_module_in_turn():
    modules = ["a"] * 5 + ["b"] * 2 + ["c"] * 4
    got = mutate.interleaved(list(range(11)), modules, chunk=2)
    assert got == [0, 1, 5, 6, 7, 8, 2, 3, 9, 10, 4] and sorted(got) == list(range(11))
    assert mutate.interleaved([], []) == []


def test_a_worker_keeps_one_warm_parent_per_module_and_sends_clean_runs_to_it(tmp_path, monkeypatch):
    made, colds = [], []

    class Parent:
        def __init__(self, module):
            self.module, self.runs, self.closed = module, [], 0
            made.append(self)

        def run(self, args, env, log, timeout):
            self.runs.append(dict(env))
            return 0, False

        def close(self):
            self.closed += 1

    monkeypatch.setattr(mutate, "cold", lambda args, env, log, timeout: colds.append(dict(env)) or (0, False))
    runners = mutate.Runners(tmp_path, make_parent=Parent)
    def env(module):
        return {"CKPT_HARNESS_MUTANT": json.dumps({"module": module})}
    assert runners(["run"], {}, tmp_path / "l", 1) == (0, False) and colds == [{}]  # no parent yet: a fresh interpreter
    runners(["run"], env("a"), tmp_path / "l", 1)
    runners(["golden", "check"], {}, tmp_path / "l", 1)  # a rollback's clean read: a's parent, without a mutant
    runners(["run"], env("a"), tmp_path / "l", 1)
    runners(["run"], env("b"), tmp_path / "l", 1)
    assert [p.module for p in made] == ["a", "b"] and [len(p.runs) for p in made] == [3, 1]
    assert made[0].runs[1] == {} and made[0].closed == 1
    runners.close()
    assert made[1].closed == 1
    cold_only = mutate.Runners(tmp_path, warm=False, make_parent=Parent)
    cold_only(["run"], env("c"), tmp_path / "l", 1)
    assert len(made) == 2 and colds[-1] == env("c")


def test_the_case_that_runs_the_files_rare_lines_goes_first():
    """A module-level constant is run by every importing case; the one case that reaches its only user
    (the integrity manifest's file hash) must not wait behind the ones that never do."""
    common = {1: {"a", "b", "c", "d"}, 2: {"a", "b", "c", "d"}}
    by_line = {**common, 40: {"d"}, 41: {"d"}}
    rare = mutate_cases.rarity(by_line)
    assert rare["d"] > rare["a"] == rare["b"] == rare["c"] and mutate_cases.rarity({}) == {}
    ids = [f"reshard-weights[mcore_dist-{c}]" for c in "abcd"] + ["resume[mcore_dist-a]"]
    clean = {"results": [_result(c, total=1.0 if "-d" not in c else 9.0) for c in ids]}
    got = mutate_cases.order(ids, clean, {f"reshard-weights[mcore_dist-{c}]": v for c, v in rare.items()})
    assert got[0] == "reshard-weights[mcore_dist-d]", got  # slower, but the only one reaching lines 40-41
    assert mutate_cases.order(ids, clean)[0] == "reshard-weights[mcore_dist-a]"  # without rarity: the fastest


def test_one_case_per_named_defect_goes_before_the_defects_repeats():
    """c5's EP2 survivor: five GPT-OSS exports of one named defect (the merged export raises in the source
    world, the target's EP2 export never runs) went before the passing OLMoE EP2 export that kills it.
    One of them still leads: a mutant that changes the defect is asked by one case as well as by five."""
    reason = "Bridge 0.6.2 GPT-OSS merged export"
    xfails = [f"peft-export[bridge_peft-hf-gpt_oss-tp1pp1dp1cp1->{t}-lora]" for t in ("tp2pp1dp1cp1", "tp1pp2dp1cp1")]
    other = "peft-export[bridge_peft-hf-glm4_moe-tp1pp1dp1cp1->tp1pp2dp1cp1-lora]"
    green = "peft-export[bridge_peft-hf-olmoe-tp1pp1dp1cp1->tp1pp1dp2cp1ep2-lora]"
    cases = xfails + [other, green]

    def res(c, status="xfailed", why=reason):
        return {**_result(c, status=status), "xfail_reason": why if status == "xfailed" else None}

    clean = {"results": [res(c) for c in xfails] + [res(other, why="another defect"), res(green, status="passed")]}
    rare = {xfails[0]: 5.0, xfails[1]: 4.0, other: 3.0, green: 1.0}  # the xfails even run more of the file
    got = mutate_cases.order(cases, clean, rare)
    assert got == [xfails[0], other, green, xfails[1]], got  # the repeat of a defect last, each defect's first in place
    assert mutate_cases.order(cases, {"results": [_result(c) for c in cases]}, rare) == cases  # all green: rarity only
