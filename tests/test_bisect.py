"""`ckpt-harness bisect` drives `git bisect run` on a made-up repo: 10 commits, the outcome flips at
commit 6, commit 3 cannot be built (the step says 125). The user's checkout is never moved."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.cli import main
from harness.gate.bisect import (
    EXIT_CANNOT_RUN,
    EXIT_FOUND,
    EXIT_NOTHING_FLIPPED,
    BisectError,
    bisect,
)

STEP = """#!/bin/sh
# exit 125: this commit cannot be built; 1: the outcome changed; 0: as at GOOD
grep -q unbuildable state && exit 125
grep -q bad state && exit 1
exit 0
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path):
    """Commits c1..c10; `state` is 'good' before c6 and 'bad' from c6 on; c3 (and with
    flip_unbuildable, c6 too) says 'unbuildable'."""
    def make(flip_unbuildable: bool = False) -> tuple[Path, dict[int, str]]:
        r = tmp_path / "clone"
        r.mkdir()
        git(r, "init", "-q", "-b", "main")
        git(r, "config", "user.email", "t@t")
        git(r, "config", "user.name", "t")
        shas = {}
        for i in range(1, 11):
            state = "bad" if i >= 6 else "good"
            if i == 3 or (flip_unbuildable and i == 6):
                state = "unbuildable " + state
            (r / "state").write_text(f"{state}\nc{i}\n")
            git(r, "add", "state")
            git(r, "commit", "-q", "-m", f"c{i}")
            shas[i] = git(r, "rev-parse", "HEAD")
        return r, shas

    return make


def step_script(tmp_path: Path) -> str:
    s = tmp_path / "step.sh"
    s.write_text(STEP)
    s.chmod(0o755)
    return str(s)


def test_the_first_bad_commit_is_named_and_the_users_checkout_is_untouched(repo, tmp_path):
    r, shas = repo()
    head, branch = git(r, "rev-parse", "HEAD"), git(r, "rev-parse", "--abbrev-ref", "HEAD")
    result = bisect(r, shas[1], shas[10], [step_script(tmp_path)], tmp_path / "out")
    assert result.first_bad == shas[6] and result.subject == "c6"
    assert git(r, "rev-parse", "HEAD") == head and git(r, "rev-parse", "--abbrev-ref", "HEAD") == branch
    assert subprocess.run(["git", "-C", str(r), "bisect", "log"], capture_output=True).returncode != 0  # no bisect left
    assert git(r, "worktree", "list").count("\n") == 0  # the throw-away worktree is gone
    assert (tmp_path / "out" / "bisect.json").exists() and shas[6] in (tmp_path / "out" / "bisect.md").read_text()
    exits = {s["exit"] for s in result.steps}
    assert exits <= {0, 1, 125} and 1 in exits


def test_an_unbuildable_commit_is_skipped_and_when_only_skips_are_left_the_candidates_are_named(repo, tmp_path):
    r, shas = repo(flip_unbuildable=True)  # c6, where it flips, cannot be built
    result = bisect(r, shas[1], shas[10], [step_script(tmp_path)], tmp_path / "out")
    assert result.first_bad is None
    assert shas[6] in result.candidates and shas[7] in result.candidates
    assert any(s["exit"] == 125 for s in result.steps)


def test_cli_exit_codes(repo, tmp_path, capsys):
    r, shas = repo()
    step = step_script(tmp_path)
    assert main(["bisect", "--repo", str(r), "--good", shas[1], "--bad", shas[10], "--step-command", step,
                 "--out", str(tmp_path / "a")]) == EXIT_FOUND
    assert shas[6] in capsys.readouterr().out
    assert main(["bisect", "--repo", str(r), "--good", shas[1], "--bad", "no-such-rev", "--step-command", step,
                 "--out", str(tmp_path / "b")]) == EXIT_CANNOT_RUN
    assert "no-such-rev" in capsys.readouterr().err
    assert main(["bisect", "--repo", str(r), "--good", shas[1], "--bad", shas[5], "--step-command", step,
                 "--out", str(tmp_path / "c")]) == EXIT_NOTHING_FLIPPED  # c1..c5 behave the same


