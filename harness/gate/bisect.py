"""`ckpt-harness bisect`: the first commit of a Megatron-Bridge or Megatron-LM clone where the chosen
cases' outcome changes, through `git bisect run` with the harness as the test command.

    ckpt-harness bisect --repo ./Megatron-Bridge --good v0.5.1 --bad v0.6.0 -k "peft-export" --out DIR

The user's clone is never touched: the bisect runs in a throw-away `git worktree` under DIR (its
HEAD, branch and bisect state stay as they were; the worktree and the bisect are removed at the
end, whatever happens). Each step builds or reuses the env of the pins plus the worktree as a source
tree (harness.gate.envspec: the commit keys the venv), runs the matrix with `-k` there, and
compares the outcome signature (case id -> status) with GOOD's: the same -> good (exit 0),
different -> bad (1), an env that does not build or import, or a run without results -> skip
(125, so git moves on). DIR/bisect.json and DIR/bisect.md record every step and the verdict.
`--step-command CMD` replaces the harness step (exit 0 good, 1 bad, 125 skip), which is how the
tests drive git's machinery on a made-up repo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_FOUND, EXIT_CANNOT_RUN, EXIT_NOTHING_FLIPPED = 0, 2, 3
EXIT_STEP_SKIP = 125  # git bisect run: this commit cannot be tested
ROOT = Path(__file__).resolve().parents[2]  # the harness checkout the step imports from
_FIRST_BAD = re.compile(r"^([0-9a-f]{7,40}) is the first bad commit", re.M)
_ONLY_SKIPPED = "There are only 'skip'ped commits left to test."
_STEP = re.compile(r"^running (.*)$", re.M)


class BisectError(Exception):
    """The bisect could not run (not a git repo, an unknown revision); the message names it."""


@dataclass
class BisectResult:
    good: str
    bad: str
    first_bad: str | None = None  # sha
    subject: str = ""
    candidates: list[str] = field(default_factory=list)  # when only skipped commits are left
    steps: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""

    def markdown(self) -> str:
        lines = [f"# ckpt-harness bisect: {self.good}..{self.bad}", ""]
        if self.first_bad:
            lines += [f"**First commit where the outcome changes: `{self.first_bad}`** {self.subject}", ""]
        elif self.candidates:
            lines += ["**Not pinned down: only commits that could not be built or imported are left.** The first "
                      "change is one of:", "", *[f"- `{c}`" for c in self.candidates], ""]
        lines += ["| commit | step exit | meaning |", "|---|---:|---|"]
        meaning = {0: "good (same outcomes as GOOD)", 1: "bad (outcomes changed)", 125: "skipped (no env or no results)"}
        lines += [f"| `{s['commit']}` | {s['exit']} | {meaning.get(s['exit'], '?')} |" for s in self.steps]
        return "\n".join(lines) + "\n"


def _git(repo: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise BisectError(f"git {' '.join(args)} in {repo}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r.stdout


def _resolve(repo: Path, rev: str) -> str:
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()
    except BisectError:
        raise BisectError(f"{rev!r} is not a commit of {repo}") from None


def _step_log(worktree: Path, out: Path) -> list[dict[str, Any]]:
    """Every step git ran: `git bisect log` lists good/bad/skip per commit."""
    steps = []
    for line in _git(worktree, "bisect", "log", check=False).splitlines():
        m = re.match(r"^git bisect (good|bad|skip) ([0-9a-f]+)", line)
        if m:
            steps.append({"commit": m.group(2)[:12], "exit": {"good": 0, "bad": 1, "skip": 125}[m.group(1)]})
    return steps


def bisect(repo: Path, good: str, bad: str, step_command: list[str], out: Path,
           extra_env: dict[str, str] | None = None) -> BisectResult:
    """`git bisect run STEP` between GOOD and BAD in a worktree of `repo` under `out`; STEP runs with
    the worktree as its cwd, CKPT_BISECT_TREE naming it, and `extra_env` on top of this process's."""
    repo = repo.resolve()
    if not (repo / ".git").exists() and _git(repo, "rev-parse", "--git-dir", check=False) == "":
        raise BisectError(f"{repo} is not a git repository")
    good_sha, bad_sha = _resolve(repo, good), _resolve(repo, bad)
    out.mkdir(parents=True, exist_ok=True)
    tree = out / "worktree"
    _git(repo, "worktree", "add", "--detach", str(tree), bad_sha)
    result = BisectResult(good, bad)
    env = {**os.environ, **(extra_env or {}), "CKPT_BISECT_TREE": str(tree)}
    try:
        # BAD first: when it behaves as GOOD there is nothing to look for (git would blame GOOD's child)
        at_bad = subprocess.run(step_command, cwd=tree, env=env, capture_output=True, text=True, check=False).returncode
        result.steps.append({"commit": bad_sha[:12], "exit": at_bad})
        if at_bad == 0:
            result.log = f"the step passes at BAD ({bad}): nothing flipped"
            return _written(result, out)
        _git(tree, "bisect", "start", bad_sha, good_sha)
        r = subprocess.run(["git", "-C", str(tree), "bisect", "run", *step_command], capture_output=True, text=True,
                           env=env, check=False)
        result.log = r.stdout + r.stderr
        result.steps += _step_log(tree, out)
        if m := _FIRST_BAD.search(result.log):
            result.first_bad = m.group(1)
            result.subject = _git(repo, "log", "-1", "--format=%s", result.first_bad).strip()
        elif _ONLY_SKIPPED in result.log:
            result.candidates = re.findall(r"^([0-9a-f]{40})$", result.log.split(_ONLY_SKIPPED, 1)[1], re.M)
        elif r.returncode != 0:
            raise BisectError(f"git bisect run failed (exit {r.returncode}): {result.log.strip()[-400:]}")
    finally:
        _git(tree, "bisect", "reset", check=False)
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
    return _written(result, out)


