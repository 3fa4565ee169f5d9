"""The `gate` command's arguments (harness.cli wires it; harness.gate.bump.run_gate does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`ckpt-harness gate ...` (thresholds and the handler are added by the caller)."""
    gate = sub.add_parser("gate", help="run a candidate Megatron-Bridge/-Core against the pinned baseline: one verdict")
    gate.add_argument("matrix", type=Path, nargs="?", default=Path("matrices/gate.yaml"),
                      help="default matrices/gate.yaml: the smoke slice plus every architecture (hf-roundtrip and LoRA per family)")
    gate.add_argument("--candidate", action="append", default=[], metavar="SPEC",
                      help="an override of the pins: 'megatron-core==0.19.0', 'megatron-bridge @ git+URL@SHA', a source tree, "
                      "a wheel, 'megatron-bridge @ file:///path/to/tree-or.whl', 'megatron-bridge @ https://.../x.whl[#sha256=HEX]'")
    gate.add_argument("--baseline", action="append", default=[], metavar="SPEC", help="overrides for the baseline (default: the pins)")
    gate.add_argument("-k", default=None, help="only matrix cases whose id contains every word of this")
    gate.add_argument("--out", type=Path, required=True, help="a new directory: baseline/, candidate/, cross/, verdict.md, gate.json")
    gate.add_argument("--cache", type=Path, default=None, help="where venvs live (default: $CKPT_HARNESS_HOME or ~/.cache/ckpt-harness)")
    gate.add_argument("--corpus", type=Path, default=None,
                      help="also have the candidate check this golden corpus (one the previous pins wrote; CI caches it)")
    gate.add_argument("--skip-cross", action="store_true", help="no cross-version corpus (matrix comparison only)")
    gate.add_argument("--no-scale", action="store_true", help="no scale axis: skip `plan` of the production shapes "
                      "(harness.gate.scale.PLANS) in each side and the diff of their checkpoint layouts")
    gate.add_argument("--jobs", "-j", type=int, default=2, metavar="N", help="cases at once in each side's matrix run "
                      "(as `run --jobs`, smoke's 2 by default; gloo only)")
    gate.add_argument("--no-reuse", action="store_true", help="each side's cases run their own source worlds (as `run --no-reuse`)")
    gate.add_argument("--exact", action="store_true", help="move only the named specs: no release-set companions "
                      "(a Bridge keeps today's Core and transformers pins)")
    gate.add_argument("--trust-pickles", action="store_true",
                      help="pass --trust-pickles to the candidate's `golden check` of --corpus (a corpus you trust: a pickle can run code)")
    gate.add_argument("--baseline-results", type=Path, default=None, metavar="DIR",
                      help="reuse this baseline run (a previous gate's DIR/baseline) instead of running the baseline "
                           "again: refused unless it is a whole run of this harness code in the baseline's environment "
                           "that ran every selected case (a run of more cases of the same matrix is cut down to them)")
    gate.add_argument("--fresh-baseline", action="store_true",
                      help="run the baseline even when a cached run of it exists (the cache, under --cache's baselines/, is keyed "
                           "by the baseline env, the harness code digest and the selection; a matching entry is reused by default)")
    gate.add_argument("--no-rerun", action="store_true",
                      help="report a regressed case from its first run alone (default: each runs again on both sides, "
                           "and one that does not reproduce is `flaky`, never a regression, never evidence)")
    gate.add_argument("--concurrent", action=argparse.BooleanOptionalAction, default=None,
                      help="run the baseline and candidate matrix runs at once (default: only on a machine with 4 or more cores)")
    return gate
