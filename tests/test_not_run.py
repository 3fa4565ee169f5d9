"""`not-run`: a case whose entry requires what the machine lacks is not run, says why everywhere
(summary, results.json, Markdown, JUnit, HTML, pytest, compare), and is never counted green."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

import pytest

from harness.cli import main
from harness.core import requires
from harness.core.result import CaseResult
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.gate import compare as cmp
from harness.orchestration.matrix import load_matrix
from harness.orchestration.runner import RunOptions, run_case
from harness.report import html as html_report
from harness.report import results as report

pytest_plugins = ["pytester"]

NO_GPU = requires.Machine(cuda_devices=0, nccl=True, te_missing="No module named 'transformer_engine'", host_memory_gib=24.0)
GPU8 = requires.Machine(cuda_devices=8, nccl=True, te_missing=None, host_memory_gib=1024.0)
#: No machine has this much memory: an entry requiring it is not-run everywhere (subprocess tests).
IMPOSSIBLE = "host-memory-gib>=1000000"


@pytest.mark.parametrize("needs, ranks, backend, machine, expect", [
    (("cuda",), 2, "auto", NO_GPU, ["needs 2 CUDA device(s), one per rank; this machine has 0"]),
    (("cuda",), 8, "auto", GPU8, []),
    (("cuda",), 2, "gloo", GPU8, ["needs CUDA ranks, but --dist-backend gloo runs every rank on CPU"]),
    (("te",), 4, "auto", GPU8, []),
    (("te",), 4, "auto", NO_GPU, ["needs 4 CUDA device(s), one per rank; this machine has 0",
                                  "needs Transformer-Engine: No module named 'transformer_engine'"]),
    (("nccl",), 2, "nccl", requires.Machine(2, False, None, 64.0), ["needs NCCL; this torch build has none"]),
    (("host-memory-gib>=64",), 1, "auto", NO_GPU, ["needs 64 GiB of host memory; this machine has 24.0 GiB"]),
    ((), 8, "auto", NO_GPU, []),
])
def test_unmet_names_each_missing_thing(needs, ranks, backend, machine, expect):
    assert requires.unmet(needs, ranks, backend, machine) == expect


def test_te_and_nccl_imply_cuda_and_unknown_names_are_refused():
    assert requires.closure(("te",)) == ("cuda", "te")
    assert requires.closure(("nccl", "host-memory-gib>=8")) == ("cuda", "host-memory-gib>=8", "nccl")
    with pytest.raises(requires.RequirementError, match="unknown requirement 'gpu'.*cuda, nccl, te"):
        requires.parse("gpu")


def test_matrix_requires_is_validated_and_closed(tmp_path, matrix_error):
    p = tmp_path / "ok.yaml"
    p.write_text("entries:\n  - {case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], requires: [te]}\n")
    (spec,) = load_matrix(p).cases
    assert spec.requires == ("cuda", "te")
    assert "requires: unknown requirement 'gpus'" in matrix_error("{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], requires: [gpus]}")


def _spec(**kw) -> CaseSpec:
    return CaseSpec(case="reshard-weights", model="gpt-gqa", backend="mcore_dist", source=Topology(tp=2), target=Topology(dp=2), **kw)


def test_a_case_requiring_cuda_on_a_cpu_machine_is_not_run_and_one_without_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(requires, "probe", lambda: NO_GPU)
    r = run_case(_spec(requires=("cuda",)), RunOptions(workdir=tmp_path))
    assert r.status == "not-run" and r.not_run_reason == "needs 2 CUDA device(s), one per rank; this machine has 0"
    assert not r.checks and not list(tmp_path.iterdir())  # nothing of the case ran, not even its scratch dir
    ran = run_case(_spec(), RunOptions(workdir=tmp_path, dist_backend="gloo"))
    assert ran.status == "passed", ran.failure_text()


@pytest.mark.parametrize("bridge", ["provider", "vanilla"])
def test_a_verl_case_on_a_box_without_ray_is_not_run_naming_it(monkeypatch, tmp_path, bridge):
    """A GPU image that carries verl's checkpoint path but not ray (ray's wheel is larger than what a lent
    box takes): the case errored in the parent's import of verl; it is not-run, naming what is missing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "mbridge") else real(name, *a))
    spec = CaseSpec("verl-checkpoint", "hf-llama", "verl_manager", Topology.parse("tp1"), Topology.parse("tp1"),
                    options=(("sharding", "fully_reshardable"), ("steps", 0)), backend_options=(
                        ("bridge", bridge), ("load_contents", ("model", "optimizer")), ("save_contents", ("model", "optimizer", "hf_model"))))
    r = run_case(spec, RunOptions(workdir=tmp_path, dist_backend="gloo"))
    assert r.status == "not-run", (r.status, r.error)
    assert r.not_run_reason.startswith("backend verl_manager needs ray (verl's checkpoint manager imports them"), r.not_run_reason
    assert not list(tmp_path.iterdir())


