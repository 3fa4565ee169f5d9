"""The bump gate and the golden corpus: verdicts from hand-made results, refusals before any build,
a corrupted corpus file and a corrupted load going red."""

import json

import pytest

from harness.gate import golden
from harness.gate.bump import Side, cross_findings, run_gate, verdict_markdown
from harness.gate.compare import Finding
from harness.orchestration.runner import RunOptions


def _doc(*results):
    return {"versions": {"megatron-core": "0.19.2"}, "results": list(results)}


def _r(cid, status, checks=(), error=None):
    return {"id": cid, "status": status, "error": error, "checks": [{"name": n, "status": s, "detail": d} for n, s, d in checks]}


def test_cross_version_findings():
    forward = _doc(_r("golden[model-dist@a->b-baseline->candidate]", "passed"),
                   _r("golden[optim@a->b-baseline->candidate]", "failed", [("optimizer-state", "failed", "1 mismatch")]),
                   _r("golden[hf@a->b-baseline->candidate]", "error", error="API not available in megatron-core 0.18.2: ImportError: x\nmore"),
                   _r("golden[peft@a->b-baseline->candidate]", "error",
                      error="API not available in megatron-bridge 0.5.1: AttributeError: 'AutoBridge' object has no attribute 'save_hf_adapter'"))
    found = cross_findings(forward, False, {"megatron-core": "0.19.2"}, {"megatron-core": "0.18.2"})
    assert [f.case for f in found] == ["golden[optim@a->b-baseline->candidate]", "golden[hf@a->b-baseline->candidate]",
                                       "golden[peft@a->b-baseline->candidate]"]
    assert found[0].failing and found[0].kind == "regression" and "checks optimizer-state" in found[0].detail
    # the harness's own reach into an internal name it cannot find: a hole, not the candidate's fault
    assert found[1].kind == "not-evaluated" and not found[1].failing and "megatron-core 0.18.2" in found[1].detail
    # a public API the candidate dropped: a break for users, failing
    assert found[2].kind == "api-break" and found[2].failing and "save_hf_adapter" in found[2].detail
    rollback = _doc(_r("golden[model-dist@a->b-candidate->baseline]", "passed", [("refusal", "passed", "refused cleanly")]),
                    _r("golden[peft@a->b-candidate->baseline]", "failed", [("adapter-params", "failed", "values differ")]))
    (f,) = cross_findings(rollback, rollback=True)
    assert f.case.startswith("golden[peft") and f.detail.startswith("rollback")


def test_verdict_lists_regressions_first_and_says_what_was_compared():
    sides = [Side("baseline", []), Side("candidate", ["megatron-core==0.18.2"])]
    bad = [Finding("reshard-weights[x]", "regression", "passed -> error"), Finding("y", "time-growth", "slower")]
    base, cand = _doc(_r("reshard-weights[x]", "passed")), _doc(_r("reshard-weights[x]", "error"))
    md = verdict_markdown(sides, bad, base, cand, [], {"total": 1.0}, None)
    assert md.startswith("# Bump gate: NOT SAFE, 1 failing finding(s) (exit 1)")
    assert md.index("## Regressions") < md.index("## Matrix") and "`megatron-core==0.18.2`" in md
    assert verdict_markdown(sides, [], base, base, [], {}, None).startswith("# Bump gate: SAFE TO BUMP (exit 0)")
    assert verdict_markdown(sides, [], None, None, [], {}, "pip failed").startswith("# Bump gate: COULD NOT RUN (exit 2)")


def test_a_bad_candidate_ends_the_gate_before_any_build(tmp_path, capsys):
    out = tmp_path / "gate"
    assert run_gate(["megatron-bridge>>1"], [], tmp_path / "m.yaml", None, out, tmp_path / "cache") == 2
    verdict = (out / "verdict.md").read_text()
    assert "COULD NOT RUN" in verdict and "megatron-bridge>>1" in verdict
    assert json.loads((out / "gate.json").read_text())["exit_code"] == 2
    assert not (tmp_path / "cache").exists()  # nothing was built
    assert run_gate([], [], tmp_path / "m.yaml", None, tmp_path / "g2", tmp_path / "cache") == 2


