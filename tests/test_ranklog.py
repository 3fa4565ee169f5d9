"""A quiet console: rank and case output goes to log files, the console shows progress and the
summary (naming a failing case's logs), and `-v` brings the output back (harness.run.ranklog)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from doubles import CHATTER
from harness.cli import main
from harness.run.preload import warm
from harness.run.ranklog import PARENT_LOG, VERBOSE_ENV, LogFiles, captured
from harness.run.world import WorldError, launch

warm()  # as the runner does: ranks fork from a parent that already imported megatron-core

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _not_verbose(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)  # and restored after a test that sets it (`run -v`)


def _rank(ctx, _):
    return ctx.rank


def test_a_world_s_rank_output_goes_to_its_log_files_not_the_console(tmp_path, capfd):
    logs = LogFiles(str(tmp_path / "logs"), "save", kept=True)
    assert launch(_rank, None, 2, tmp_path / "w", hooks=("doubles:chatter",), logs=logs, timeout_s=120) == [0, 1]
    out, err = capfd.readouterr()
    assert CHATTER not in out + err
    for r in (0, 1):  # kept after a good world, Python's and C's output alike
        text = logs.rank(r).read_text()
        assert f"{CHATTER} a rank's print" in text and f"{CHATTER} a rank's fd 2" in text, text


def test_verbose_keeps_rank_output_on_the_console(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    logs = LogFiles(str(tmp_path / "logs"), "save", kept=True)
    launch(_rank, None, 2, tmp_path / "w", hooks=("doubles:chatter",), logs=logs, timeout_s=120)
    out, err = capfd.readouterr()
    assert out.count(f"{CHATTER} a rank's print") == 2 and err.count(f"{CHATTER} a rank's fd 2") == 2
    assert not logs.rank(0).exists()


def test_a_failing_rank_s_traceback_reaches_the_error_and_its_output_the_log(tmp_path, capfd):
    logs = LogFiles(str(tmp_path / "logs"), "load", kept=True)
    with pytest.raises(WorldError, match="a rank hook failed on purpose") as err:
        launch(_rank, None, 2, tmp_path / "w", hooks=("doubles:chatter_then_fail",), logs=logs, timeout_s=120)
    assert "RuntimeError" in (err.value.rank_traceback or "")
    out, errs = capfd.readouterr()
    assert CHATTER not in out + errs
    assert f"{CHATTER} a rank's print" in logs.rank(err.value.rank).read_text()


def test_the_parent_s_output_while_captured_goes_to_the_file_and_comes_back_after(tmp_path, capfd):
    log = tmp_path / "case" / PARENT_LOG
    with captured(log):
        print("python print")
        sys.stderr.write("python stderr\n")
        os.write(1, b"fd 1\n")
        os.write(2, b"fd 2\n")
        subprocess.run(["echo", "a child's output"], check=True)  # what a started process inherits
    print("after")
    out, err = capfd.readouterr()
    assert (out, err) == ("after\n", "")
    text = log.read_text()
    assert all(s in text for s in ("python print", "python stderr", "fd 1", "fd 2", "a child's output")), text


MATRIX = "name: q\nentries:\n  - {case: reshard-weights, models: [gpt-gqa], backends: [test_chatty, test_corrupt], pairs: ['tp2 -> tp1']}\n"


def _matrix(tmp_path) -> Path:
    path = tmp_path / "q.yaml"
    path.write_text(MATRIX)
    return path


@pytest.fixture
def chatty_backends():
    from harness import backends

    backends.register("test_chatty", "doubles:ChattyJudge")
    backends.register("test_corrupt", "doubles:CorruptAfterLoad")
    yield
    backends.unregister("test_chatty")
    backends.unregister("test_corrupt")


def test_run_shows_progress_and_summary_only_and_names_a_failing_case_s_logs(tmp_path, capfd, chatty_backends):
    rep = tmp_path / "rep"
    assert main(["run", str(_matrix(tmp_path)), "--report", str(rep), "--rank-hook", "doubles:chatter"]) == 1
    out, err = capfd.readouterr()
    assert CHATTER not in out + err, out + err
    doc = {r["backend"]: r for r in json.loads((rep / "results.json").read_text())["results"]}
    bad, good = doc["test_corrupt"], doc["test_chatty"]
    assert bad["status"] == "failed" and good["status"] == "passed"
    case_dir = rep / "logs" / Path(bad["logs"][0]).parent.name
    assert {Path(p).name for p in bad["logs"]} >= {"save-rank0.log", "save-rank1.log", "load-rank0.log"}
    assert f"logs in {case_dir}: " in out and "save-rank0.log" in out  # the failure's summary names them
    assert f"{CHATTER} a rank's print" in (case_dir / "save-rank1.log").read_text()
    parent = Path(next(p for p in good["logs"] if p.endswith(PARENT_LOG))).read_text()
    assert f"{CHATTER} the parent's print" in parent  # the in-process check's print, between progress lines before
    assert f"logs: {rep / 'logs'}" in out

    assert main(["run", str(_matrix(tmp_path)), "-k", "test_chatty", "-v", "--rank-hook", "doubles:chatter"]) == 0
    out, err = capfd.readouterr()
    assert f"{CHATTER} a rank's print" in out and f"{CHATTER} the parent's print" in out and f"{CHATTER} a rank's fd 2" in err
    assert "logs:" not in out


_RUN_SCRIPT = """
import sys
from harness import backends
from harness.cli import main
backends.register("test_chatty", "doubles:ChattyJudge")
backends.register("test_corrupt", "doubles:CorruptAfterLoad")
sys.exit(main(sys.argv[1:]))
"""


def test_parallel_workers_keep_the_console_quiet_warnings_included(tmp_path):
    """The real console (a process of its own, not pytest's capture, which records warnings):
    `--jobs 2` workers, library warnings in ranks and parent, no --report (a temp dir, kept
    because a case failed)."""
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_SCRIPT, "run", str(_matrix(tmp_path)), "-j", "2", "--workdir", str(work),
         "--rank-hook", "doubles:chatter"], capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console
    assert CHATTER not in console and "[2/2]" in console, console
    (root,) = work.glob("ckpt-harness-logs-*")
    assert f"logs: {root}" in console and f"logs in {root}/reshard-weights" in console
    text = {f"{p.parent.name}/{p.name}": p.read_text() for p in root.rglob("*.log")}
    (chatty,) = [t for n, t in text.items() if "test_chatty" in n and n.endswith(PARENT_LOG)]
    assert f"{CHATTER} the parent's warning" in chatty, text.keys()
    rank_logs = [t for n, t in text.items() if "/save-rank" in n]
    assert len(rank_logs) == 4 and all(f"{CHATTER} a rank's warning" in t and f"{CHATTER} a rank's fd 2" in t for t in rank_logs)


def test_the_pytest_plugin_names_a_failing_case_s_logs_under_its_report(pytester):
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "x.yaml").write_text(textwrap.dedent(
        "name: x\nentries:\n  - {case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> pp2']}\n"))
    result = pytester.runpytest("-p", "no:cacheprovider", "--ckpt-report", "rep", "--ckpt-rank-hook", "doubles:chatter_then_fail")
    result.assert_outcomes(failed=1)
    (case_dir,) = (pytester.path / "rep" / "logs").iterdir()
    result.stdout.fnmatch_lines([f"*logs in {case_dir}: *save-rank0.log*"])
    assert f"{CHATTER} a rank's print" in (case_dir / "save-rank0.log").read_text()


@pytest.mark.slow  # torchrun starts fresh interpreters: ~60 s per world on 2 cores
def test_torchrun_ranks_write_their_own_logs_and_the_launcher_its_own(tmp_path):
    from harness.run.probes import allreduce_ranks
    from harness.run.world import launch_torchrun

    logs = LogFiles(str(tmp_path / "logs"), "save", kept=True)
    out = launch_torchrun(allreduce_ranks, 1.0, 2, tmp_path / "w", timeout_s=300, hooks=("doubles:chatter",), logs=logs)
    assert [o["rank"] for o in out] == [0, 1]
    for r in (0, 1):
        assert f"{CHATTER} a rank's fd 2" in logs.rank(r).read_text()
    assert not logs.launcher().exists() or CHATTER not in logs.launcher().read_text()


def test_run_v_leaves_the_environment_as_it_found_it(monkeypatch):
    """`run -v` in-process (a test, an embedding program) must not turn every later run verbose: a
    leaked CKPT_HARNESS_VERBOSE once sent every later world of a pytest worker to the terminal."""
    from harness.cli import main

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert main(["run", "matrices/smoke.yaml", "-k", "no-such-case-anywhere", "-v"]) == 4
    assert VERBOSE_ENV not in os.environ
    monkeypatch.setenv(VERBOSE_ENV, "0")
    assert main(["run", "matrices/smoke.yaml", "-k", "no-such-case-anywhere", "-v"]) == 4
    assert os.environ[VERBOSE_ENV] == "0"
