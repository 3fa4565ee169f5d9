"""matrices/nightly-gpu.yaml cannot rot: it loads and expands here (default tier), every cut the
CPU variant uses is valid, and (slow tier) it runs on CPU with gloo and `--max-world 4`: every case
passes or fails as its named xfail, or is not-run with a named reason, and the not-run set is
exactly the entries that need CUDA or Transformer-Engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from harness.core.requires import unmet
from harness.orchestration.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY = ROOT / "matrices" / "nightly-gpu.yaml"
#: The CPU variant's cut: 4 gloo ranks run on 2 cores (the smoke matrix does), keep tp2pp2-class
#: topologies and the 8 -> 4 pairs' structure; --max-world 2 also loads (tested below) but its cut
#: turns `dp4 -> tp2pp2` into `dp2 -> tp2`, where bf16 resume's absolute weight bound (5e-3) is
#: below one bf16 ulp of a norm weight near 1 (7.8e-3; docs/nightly-gpu.md).
MAX_WORLD_CPU = 4


def _needs_gpu(spec) -> bool:
    """What the matrix says needs a GPU: the TE entries (tags te, moe-te) and the timed 1.1B saves,
    each declaring `requires: [cuda, ...]`."""
    return "cuda" in spec.requires


def test_nightly_matrix_expands_with_stable_unique_ids_and_gpu_requirements():
    m = load_matrix(NIGHTLY)
    ids = [c.id for c in m.cases]
    assert len(ids) == len(set(ids)) == 105 and ids == [c.id for c in load_matrix(NIGHTLY).cases]
    assert all("gpu" in c.markers for c in m.cases)
    assert max(max(c.source.world_size, c.target.world_size) for c in m.cases) == 8
    origins = Counter(c.origin for c in m.cases)
    raw_entries = NIGHTLY.read_text().count("\n  - case:")
    assert len(origins) == raw_entries  # every entry contributes cases
    for c in m.cases:
        if c.opts.get("layer_spec") == "te":
            assert set(c.requires) == {"cuda", "te"} | ({"nccl"} if c.case == "convert" else set()), c.id
        elif c.case == "convert":  # several conversion ranks: upstream's converter needs NCCL (docs/convert.md)
            assert c.requires == ("cuda", "nccl"), c.id
        elif c.case == "async-save" and c.tag in ("nvrx", "persistent"):  # writers that stage from CUDA tensors
            assert c.requires == ("cuda",), c.id
        elif c.model == "gpt-1b":
            assert c.requires == ("cuda", "host-memory-gib>=64") and c.budgets, c.id
        else:
            assert c.requires == (), c.id
    te_cp = [c for c in m.cases if c.tag == "te" and max(c.source.cp, c.target.cp) > 1 and c.case == "reshard-weights"]
    assert len(te_cp) >= 16  # the CP>1 forward logits the CPU tiers cannot run


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_cut_the_cpu_variant_may_use_is_valid(n):
    cases = load_matrix(NIGHTLY, max_world=n).cases
    assert cases and all(max(c.source.world_size, c.target.world_size) <= n for c in cases)
    assert {c.model for c in cases} == {c.model for c in load_matrix(NIGHTLY).cases}  # no model is cut away
    assert [c.id for c in load_matrix(NIGHTLY, max_world=8).cases] == [c.id for c in load_matrix(NIGHTLY).cases]


def _run_sampling_tree_rss(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd`, sampling the summed RSS of it and all its descendants every 0.5 s: (result, peak MiB)."""
    import threading

    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.wait(0.5):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate(timeout=3600)
    stop.set()
    t.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak[0] / 2**20


@pytest.mark.slow
def test_nightly_matrix_runs_on_cpu_with_gloo_cut_to_four_ranks(tmp_path):
    """The CPU variant, end to end through the CLI (what docs/nightly-gpu.md says to run). Prints
    its wall time and the peak summed RSS of the run's process tree (measured, never asserted)."""
    from harness.core.requires import probe

    rep = tmp_path / "rep"
    cmd = [sys.executable, "-m", "harness.cli", "run", str(NIGHTLY), "--dist-backend", "gloo", "--max-world", str(MAX_WORLD_CPU),
           "--report", str(rep), "--junit", str(rep / "junit.xml"), "--html", str(rep / "report.html")]
    start = time.perf_counter()
    proc, peak_mib = _run_sampling_tree_rss(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    doc = json.loads((rep / "results.json").read_text())
    results = {r["id"]: r for r in doc["results"]}
    specs = {c.id: c for c in load_matrix(NIGHTLY, max_world=MAX_WORLD_CPU).cases}
    assert set(results) == set(specs)
    for cid, r in results.items():
        assert r["status"] in ("passed", "xfailed", "not-run"), (cid, r["status"], r.get("error"))
    not_run = {cid for cid, r in results.items() if r["status"] == "not-run"}
    # exactly what this machine cannot offer under gloo, and that is exactly the GPU entries
    assert not_run == {cid for cid, s in specs.items() if unmet(s.requires, MAX_WORLD_CPU, "gloo")}
    assert not_run == {cid for cid, s in specs.items() if _needs_gpu(s)}
    for cid in not_run:
        reason = results[cid]["not_run_reason"]
        assert "needs CUDA ranks, but --dist-backend gloo runs every rank on CPU" in reason, (cid, reason)
        if "te" in specs[cid].requires and probe().te_missing:
            assert "needs Transformer-Engine: No module named 'transformer_engine'" in reason, (cid, reason)
    for cid, r in results.items():  # every cut case says what it was written as
        if specs[cid].notes:
            assert set(specs[cid].notes) <= set(r["notes"]), cid
    junit = ET.parse(rep / "junit.xml").getroot()
    assert int(junit.get("skipped")) == len(not_run) + sum(r["status"] == "xfailed" for r in results.values())
    assert doc["summary"]["not-run"] == len(not_run) and "not run on this machine" in (rep / "report.html").read_text()
    print(f"\nnightly CPU variant: {len(results)} cases {dict(Counter(r['status'] for r in results.values()))} "
          f"in {wall:.0f} s; peak summed RSS of the run's process tree {peak_mib:.0f} MiB")
