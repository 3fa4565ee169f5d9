"""`ckpt-harness inspect` and `ckpt-harness check-load`: their arguments and runs (harness/cli.py
only registers them). Exit codes as the rest of the CLI: 0 clean / loads, 1 an integrity finding /
the load would fail, 2 bad input (not a checkpoint, an untrusted pickle without the flag, a model or
topology that cannot be built)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.inspect import report
from harness.inspect.check_load import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK
from harness.inspect.part import InspectInputError

_UNPICKLE_HELP = ("unpickle in full what the safe readers refuse (a common state holding classes outside "
                  "weights_only's allowlist; a .metadata naming foreign globals); only for a checkpoint you trust: "
                  "a pickle can run code (--trust-pickles is the same flag)")


def add_parsers(sub) -> None:
    p = sub.add_parser("inspect", help="what a checkpoint directory is and whether its files are whole (metadata only)")
    p.add_argument("dir", type=Path, help="a checkpoint directory (or a corpus / training dir holding several)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.add_argument("--allow-unpickle", "--trust-pickles", dest="allow_unpickle", action="store_true", help=_UNPICKLE_HELP)
    p.set_defaults(func=run_inspect)
    c = sub.add_parser("check-load", help="would a load at a target topology find every key the checkpoint must hold "
                                          "(target built on meta under a fake process group: no GPU, no tensor read)")
    c.add_argument("dir", type=Path, help="a checkpoint directory (or a corpus / training dir holding several)")
    c.add_argument("--to", required=True, help="the target topology, as case ids write it: tp4pp2dp2, tp1pp1dp2ep2")
    c.add_argument("--model", default=None, help="the model, when the checkpoint records none (or to override it): a plan "
                                                 "preset, an HF config.json, or a harness zoo model name")
    c.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    c.add_argument("--allow-unpickle", "--trust-pickles", dest="allow_unpickle", action="store_true", help=_UNPICKLE_HELP)
    c.set_defaults(func=run_check_load)


def run_inspect(args: argparse.Namespace) -> int:
    from harness.inspect.detect import inspect

    try:
        ins = inspect(args.dir, args.allow_unpickle)
    except InspectInputError as e:
        print(f"ckpt-harness inspect: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    doc = ins.to_json()
    print(json.dumps(doc, indent=1, default=str) if args.json else report.inspection(ins), end="" if not args.json else "\n")
    return EXIT_FAIL if ins.all_findings else EXIT_OK


def run_check_load(args: argparse.Namespace) -> int:
    from harness.compat.cuda import guard_megatron_import
    from harness.inspect.check_load import check_load

    guard_megatron_import()
    try:
        result = check_load(args.dir, args.to, args.model, args.allow_unpickle)
    except InspectInputError as e:
        print(f"ckpt-harness check-load: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result, indent=1, default=str) if args.json else report.check(result), end="" if not args.json else "\n")
    return result["exit_code"]