def test_not_a_repository_is_refused(tmp_path):
    with pytest.raises(BisectError):
        bisect(tmp_path, "HEAD~1", "HEAD", ["true"], tmp_path / "out")


def test_a_step_that_crashes_skips_the_commit_rather_than_calling_it_bad(tmp_path, capsys):
    """A harness crash at one commit (here: the tree is not a checkout) says nothing about that
    commit: git bisect run must hear 125, not 1."""
    from harness.gate.bisect import EXIT_STEP_SKIP
    from harness.gate.bisect import main as step_main

    assert step_main(["--tree", str(tmp_path / "gone"), "--matrix", "matrices/smoke.yaml", "--cache", str(tmp_path),
                      "--report", str(tmp_path / "runs")]) == EXIT_STEP_SKIP
    assert "Traceback" in capsys.readouterr().err


def test_the_harness_step_imports_the_harness_from_its_checkout_not_the_bisected_clone(repo, tmp_path, monkeypatch):
    """The step runs with the bisected clone's worktree as its cwd; PYTHONPATH names this checkout."""
    import harness.gate.bisect as b

    r, shas = repo()
    monkeypatch.setattr(b, "step", lambda tree, *a, **k: {"case": (tree / "state").read_text().split()[0]})
    seen = {}

    def fake_bisect(repo_, good, bad, command, out, extra_env=None):
        seen.update(command=command, env=extra_env or {})
        return b.BisectResult(good, bad, first_bad=shas[6])

    monkeypatch.setattr(b, "bisect", fake_bisect)
    assert main(["bisect", "--repo", str(r), "--good", shas[1], "--bad", shas[10], "--out", str(tmp_path / "o"),
                 "--cache", str(tmp_path / "cache")]) == EXIT_FOUND
    assert seen["command"][1:3] == ["-m", "harness.gate.bisect"]
    assert seen["env"]["PYTHONPATH"].split(":")[0] == str(b.ROOT)
    # and from an unrelated cwd, with the site-packages (and any editable install) off, it imports
    probe = subprocess.run([seen["command"][0], "-S", "-m", "harness.gate.bisect", "--help"], cwd=tmp_path,
                           env={"PYTHONPATH": seen["env"]["PYTHONPATH"]}, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr


def test_each_step_builds_the_release_set_the_tree_declares_unless_exact(tmp_path, monkeypatch):
    """A Bridge commit of the 0.3 era needs its Core line and transformers<5: by default the step's env
    takes the tree's release set (companions), --exact builds the pins plus the tree alone."""
    import harness.gate.bisect as b
    from harness.gate import envspec

    asked = []

    def fake_ensure(specs, cache, root, python=None, companions=True):
        asked.append(companions)
        raise envspec.EnvBuildError("stop here")

    monkeypatch.setattr(envspec, "ensure", fake_ensure)
    assert b.step(tmp_path, "matrices/smoke.yaml", None, tmp_path, tmp_path / "r") is None
    assert b.step(tmp_path, "matrices/smoke.yaml", None, tmp_path, tmp_path / "r", exact=True) is None
    assert asked == [True, False]


def test_a_commit_with_a_not_applicable_case_is_skipped_not_judged(tmp_path, monkeypatch):
    """A main-branch Bridge commit that calls a Megatron-LM development API its paired Core release
    lacks cannot say whether the defect is there: skip (125), never good or bad."""
    import json as _json

    import harness.gate.bisect as b
    from harness.gate import envspec

    monkeypatch.setattr(envspec, "ensure", lambda *a, **k: tmp_path / "venv")
    monkeypatch.setattr(envspec, "check_import", lambda *a, **k: None)
    status = {"s": "not-applicable"}

    def fake_run(cmd, **kw):
        report = Path(cmd[cmd.index("--report") + 1])
        (report / "results.json").write_text(_json.dumps({"results": [{"id": "c[x]", "status": status["s"]}]}))

    monkeypatch.setattr(b.subprocess, "run", fake_run)
    assert b.step(tmp_path, "m.yaml", None, tmp_path, tmp_path / "r1") is None
    status["s"] = "failed"
    assert b.step(tmp_path, "m.yaml", None, tmp_path, tmp_path / "r2") == {"c[x]": "failed"}
