"""Save once, load many, measured: a matrix run with and without the run's source store.

`python -m benchmarks.reuse [MATRIX] [--jobs 2] [-k WORDS] [--out DIR]` runs the matrix twice
(`ckpt-harness run`, each in its own process, the default run first, then `--no-reuse`) and prints
one Markdown table: cases, wall, seconds a case, the sum of the cases' own time and of their save,
load and compare phases, and the summary's reuse line. Issue 20's goal for the smoke matrix on the
project's 2-core machine (>= 250 cases, <= 5 min, <= 1.2 s a case) is a number here and in
docs/measurements.md, never a test assertion.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.report.results import reuse_line

PHASES = ("save", "load", "compare")


def run(matrix: Path, out: Path, jobs: int, k: str | None, reuse: bool) -> dict:
    """One `ckpt-harness run` into `out`; its results.json with the wall the command took."""
    cmd = [sys.executable, "-m", "harness.cli", "run", str(matrix), "--report", str(out), "--jobs", str(jobs)]
    cmd += (["-k", k] if k else []) + ([] if reuse else ["--no-reuse"])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1) or not (out / "results.json").is_file():
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    doc = json.loads((out / "results.json").read_text())
    doc["command_s"] = time.perf_counter() - start
    return doc


def row(name: str, doc: dict) -> str:
    results = doc["results"]
    n, wall = len(results), doc["wall_s"]
    phase = {p: sum(r["phases"].get(p, 0.0) for r in results) for p in ("total", *PHASES)}
    return (f"| {name} | {n} | {wall:.1f} | {wall / max(n, 1):.2f} | {phase['total']:.1f} | "
            + " | ".join(f"{phase[p]:.1f}" for p in PHASES) + " | " + ", ".join(f"{v} {k}" for k, v in doc["summary"].items() if v) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reuse", description=__doc__.splitlines()[0])
    p.add_argument("matrix", type=Path, nargs="?", default=Path("matrices/smoke.yaml"))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("-k", default=None)
    p.add_argument("--out", type=Path, default=None, help="keep both reports here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ckpt-harness-bench-reuse-") as tmp:
        root = args.out or Path(tmp)
        docs = {name: run(args.matrix, root / name, args.jobs, args.k, reuse) for name, reuse in (("reuse", True), ("no-reuse", False))}
    print(f"{args.matrix}, --jobs {args.jobs}" + (f", -k {args.k!r}" if args.k else ""))
    print("| run | cases | wall s | s a case | case time s | " + " | ".join(f"{p} s" for p in PHASES) + " | outcome |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(PHASES) + "---|")
    for name, doc in docs.items():
        print(row(name, doc))
    print(reuse_line(r.get("reuse", []) for r in docs["reuse"]["results"]) or "no case used the source store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
