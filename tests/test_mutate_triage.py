"""A person's judgement of survivors (harness/gate/mutate_triage.py): equivalent ones leave both rates,
out-of-reach ones stay counted, a judgement never overrides a kill, and a bad file is refused by name."""

from __future__ import annotations

import pytest

from harness.gate import mutate_report, mutate_triage


def _rec(i: int, outcome: str) -> dict:
    return {"id": f"m{i}", "module": "mutation_target", "function": "f", "operator": "constant", "path": "p", "line": i,
            "cases": ["c"], "ran": ["c"], "diff": f"-a{i}\n+b{i}", "outcome": outcome, "findings": []}


def _write(tmp_path, text: str):
    f = tmp_path / "triage.yaml"
    f.write_text(text)
    return f


def test_judged_survivors_change_the_rates_as_their_class_says_and_a_kill_stands(tmp_path):
    records = [_rec(0, "survived"), _rec(1, "survived"), _rec(2, "killed"), _rec(3, "survived"), _rec(4, "not-covered")]
    triage = mutate_triage.load(_write(tmp_path, "m0: {class: equivalent, why: the same bytes another way}\n"
                                                 "m1: {class: out-of-reach, why: a GPU with TE}\n"
                                                 "m2: {class: equivalent, why: wrong}\n"))
    plain = mutate_report.write(records, tmp_path, ["mutation_target"])
    assert (plain["survived"], plain["covered"], plain["kill_rate"]) == (3, 4, 0.25)
    judged = mutate_report.write(records, tmp_path, ["mutation_target"], triage=triage)
    # m0 leaves both rates; m1 stays a survivor; m2's kill stands although it is "judged" equivalent
    assert (judged["equivalent"], judged["survived"], judged["killed"], judged["covered"]) == (1, 2, 1, 3)
    assert judged["kill_rate"] == round(1 / 3, 4) and judged["coverage_rate"] == 0.75
    md = (tmp_path / "mutate.md").read_text()
    assert "**1 mutant(s) judged equivalent were killed** (the judgement is wrong, the kill counts): m2" in md
    assert "**Judged equivalent**: the same bytes another way." in md and "**Out of reach on CPU**: a GPU with TE." in md
    assert mutate_triage.apply([], triage) == ([], [])


@pytest.mark.parametrize("text, message", [
    ("m0: {class: equivalent}\n", "m0: give exactly `class` and `why`"),
    ("m0: {class: dunno, why: x}\n", "m0: class 'dunno' is not one of equivalent, out-of-reach"),
    ("m0: {class: equivalent, why: ' '}\n", "m0: `why` is empty"),
    ("- m0\n", "expected a mapping"),
    ("mod:Cls.f: {class: equivalent, why: x}\n", "mod:Cls.f: a function-wide entry can only be out-of-reach"),
])
def test_a_bad_triage_file_is_refused_naming_file_and_key(tmp_path, text, message):
    f = _write(tmp_path, text)
    with pytest.raises(ValueError, match=f"triage file {f}: .*" if "mapping" in message else None) as err:
        mutate_triage.load(f)
    assert message in str(err.value) and str(f) in str(err.value)


def test_the_shipped_triage_file_loads_and_judges_only_with_a_reason():
    shipped = mutate_triage.load(mutate_triage.DEFAULT)
    assert shipped and all(e["why"].strip() and e["class"] in mutate_triage.CLASSES for e in shipped.values())


def test_a_function_wide_out_of_reach_entry_marks_its_not_covered_mutants_and_the_cpu_coverage_leaves_them_out(tmp_path):
    records = [_rec(0, "killed"), _rec(1, "not-covered"), {**_rec(2, "not-covered"), "function": "g"},
               {**_rec(3, "survived"), "function": "g"}, _rec(4, "equivalent")]
    triage = mutate_triage.load(_write(tmp_path, "mutation_target:g: {class: out-of-reach, why: fp8 only}\n"))
    out = mutate_report.write(records, tmp_path, ["mutation_target"], triage=triage)
    # m2 stays not covered (the rate counts it) but is out of reach; m1 (function f) stays a blind spot
    assert (out["not-covered"], out["not-covered-out-of-reach"], out["covered"]) == (2, 1, 2)
    assert out["coverage_rate"] == 0.5 and out["cpu_coverage_rate"] == round(2 / 3, 4)
    md = (tmp_path / "mutate.md").read_text()
    assert "Of the 2 not covered, 1 are in code the CPU harness cannot reach" in md and md.count("**Out of reach on CPU**: fp8 only.") == 2
    plain = mutate_report.write(records, tmp_path, ["mutation_target"])
    assert plain["not-covered-out-of-reach"] == 0 and plain["cpu_coverage_rate"] == plain["coverage_rate"]


def test_every_shipped_function_entry_names_a_function_the_installed_upstream_has():
    from harness.gate.mutate import target_mutants

    shipped = [k for k in mutate_triage.load(mutate_triage.DEFAULT) if mutate_triage.is_function_key(k)]
    assert shipped
    for key in shipped:
        module, function = key.split(":")
        assert any(m.function == function for m in target_mutants(module)), key
