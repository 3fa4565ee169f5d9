"""The HF architectures Megatron-Bridge registers, diffed by the gate and laid out by the sweep
(harness/gate/archs.py, harness/gate/sweep/arch_axis.py): pure functions on planted results.json
documents. Each test names exact findings, so an empty input fails it: an empty registry is an
evidence problem, never "no change"."""

from __future__ import annotations

from typing import Any

import pytest

from harness.gate import archs, evidence
from harness.gate.bump import Side
from harness.gate.sweep import arch_axis
from harness.gate.sweep.render import markdown, to_json
from harness.gate.sweep.table import sweep_table
from harness.gate.verdict import verdict_markdown

CASE = "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]"
HF = "hf-roundtrip[bridge_hf-hf-llama-tp2pp1dp1cp1->tp1pp2dp1cp1]"
#: a made-up zoo: hf-llama is LlamaForCausalLM's family; NewArchForCausalLM has a zoo model, Extra none
ZOO = {"LlamaForCausalLM": ["hf-llama"], "NewArchForCausalLM": ["hf-newarch"]}


def models(architecture: str) -> list[str]:
    return ZOO.get(architecture, [])


def doc(registry: list[str] | None, status: str = "passed", probe: bool = True, **more: Any) -> dict[str, Any]:
    """A planted results.json: one mcore case, one Bridge case of hf-llama, and the registry."""
    d: dict[str, Any] = {"complete": True, "selected": [CASE, HF], "versions": {"megatron-bridge": "x"},
                         "results": [{"id": CASE, "status": "passed", "model": "gpt-gqa", "checks": []},
                                     {"id": HF, "status": status, "model": "hf-llama", "checks": []}], **more}
    if probe:
        d[archs.KEY] = {"architectures": registry, "source": "planted", "error": None if registry is not None else "boom"}
    return d


BASE = doc(["LlamaForCausalLM", "Qwen2ForCausalLM", "GoneForCausalLM"])
CAND = doc(["LlamaForCausalLM", "Qwen2ForCausalLM", "NewArchForCausalLM", "ExtraForCausalLM"])


def _exit(base: dict, cand: dict, findings: list) -> int:
    cover = evidence.coverage(base, cand, findings)
    return archs.exit_code(evidence.exit_code(findings, cover), archs.problem(base, cand))


def test_one_removed_and_two_added_give_exactly_those_findings_and_exit_1():
    found = archs.diff(BASE, CAND, models)
    assert [(f.case, f.kind, f.failing) for f in found] == [
        ("architecture GoneForCausalLM", "architecture-removed", True),
        ("architecture ExtraForCausalLM", "architecture-added", False),
        ("architecture NewArchForCausalLM", "architecture-added", False),
    ]
    assert archs.problem(BASE, CAND) is None
    assert _exit(BASE, CAND, found) == 1
    extra, new = found[1].detail, found[2].detail
    assert "does not run it" in extra and "hf-newarch" in new and "did not run" in new


def test_an_addition_alone_is_listed_and_the_gate_stays_safe():
    cand = doc(["LlamaForCausalLM", "Qwen2ForCausalLM", "GoneForCausalLM", "NewArchForCausalLM"])
    found = archs.diff(BASE, cand, models)
    assert [(f.case, f.kind) for f in found] == [("architecture NewArchForCausalLM", "architecture-added")]
    assert _exit(BASE, cand, found) == 0


def test_the_same_registry_is_no_change_only_when_it_holds_something():
    assert archs.diff(BASE, BASE, models) == [] and archs.problem(BASE, BASE) is None
    assert _exit(BASE, BASE, []) == 0
    lines = archs.lines([], None, BASE, BASE)
    assert lines == ["- Architectures: the candidate's Megatron-Bridge registers the same 3 HF architecture(s) as the baseline's."]


