"""Which target lines each case runs (harness/faults/coverage_hook.py): a real instrumented `run` of
one megatron-core case, measured in the CLI parent and in its forked ranks, read back per case; and
the selection rule over those lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.faults import coverage_hook
from harness.faults.mutants import generate, locate

ROOT = Path(__file__).resolve().parents[1]
CASE = "reshard-weights[mcore_dist-gpt-gqa-tp2pp1dp1cp1->tp1pp2dp1cp1]"
MAPPING = "megatron.core.dist_checkpointing.mapping"


@pytest.mark.slow  # 19 s: tests/test_mutate.py's campaign measures a forked rank's lines in the default tier;
# this one adds megatron-core as installed and counts the parent's and each rank's data files
def test_an_instrumented_run_names_the_case_of_each_line_its_ranks_ran(tmp_path):
    cov_dir = tmp_path / "cov"
    cov_dir.mkdir()
    mapping = str(locate(MAPPING))
    unused = str(locate("megatron.bridge.models.conversion.param_mapping"))  # an mcore case never imports it
    env = {**os.environ, coverage_hook.ENV: json.dumps({"dir": str(cov_dir), "include": [mapping, unused]})}
    env.pop(coverage_hook.CONTEXT_ENV, None)
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(ROOT / "matrices" / "smoke.yaml"), "--id", CASE,
                           "--report", str(tmp_path / "rep"), "--jobs", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = list(cov_dir.glob(".coverage.*"))
    assert len(files) >= 3, f"the parent and the ranks each save their lines: {[f.name for f in files]}"
    by_file = coverage_hook.lines(cov_dir)
    assert set(by_file) == {mapping}, by_file.keys()
    contexts = set().union(*by_file[mapping].values())
    assert CASE in contexts, contexts
    # ShardedTensor.from_rank_offsets: the ranks build their sharded state dict with it
    body = [m for m in generate(MAPPING) if m.function == "ShardedTensor.from_rank_offsets" and not m.at_import]
    assert body and coverage_hook.covering(by_file[mapping], body[0].line, body[0].end_line, [CASE, "other"]) == [CASE]


def test_the_selection_follows_lines_imports_and_what_ran_before_any_case():
    by_line = {10: {"a"}, 11: {"a", "b"}, 20: {"b"}, 30: set()}
    cases = ["a", "b", "c"]
    assert coverage_hook.covering(by_line, 10, 10, cases) == ["a"]
    assert coverage_hook.covering(by_line, 11, 20, cases) == ["a", "b"]
    assert coverage_hook.covering(by_line, 40, 41, cases) == [], "a line no case ran: not covered"
    # a module-level line coverage filed under the case that imported first: every case that used the file
    assert coverage_hook.covering({1: {"a"}, 20: {"b"}}, 1, 1, cases, at_import=True) == ["a", "b"]
    assert coverage_hook.covering({1: {coverage_hook.IMPORTED}}, 1, 1, cases) == cases
    assert coverage_hook.covering({}, 1, 1, cases, at_import=True) == []
