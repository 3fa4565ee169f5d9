"""End to end: the reshard-weights case passes on a good backend and fails, naming the key and
the topology pair, when one bit of one tensor goes wrong on the way."""

import json

import pytest
from doubles import use_doubles

from harness.cli import main
from harness.core.spec import CaseSpec, XFail
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(
    test_corrupt_load="doubles:CorruptAfterLoad",
    test_corrupt_save="doubles:CorruptBeforeSave",
    test_noop_load="doubles:NoopLoad",
    test_raising_load="doubles:RaisingLoad",
)


def _spec(backend="mcore_dist", src="tp2pp1", dst="tp1pp2", xfail=None, model="gpt-gqa"):
    return CaseSpec("reshard-weights", model, backend, Topology.parse(src), Topology.parse(dst), xfail=xfail, timeout_s=120)


def _checks(result):
    return {c.name: c.status for c in result.checks}


def test_good_backend_passes_every_check():
    r = run_case(_spec())
    assert r.status == "passed", r.failure_text()
    assert _checks(r) == dict.fromkeys(
        ["source-canonical", "checkpoint-canonical", "loaded-canonical", "resave-plain", "logits"], "passed"
    )
    assert r.check("logits").tolerance.label.startswith("atol=")  # TP changed: named tolerance
    assert {"save", "load", "read", "compare", "total"} <= set(r.phases)


def test_one_bit_flipped_after_load_fails_naming_key_and_pair():
    r = run_case(_spec("test_corrupt_load"))
    assert r.status == "failed"
    assert _checks(r)["loaded-canonical"] == "failed"
    assert _checks(r)["resave-plain"] == "failed"
    (m,) = r.check("loaded-canonical").mismatches
    assert m.key == "embedding.word_embeddings.weight" and m.kind == "value"
    assert m.actual == "tp1pp2dp1cp1" and m.max_abs_diff > 0
    assert "tp2pp1dp1cp1" in r.check("resave-plain").mismatches[0].expected
    assert "embedding.word_embeddings.weight" in r.failure_text()


def test_one_bit_flipped_before_save_fails_the_checkpoint_check():
    r = run_case(_spec("test_corrupt_save", src="pp2", dst="tp2"))
    assert r.status == "failed"
    assert _checks(r)["checkpoint-canonical"] == "failed"
    assert _checks(r)["loaded-canonical"] == "failed"


def test_a_load_that_does_nothing_is_caught():
    r = run_case(_spec("test_noop_load", src="tp1", dst="tp1"))
    assert r.status == "failed"
    assert _checks(r)["loaded-canonical"] == "failed" and _checks(r)["logits"] == "failed"


def test_strict_xfail_semantics():
    assert run_case(_spec("test_raising_load")).status == "error"
    r = run_case(_spec("test_raising_load", xfail=XFail("upstream defect X", match="simulated-upstream-defect",
                                                         raised_in="torch.serialization")))
    assert r.status == "xfailed" and "simulated-upstream-defect" in r.error
    # the same text met by an error raised where the upstream defect does not raise: not the defect
    r = run_case(_spec("test_raising_load", xfail=XFail("upstream defect X", match="simulated-upstream-defect",
                                                         raised_in="megatron.core")))
    assert r.status == "failed" and any("not in megatron.core" in n for n in r.notes)
    # the short form accepts failed checks only: an error (a crash, a harness bug) is not the defect
    r = run_case(_spec("test_raising_load", xfail=XFail("upstream defect X")))
    assert r.status == "failed" and any("errored" in n for n in r.notes)
    xpass = run_case(_spec("mcore_dist", src="tp1", dst="tp1", xfail=XFail("upstream defect X")))
    assert xpass.status == "failed" and "XPASS(strict)" in xpass.error


def test_cp_logits_are_reported_not_run_with_reason():
    r = run_case(_spec(src="cp2", dst="tp2", model="gpt-tied"))
    assert r.status == "passed", r.failure_text()
    assert r.check("logits").status == "not-run" and "Transformer-Engine" in r.check("logits").detail