def _written(result: BisectResult, out: Path) -> BisectResult:
    (out / "bisect.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    (out / "bisect.md").write_text(result.markdown())
    return result


# ----------------------------------------------------------------------------- the harness step


def signature(results_json: Path) -> dict[str, str]:
    doc = json.loads(results_json.read_text())
    return {r["id"]: r["status"] for r in doc.get("results") or []}


def step(tree: Path, matrix: str, k: str | None, cache: Path, report: Path, exact: bool = False) -> dict[str, str] | None:
    """The outcome signature at the tree's current commit, or None when it cannot be evaluated
    (the env does not build or megatron-core does not import, the run wrote no results, or a case is
    not-applicable: the commit needs an API the released companions lack, e.g. a Bridge commit of
    main that called a Megatron-LM development API its paired Core release does not have).
    The env is the pins plus the tree and, unless `exact`, the release set the tree declares (its
    pyproject's ranges, the Core line of its version): a Bridge commit of the 0.3 era beside Core 0.19
    and transformers 5 says nothing about that commit."""
    from harness.gate import envspec

    try:
        venv = envspec.ensure([str(tree)], cache, ROOT, companions=not exact)
        envspec.check_import(venv, ("megatron.core",), root=ROOT)
    except (envspec.EnvBuildError, ValueError):
        return None
    report.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "harness.cli", "run", matrix, "--report", str(report),
                    *([f"-k={k}"] if k else [])], cwd=ROOT, check=False)
    if not (report / "results.json").exists():
        return None
    sig = signature(report / "results.json")
    return None if any(s == "not-applicable" for s in sig.values()) else sig