def test_forcing_nccl_is_a_requirement_and_xfail_never_turns_a_not_run_into_xpass(monkeypatch):
    from harness.core.spec import XFail

    monkeypatch.setattr(requires, "probe", lambda: NO_GPU)
    r = run_case(_spec(xfail=XFail("some defect")), RunOptions(dist_backend="nccl"))
    assert r.status == "not-run" and "CUDA device" in r.not_run_reason


def _results() -> list[CaseResult]:
    ok = CaseResult("a[x]", "reshard-weights", "gpt-gqa", "mcore_dist", "tp1", "tp2", status="passed")
    nr = CaseResult("b[<y>]", "reshard-weights", "gpt-gqa", "mcore_dist", "cp2", "cp1", status="not-run",
                    not_run_reason="needs Transformer-Engine: No module named 'transformer_engine'")
    return [ok, nr]


def test_junit_html_markdown_and_summary_show_not_run_with_its_reason(tmp_path):
    results = _results()
    assert report.counts(results) == {"passed": 1, "failed": 0, "error": 0, "xfailed": 0, "not-run": 1, "not-applicable": 0}
    root = ET.parse(report.write_junit(results, tmp_path / "j.xml", "s", 1.0)).getroot()
    assert root.get("skipped") == "1" and root.get("failures") == "0"
    (skipped,) = root.iter("skipped")
    assert skipped.get("message") == "not run: needs Transformer-Engine: No module named 'transformer_engine'"
    doc = report.document(results, "m.yaml", 1.0)
    assert doc["summary"]["not-run"] == 1 and doc["results"][1]["not_run_reason"].startswith("needs Transformer-Engine")
    md = report.markdown(doc)
    assert "| not-run (needs Transformer-Engine: No module named 'transformer_engine') |" in md and "1 passed, 1 not-run" in md
    html = html_report.render(doc, "t")
    assert "not run on this machine: needs Transformer-Engine" in html and "b[&lt;y&gt;]" in html


def test_compare_lists_passed_to_not_run_without_failing():
    base = {"results": [{"id": "b", "status": "passed", "checks": []}]}
    cand = {"results": [{"id": "b", "status": "not-run", "not_run_reason": "needs 8 CUDA device(s)", "checks": []}]}
    (f,) = cmp.compare(base, cand)
    assert f.kind == "not-run" and not f.failing and "needs 8 CUDA device(s)" in f.detail
    assert cmp.exit_code([f]) == 0 and "1 case(s) run on one side only" in cmp.verdict([f])
    (back,) = cmp.compare(cand, base)
    assert back.kind == "not-run" and "not run on the base" in back.detail


MATRIX = f"""
name: req
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp1 -> tp2"]
  - case: reshard-weights
    models: [gpt-tied]
    pairs: ["tp1 -> tp2"]
    requires: ["{IMPOSSIBLE}"]
"""


def test_cli_counts_not_run_apart_and_fail_on_not_run_exits_3(tmp_path, capsys):
    m = tmp_path / "m.yaml"
    m.write_text(textwrap.dedent(MATRIX))
    assert main(["run", str(m), "--report", str(tmp_path / "r"), "--dist-backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 1 not-run" in out and "not-run (1): needs 1e+06 GiB of host memory" in out
    assert json.loads((tmp_path / "r" / "results.json").read_text())["summary"]["not-run"] == 1
    assert main(["run", str(m), "-k", "gpt-tied", "--fail-on-not-run"]) == 3


def test_pytest_skips_a_not_run_case_with_its_reason(pytester):
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "x.yaml").write_text(textwrap.dedent(MATRIX))
    result = pytester.runpytest_subprocess("-k", "gpt-tied", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*not run: needs 1e+06 GiB of host memory*"])