def test_cli_writes_results_and_exit_codes(tmp_path, capsys):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        "name: t\nentries:\n"
        "  - {case: reshard-weights, models: [gpt-gqa], backends: [mcore_dist, test_corrupt_load], pairs: ['tp2 -> tp1']}\n"
    )
    assert main(["run", str(matrix), "--report", str(tmp_path / "rep"), "-k", "[mcore_dist-"]) == 0
    assert main(["run", str(matrix), "--report", str(tmp_path / "rep")]) == 1
    doc = json.loads((tmp_path / "rep" / "results.json").read_text())
    by_backend = {r["backend"]: r for r in doc["results"]}
    bad = by_backend["test_corrupt_load"]
    assert bad["status"] == "failed" and bad["source"] == "tp2pp1dp1cp1" and bad["target"] == "tp1pp1dp1cp1"
    (loaded,) = [c for c in bad["checks"] if c["name"] == "loaded-canonical"]
    assert loaded["mismatches"] and loaded["mismatches"][0]["key"] and loaded["mismatches"][0]["max_abs_diff"] > 0
    assert "mismatches" not in bad  # written once, under the check that found them
    assert by_backend["mcore_dist"]["status"] == "passed" and by_backend["mcore_dist"]["phases"]["save"] > 0
    assert doc["summary"] == {"passed": 1, "failed": 1, "error": 0, "xfailed": 0, "not-run": 0, "not-applicable": 0}
    assert doc["versions"]["megatron-core"] == "0.19.2"
    out = capsys.readouterr().out
    assert "1 passed" in out and "1 failed" in out
    assert main(["show", str(tmp_path / "rep" / "results.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `reshard-weights[")]
    assert sorted(r.split(" | ")[1] for r in rows) == ["failed", "passed"]
    assert any("(failed: " in r and "loaded-canonical" in r for r in rows)


def test_cli_reports_matrix_errors_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> pp3']}]")
    assert main(["run", str(bad)]) == 2
    assert "pp3" in capsys.readouterr().err


def test_memory_is_recorded_per_phase_and_rank_and_budgets_fail_with_numbers():
    from harness.core.memory import Budget

    ok = run_case(_spec(src="tp2", dst="pp2"))
    assert set(ok.memory) >= {"save", "load"} and set(ok.memory["save"]) == {"0", "1"}
    assert ok.memory["save"]["0"]["shard_bytes"] > 0 and ok.memory["save"]["0"]["samples"] >= 1
    import dataclasses

    tight = dataclasses.replace(_spec(src="tp2", dst="pp2"), budgets=(Budget("save", 0, max_peak_delta_mib=-1.0),))
    r = run_case(tight)
    assert r.status == "failed"
    (c,) = [c for c in r.checks if c.name.startswith("memory-budget")]
    assert c.status == "failed" and "MiB > budget -1.0 MiB" in c.detail


_JOBS_SCRIPT = """
import json, sys
from harness.backends import register
from harness.orchestration.runner import run_cases
from harness.core.spec import CaseSpec
register("test_corrupt_load", "doubles:CorruptAfterLoad")
from harness.core.topology import Topology
specs = [CaseSpec("reshard-weights", "gpt-gqa", b, Topology.parse(s), Topology.parse(d), timeout_s=120)
         for b, s, d in (("mcore_dist", "tp1", "tp2"), ("test_corrupt_load", "tp2", "tp1"), ("mcore_dist", "pp2", "tp1"))]
seen = []
results = run_cases(specs, jobs=2, on_result=lambda r: seen.append(r.id))
print(json.dumps({"specs": [s.id for s in specs], "ids": [r.id for r in results], "seen": seen,
                  "status": [r.status for r in results], "failed": [c.name for c in results[1].checks if c.status == "failed"]}))
"""


def test_jobs_fork_warm_workers_from_a_single_threaded_caller_and_keep_matrix_order():
    # the CLI's situation (one thread: fork), in a subprocess because pytest-xdist's worker has threads
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _JOBS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == got["specs"] and sorted(got["seen"]) == sorted(got["specs"])
    assert got["status"] == ["passed", "failed", "passed"]
    assert "loaded-canonical" in got["failed"]  # the double reaches the ranks of a worker


def test_jobs_from_a_threaded_caller_use_forkserver_workers():
    import threading

    from harness.orchestration.runner import run_cases

    assert threading.active_count() >= 1
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()  # this process now has a second thread: the workers must not be forked from it
    try:
        specs = [_spec(src="tp1", dst="tp2"), _spec(src="tp2", dst="tp1")]
        results = run_cases(specs, jobs=2)
    finally:
        stop.set()
    assert [r.id for r in results] == [s.id for s in specs]
    assert [r.status for r in results] == ["passed", "passed"], [r.failure_text() for r in results]


def test_jobs_refuse_nccl_and_torchrun_with_a_clear_error(capsys):

    from harness.orchestration.runner import RunOptions, run_cases

    for opts in (RunOptions(dist_backend="nccl"), RunOptions(launcher="torchrun")):
        with pytest.raises(ValueError, match="gloo worlds from the mp launcher only"):
            run_cases([_spec(), _spec(src="tp1", dst="tp2")], opts, jobs=2)
    assert main(["run", "matrices/smoke.yaml", "-k", "reshard-weights", "-j", "0"]) == 2


_PRELOAD_FAILS_SCRIPT = """
import json
from harness.run import preload
real = preload.warm
def warm(bridge=False, modules=()):
    if bridge:  # what a release set whose Bridge stack does not import does (datasets vs pyarrow, say)
        raise AttributeError("module 'pyarrow' has no attribute 'PyExtensionType'")
    return real(False, modules)
preload.warm = warm
from harness.orchestration.runner import run_cases
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
specs = [CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology.parse("tp1"), Topology.parse("tp2"), timeout_s=120),
         CaseSpec("hf-roundtrip", "hf-llama", "bridge_hf", Topology.parse("tp1"), Topology.parse("tp1"), timeout_s=120)]
results = run_cases(specs, jobs=2)
print(json.dumps({"status": [r.status for r in results], "error": results[1].error or ""}))
"""


def test_a_preload_that_fails_ends_only_the_cases_that_need_it():
    """One package that fails to import never sinks the run (issue 18): with --jobs the parent's
    Bridge preload fails, the GPT case still passes and the HF case is an error naming why."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PRELOAD_FAILS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == ["passed", "error"] and "PyExtensionType" in got["error"]
    assert "preloading failed" in out.stderr