def _step_main(args: argparse.Namespace) -> int:
    tree = Path(args.tree)
    commit = _git(tree, "rev-parse", "--short=12", "HEAD").strip()
    got = step(tree, args.matrix, args.k, Path(args.cache), Path(args.report) / commit, exact=args.exact)
    if got is None:
        return EXIT_STEP_SKIP
    if args.record:
        Path(args.record).write_text(json.dumps(got, indent=2))
        return 0
    return 0 if got == json.loads(Path(args.good_signature).read_text()) else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bisect", help="the first commit of a Bridge/Megatron-LM clone where the chosen cases' outcome changes")
    p.add_argument("--repo", type=Path, required=True, help="a local clone (never moved: the bisect runs in a worktree)")
    p.add_argument("--good", required=True, help="a commit/tag where the outcomes are the old ones")
    p.add_argument("--bad", required=True, help="a later commit/tag where they changed")
    p.add_argument("-k", default=None, help="only the cases whose id contains every word (those that flipped)")
    p.add_argument("--matrix", default="matrices/smoke.yaml")
    p.add_argument("--cache", type=Path, default=None, help="where venvs live (default: $CKPT_HARNESS_HOME or ~/.cache/ckpt-harness)")
    p.add_argument("--step-command", default=None, help="replaces the harness step: exit 0 good, 1 bad, 125 skip")
    p.add_argument("--exact", action="store_true",
                   help="each step's env is the pins plus the tree only (default: plus the release set the tree declares)")
    p.add_argument("--out", type=Path, required=True)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from harness.gate import envspec

    out = args.out.resolve()
    extra_env: dict[str, str] = {}
    try:
        if args.step_command:
            command = shlex.split(args.step_command)
        else:
            cache = (args.cache or envspec._default_cache()).resolve()
            base = [sys.executable, "-m", "harness.gate.bisect", "--tree", str(out / "worktree"), "--matrix", args.matrix,
                    "--cache", str(cache), "--report", str(out / "runs"), *([f"-k={args.k}"] if args.k else []),
                    *(["--exact"] if args.exact else [])]
            good_sig = out / "good-signature.json"
            # the outcomes at GOOD and BAD first: nothing to look for when they agree
            sigs = {}
            for name, rev in (("good", args.good), ("bad", args.bad)):
                sha = _resolve(args.repo.resolve(), rev)
                tree = out / f"{name}-tree"
                _git(args.repo.resolve(), "worktree", "add", "--detach", str(tree), sha)
                try:
                    sigs[name] = step(tree, args.matrix, args.k, cache, out / "runs" / name, exact=args.exact)
                finally:
                    _git(args.repo.resolve(), "worktree", "remove", "--force", str(tree), check=False)
                if sigs[name] is None:
                    raise BisectError(f"the {name} commit {rev} could not be evaluated (no env, no import, no results, or a case "
                                      f"not-applicable to it: see {out / 'runs' / name})")
            if sigs["good"] == sigs["bad"]:
                print(f"ckpt-harness bisect: nothing flipped between {args.good} and {args.bad} for -k {args.k!r}")
                return EXIT_NOTHING_FLIPPED
            good_sig.write_text(json.dumps(sigs["good"], indent=2))
            command = [*base, "--good-signature", str(good_sig)]
            # the step runs from the bisected clone's worktree: the harness must import from here, not from there
            extra_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        result = bisect(args.repo, args.good, args.bad, command, out, extra_env)
    except BisectError as exc:
        print(f"ckpt-harness bisect: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if result.first_bad is None and not result.candidates:
        print(f"ckpt-harness bisect: nothing flipped between {args.good} and {args.bad}")
        return EXIT_NOTHING_FLIPPED
    print(result.markdown())
    return EXIT_FOUND


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.gate.bisect --tree T ...`: one step of `git bisect run`."""
    p = argparse.ArgumentParser(prog="harness.gate.bisect")
    p.add_argument("--tree", required=True)
    p.add_argument("--matrix", required=True)
    p.add_argument("-k", default=None)
    p.add_argument("--cache", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--good-signature", default=None)
    p.add_argument("--record", default=None, help="write this commit's signature here and exit 0")
    p.add_argument("--exact", action="store_true")
    args = p.parse_args(argv)
    try:
        return _step_main(args)
    except Exception:  # noqa: BLE001 - a harness crash at one commit says nothing of that commit: skip it
        traceback.print_exc()
        return EXIT_STEP_SKIP


if __name__ == "__main__":
    sys.exit(main())