def test_the_gate_never_writes_into_a_used_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert run_gate(["megatron-core==0.19.0"], [], tmp_path / "m.yaml", None, tmp_path, tmp_path / "cache") == 2
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "verdict.md").exists()


def test_golden_corpus_integrity_and_a_corrupted_load(tmp_path):
    corpus = tmp_path / "corpus"
    (made,) = golden.make(corpus, k="model-dist")
    assert made.status == "passed", made.error
    manifest = golden.read_manifest(corpus)
    assert set(manifest["artefacts"]) == {"model-dist"} and manifest["versions"]["megatron-core"]
    (good,) = golden.check(corpus, k="model-dist")
    assert good.status == "passed" and {c.name for c in good.checks} == {"checkpoint-canonical", "loaded-canonical"}
    assert [r.id for r in golden.check(corpus, ids=[good.id])] == [good.id] and golden.check(corpus, ids=["golden[x]"]) == []
    (bad,) = golden.check(corpus, RunOptions(rank_hooks=("doubles:corrupt_mcore_loads",)), k="model-dist")
    assert bad.status == "failed" and {c.name: c.status for c in bad.checks}["loaded-canonical"] == "failed"
    shard = sorted((corpus / "model-dist" / "ckpt").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    (tampered,) = golden.check(corpus, k="model-dist")
    assert tampered.status == "failed" and tampered.checks[0].name == "corpus-integrity" and shard.name in tampered.checks[0].detail


def test_not_a_corpus(tmp_path):
    with pytest.raises(golden.CorpusError, match="not a golden corpus"):
        golden.check(tmp_path)
    (tmp_path / "x").mkdir()
    with pytest.raises(golden.CorpusError, match="written once"):
        golden.make(tmp_path / "x")


@pytest.mark.slow  # builds a candidate venv (~3-5 min on 2 cores, pip cache warm) and runs both sides
def test_the_gate_catches_a_planted_bridge_defect(tmp_path, monkeypatch):
    """The whole gate, cross-version reads included, on the planted candidate (tests/planted_bridge.py)
    with its `alpha` fault: the exported adapter_config.json says lora_alpha 32 whatever was asked."""
    from pathlib import Path

    from planted_bridge import PLANT, planted_bridge

    from harness.gate.envspec import _default_cache

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gate"
    case = "peft-export[bridge_peft-hf-llama-tp1pp1dp1cp1->tp1pp1dp1cp1-lora]"
    monkeypatch.setenv(PLANT, "alpha")
    code = run_gate([str(planted_bridge(_default_cache()))], [], root / "matrices" / "smoke.yaml", case, out, _default_cache())
    verdict = (out / "verdict.md").read_text()
    assert code == 1, verdict
    regressions = verdict.split("## Regressions")[1].split("\n## ")[0]
    assert case in regressions and "adapter-config" in regressions
    cand = json.loads((out / "candidate" / "results.json").read_text())
    assert cand["versions"]["megatron-bridge"] == "0.6.2+planted" and cand["environment"]["overrides"][0]["kind"] == "tree"


def test_an_artefact_the_writer_could_not_make_is_named_not_lost():
    doc = _doc(_r("golden[hf-export@a->b-candidate->baseline]", "error",
                  error="not written: the writer could not make this artefact: API not available in megatron-core 0.18.2: x"))
    (f,) = cross_findings(doc, rollback=True)
    assert f.kind == "disappeared" and not f.failing and "not written" in f.detail
    (f,) = cross_findings(doc, rollback=False)
    assert f.failing


def test_the_verdict_quotes_the_exception_a_rank_raised():
    from harness.gate.bump import reason

    tb = ("rank 1 of 2 raised:\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n    raise CheckpointingException(m)\n"
          "megatron.core.dist_checkpointing.core.CheckpointingException: Common file /c/common.pt does not exist\n\n"
          "(then rank 0 failed: megatron.core.dist_checkpointing.core.CheckpointingException: Common file)")
    assert reason(tb) == "CheckpointingException: Common file /c/common.pt does not exist"
    assert reason("API not available in megatron-core 0.18.2: x\nTraceback") == "API not available in megatron-core 0.18.2: x"


def test_results_are_written_as_they_come(tmp_path, monkeypatch):
    """A run that dies on its second case still leaves the first result in results.json."""
    from harness.cli import main
    from harness.core.result import CaseResult
    from harness.orchestration import runner

    matrix = tmp_path / "m.yaml"
    matrix.write_text("name: t\nentries:\n  - {case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2', 'tp2 -> tp1']}\n")
    calls = []

    def fake(spec, options=None):
        calls.append(spec.id)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the job is killed mid-run
        return CaseResult(spec.id, spec.case, spec.model, spec.backend, spec.source.id, spec.target.id, status="passed")

    monkeypatch.setattr(runner, "run_case", fake)
    with pytest.raises(KeyboardInterrupt):
        main(["run", str(matrix), "--report", str(tmp_path / "rep")])
    doc = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert doc["complete"] is False and [r["id"] for r in doc["results"]] == calls[:1]


def test_junit_xml_has_one_testcase_per_case_with_its_outcome(tmp_path):
    import xml.etree.ElementTree as ET

    from harness.core.result import CaseResult, Check
    from harness.report.results import write_junit

    ok = CaseResult("a[x]", "reshard-weights", "m", "b", "s", "t", status="passed", phases={"total": 1.5})
    bad = CaseResult("b[x]", "reshard-weights", "m", "b", "s", "t", status="failed", checks=[Check("logits", "failed", "off by 1e-2")])
    err = CaseResult("c[x]", "resume", "m", "b", "s", "t", status="error", error="rank 1 of 2 raised:\nKeyError: 'step'")
    xf = CaseResult("d[x]", "resume", "m", "b", "s", "t", status="xfailed", xfail_reason="megatron-core defect")
    root = ET.parse(write_junit([ok, bad, err, xf], tmp_path / "j.xml", "smoke", 9.0)).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("4", "1", "1", "1")
    cases = {tc.get("name"): tc for tc in root.iter("testcase")}
    assert list(cases["a[x]"]) == [] and cases["a[x]"].get("time") == "1.500"
    assert "check logits failed" in cases["b[x]"].find("failure").text
    assert cases["c[x]"].find("error").get("message") == "rank 1 of 2 raised:" and "KeyError" in cases["c[x]"].find("error").text
    assert "megatron-core defect" in cases["d[x]"].find("skipped").get("message")


def test_verdict_separates_regressions_api_breaks_and_what_could_not_be_evaluated():
    rs = {"asked": ["megatron-bridge==0.5.1"], "resolved": [{"name": "megatron-core", "spec": "megatron-core<0.19.0,>=0.18.0",
          "reason": "megatron-bridge 0.5.1 was built against this Core line"}], "dropped": [], "overridden": [], "notes": []}
    sides = [Side("baseline", []), Side("candidate", ["megatron-bridge==0.5.1"], release_set=rs)]
    found = [Finding("reshard-weights[a]", "regression", "passed -> failed"),
             Finding("peft-export[b]", "api-break", "passed -> error: megatron-bridge 0.5.1 no longer offers save_hf_adapter"),
             Finding("resume[c]", "not-evaluated", "passed -> error: the harness has no driver for megatron-core 0.18.2: x"),
             Finding("resume[d]", "not-evaluated", "passed -> error: the harness has no driver for megatron-core 0.18.2: x")]
    md = verdict_markdown(sides, found, None, None, [], {}, None)
    assert "## Regressions (1)" in md and "## Breaking API changes (1)" in md and "## Could not evaluate (2)" in md
    assert md.index("## Regressions") < md.index("## Breaking API changes") < md.index("## Could not evaluate")
    regressions = md[md.index("## Regressions"):md.index("## Breaking API changes")]
    assert "peft-export" not in regressions and "resume[" not in regressions
    assert "| resume | 2 |" in md  # counted per case kind
    assert "megatron-core<0.19.0,>=0.18.0" in md and "built against this Core line" in md  # the release set, with why
