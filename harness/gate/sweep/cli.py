"""`ckpt-harness sweep`: the parser (`add_parser`) and its run (`run_cli`) over a driver that builds
each release's environment and runs the matrix there (harness/gate/sweep/driver.py), or over
existing results.json files (--from-results, nothing built)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Callable

from harness.gate.sweep.arch_axis import axis as arch_axis
from harness.gate.sweep.render import load_results, write
from harness.gate.sweep.spec import SweepSpecError, parse_releases, release_label
from harness.gate.sweep.table import (
    NOT_WRITTEN,
    SweepInputError,
    _first_line,
    cross_pairs,
    cross_table,
    sweep_table,
)

# ----------------------------------------------------------------------------- CLI

#: driver(release_specs, matrix, k, out_dir) -> path of the results.json of that release's run
Driver = Callable[[list[str], Path | None, str | None, Path], Path]
#: cross_driver(writer_specs, reader_specs, rollback, out_dir) -> results.json of the reader's golden check
CrossDriver = Callable[[list[str], list[str], bool, Path], Path]


def _labelled(value: str) -> tuple[str, Path]:
    """LABEL=PATH. Both may hold '=' (the label megatron-bridge==0.5.0, a sweep's own run directory
    r01-megatron-bridge==0.5.0/): the PATH is what follows the first '=' after which an existing path
    follows, else what follows the last '=' (the load then names the missing file)."""
    cuts = [i for i, c in enumerate(value) if c == "="]
    at = next((i for i in cuts if value[i + 1:].strip() and Path(value[i + 1:].strip()).exists()), cuts[-1] if cuts else -1)
    label, sep, path = (value[:at], "=", value[at + 1:]) if at >= 0 else (value, "", "")
    if not sep or not label.strip() or not path.strip():
        raise SweepSpecError(f"--from-results: {value!r} is not LABEL=PATH")
    return label.strip(), Path(path.strip())


def _cross_labelled(value: str) -> tuple[str, str, Path]:
    """WRITER>READER=PATH (the reader's golden-check results.json of the writer's corpus)."""
    pair, path = _labelled(value)
    writer, sep, reader = pair.partition(">")
    if not sep or not writer.strip() or not reader.strip():
        raise SweepSpecError(f"--from-cross: {value!r} is not WRITER>READER=PATH")
    return writer.strip(), reader.strip(), path


def add_parser(subparsers: Any, driver: Driver | None = None, cross_driver: CrossDriver | None = None) -> argparse.ArgumentParser:
    """`ckpt-harness sweep`; with a driver, the parser's func runs it (cli.main calls args.func(args))."""
    p = subparsers.add_parser("sweep", help="run one matrix over a list of releases: a version x case table of where outcomes change")
    p.add_argument("matrix", type=Path, nargs="?", default=Path("matrices/gate.yaml"),
                   help="default matrices/gate.yaml: the smoke slice plus every architecture")
    p.add_argument("--releases", default=None, metavar="SPEC,SPEC,...",
                   help="release sets, oldest first: 'megatron-bridge==0.4.2,0.5.0' (a bare version continues the previous "
                        "package), 'megatron-bridge==0.5.1+megatron-core==0.18.2' (one set of two packages)")
    p.add_argument("-k", default=None, help="only matrix cases whose id contains every word of this")
    p.add_argument("--cross", action="store_true",
                   help="each release's golden corpus is read by the newest, and the newest's by each older one (rollback)")
    p.add_argument("--out", type=Path, required=True, help="DIR/sweep.md, sweep.html, sweep.json, and one run dir per release")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N", help="cases at once in each release's matrix run (gloo only)")
    p.add_argument("--cache", type=Path, default=None, help="where venvs live (default: $CKPT_HARNESS_HOME or ~/.cache/ckpt-harness)")
    p.add_argument("--from-results", nargs="+", default=None, metavar="LABEL=PATH",
                   help="tabulate existing results.json files (or report dirs), oldest first, running nothing")
    p.add_argument("--from-cross", nargs="+", default=None, metavar="WRITER>READER=PATH",
                   help="with --from-results: golden-check results of WRITER's corpus read by READER")
    if driver is not None:
        p.set_defaults(func=lambda args: run_cli(args, driver, cross_driver))
    return p


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", label)[:80]


def run_cli(args: argparse.Namespace, driver: Driver | None = None, cross_driver: CrossDriver | None = None) -> int:
    """Exit 0: the table is written; 2: bad input, or no release could be run. A release whose run
    the driver could not make (it raised) stays in the table as a hole with the driver's message."""
    import sys

    def fail(msg: str) -> int:
        print(f"ckpt-harness sweep: {msg}", file=sys.stderr)
        return 2

    try:
        if args.from_results:
            if args.releases:
                return fail("give --releases or --from-results, not both")
            pairs = [_labelled(v) for v in args.from_results]
            runs = [(label, load_results(path)) for label, path in pairs]
            cross = None
            if getattr(args, "from_cross", None):
                checks = [(w, r, load_results(p)) for w, r, p in map(_cross_labelled, args.from_cross)]
                cross = cross_table(checks, [label for label, _ in runs])
            elif args.cross:
                return fail("--cross with --from-results needs --from-cross WRITER>READER=PATH ...")
        else:
            if not args.releases:
                return fail("give --releases SPEC,SPEC,... or --from-results LABEL=PATH ...")
            sets = parse_releases(args.releases)
            if driver is None:
                return fail("no driver to build release environments (cli.py wires harness.gate's)")
            if args.cross and cross_driver is None:
                return fail("--cross: no cross driver wired")
            runs, by_label = [], {}
            for i, specs in enumerate(sets, 1):
                label = release_label(specs)
                by_label[label] = specs
                print(f"[{i}/{len(sets)}] {label}", flush=True)
                try:
                    path = driver(specs, args.matrix, args.k, args.out / f"r{i:02d}-{_slug(label)}")
                    runs.append((label, load_results(Path(path))))
                except Exception as exc:  # one release that cannot be built must not lose the sweep
                    runs.append((label, {"sweep_error": f"{type(exc).__name__}: {exc}", "results": []}))
                    print(f"  could not run {label}: {_first_line(str(exc))}", file=sys.stderr)
            if all(doc.get("sweep_error") for _, doc in runs):
                return fail("no release could be run:\n" + "\n".join(f"{lb}: {d['sweep_error']}" for lb, d in runs))
            cross = None
            if args.cross and len(sets) > 1:
                checks = []
                for w, r, rollback in cross_pairs([lb for lb, _ in runs]):
                    d = args.out / "cross" / f"{_slug(w)}--to--{_slug(r)}"
                    try:
                        checks.append((w, r, load_results(Path(cross_driver(by_label[w], by_label[r], rollback, d)))))
                    except Exception as exc:
                        checks.append((w, r, {"results": [{"id": "golden[corpus]", "status": "error",
                                                           "error": f"{NOT_WRITTEN} or not checked: {type(exc).__name__}: {exc}"}]}))
                cross = cross_table(checks, [lb for lb, _ in runs])
        table = sweep_table(runs, cross)
        table.archs = arch_axis(runs)  # architecture x release, from each run's Bridge registry
    except (SweepSpecError, SweepInputError) as exc:
        return fail(str(exc))
    paths = write(table, args.out)
    print(f"sweep: {len(table.releases)} release(s), {len(table.cases)} case(s), {len(table.changed)} changed; "
          + ", ".join(str(p) for p in paths.values()))
    return 0