@pytest.mark.parametrize("base,cand,says", [
    (doc([]), doc([]), "both registries are empty"),
    (doc([]), doc(["LlamaForCausalLM"]), "the baseline registry is empty"),
    (doc(None, probe=False), doc(["LlamaForCausalLM"]), "the baseline run recorded no Megatron-Bridge architecture registry"),
    (doc(["LlamaForCausalLM"]), doc(None), "the probe failed: boom"),
    ({}, {}, "no `bridge_architectures`"),
])
def test_no_registry_to_compare_is_an_evidence_problem_not_no_change(base, cand, says):
    why = archs.problem(base, cand)
    assert why is not None and says in why
    if base.get("results") and cand.get("results"):
        assert _exit(base, cand, archs.diff(base, cand, models)) == 2  # green cases, yet no verdict
    assert archs.lines([], why, base, cand)[0].startswith("- **Architecture registry: no evidence**")


def test_the_verdict_names_the_removal_in_its_first_lines():
    found = archs.diff(BASE, CAND, models)
    cover = evidence.coverage(BASE, CAND, found)
    head = archs.lines(found, None, BASE, CAND)
    md = verdict_markdown([Side("baseline", []), Side("candidate", ["x"])], found, BASE, CAND, [], {}, None,
                          1, cover, head)
    first = md.splitlines()[:8]
    assert first[0] == "# Bump gate: NOT SAFE, 1 failing finding(s) (exit 1)"
    assert any("1 architecture(s) removed" in ln and "`GoneForCausalLM`" in ln for ln in first), first
    assert any("2 architecture(s) added" in ln for ln in first), first
    assert "## Architectures removed (1)" in md and "## Architectures added (2)" in md


def test_a_removed_architecture_says_how_many_of_its_cases_ran():
    base = doc(["LlamaForCausalLM"])
    found = archs.diff(base, doc(["Qwen2ForCausalLM"]), models)
    assert found[0].case == "architecture LlamaForCausalLM" and "(1 case(s) of it ran on the baseline)" in found[0].detail


def test_the_family_of_an_hf_class_matches_the_zoo():
    assert archs.family("LlamaForCausalLM") == "llama" and archs.family("Qwen3MoeForCausalLM") == "qwen3moe"
    assert "hf-llama" in archs.zoo_models("LlamaForCausalLM") and "hf-qwen3moe" in archs.zoo_models("Qwen3MoeForCausalLM")
    assert archs.zoo_models("NoSuchForCausalLM") == []


# ----------------------------------------------------------------------------- the sweep's axis


def test_the_sweep_axis_marks_presence_and_outcome_per_release():
    runs = [("0.5.1", doc(["LlamaForCausalLM", "GoneForCausalLM"])),
            ("0.6.0", doc(["LlamaForCausalLM", "NewArchForCausalLM"], status="failed")),
            ("0.6.2", doc(None, probe=False))]
    ax = arch_axis.axis(runs, models)
    assert [(r.name, r.cells, r.changed) for r in ax.rows] == [
        ("GoneForCausalLM", ["o", "-", "?"], True),
        ("NewArchForCausalLM", ["-", "o", "?"], True),
        ("LlamaForCausalLM", ["P", "F", "?"], False),
    ]
    assert arch_axis.changes(ax) == ["- `0.6.0`: added NewArchForCausalLM; **removed** GoneForCausalLM"]
    table = sweep_table(runs)
    table.archs = ax
    md = markdown(table)
    assert "## Architectures (3, 2 changed)" in md and "* GoneForCausalLM" in md
    assert to_json(table)["architectures"]["rows"][0] == {"architecture": "GoneForCausalLM", "cells": ["o", "-", "?"],
                                                           "changed": True, "zoo": []}


def test_the_sweep_axis_is_absent_without_any_registry_and_stays_compact_at_40_by_10():
    assert arch_axis.axis([("a", doc(None, probe=False))], models) is None and arch_axis.markdown_lines(None) == []
    names = [f"Arch{i:02d}ForCausalLM" for i in range(40)]
    runs = [(f"0.{r}.0", doc(names[: 31 + r])) for r in range(10)]
    lines = arch_axis.markdown_lines(arch_axis.axis(runs, models))
    block = lines[lines.index("```") + 1: len(lines) - 1 - lines[::-1].index("```")]
    assert len(block) == 41 and max(map(len, block)) < 50  # a header and one short line per architecture
    assert block[1].startswith("* Arch31ForCausalLM") and block[1].endswith("- o o o o o o o o o")
