"""`ckpt-harness bench` on the smallest model, 1 and 2 ranks, one repeat: the table has a row for
every (ranks, strategy) with the DCP reference among them, each ratio is the figure over DCP's,
and the bytes a row reports are the bytes of the checkpoint it left on disk. No timing asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.cli import main
from harness.orchestration.bench import RATIO_FLOOR, medians, world_figures
from harness.report.bench import FIELDS

STRATEGIES = ("sync", "fully_parallel", "async", "fsdp_dtensor")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--out", str(out), "--models", "gpt-gqa", "--worlds", "1", "2", "--strategies", *STRATEGIES,
               "--repeats", "1", "--keep"])
    return rc, out, json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


def _table_rows(text: str) -> dict[tuple[int, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "gpt-gqa":
            rows[(int(cells[1]), cells[2])] = cells[3:]
    return rows


def test_every_strategy_and_the_dcp_reference_has_its_row(bench):
    rc, out, doc, text = bench
    assert rc == 0, [r.get("error") for r in doc["rows"]]
    rows = _table_rows(text)
    assert set(rows) == {(w, s) for w in (1, 2) for s in ("dcp",) + STRATEGIES}
    assert rows[(1, "fully_parallel")][0].startswith("skipped: ")  # one rank has no DP group to distribute over
    for key, cells in rows.items():
        if key != (1, "fully_parallel"):
            assert len(cells) == len(FIELDS) and all(c and not c.startswith(("skipped", "**")) for c in cells), (key, cells)
    assert (out / "bench.png").stat().st_size > 10_000


def test_each_ratio_is_the_figure_over_dcps(bench):
    _, _, doc, text = bench
    rows = _table_rows(text)
    measured = [r for r in doc["rows"] if "median" in r]
    assert len(measured) == 9
    for r in measured:
        dcp = next(d for d in measured if d["strategy"] == "dcp" and d["world"] == r["world"])
        for key, _, fmt in FIELDS:
            want = r["median"][key] / dcp["median"][key] if dcp["median"][key] > RATIO_FLOOR.get(key, 0) else None
            got = r["ratio"][key]
            assert (got is None) == (want is None) and (want is None or math.isclose(got, want, rel_tol=1e-9)), (r["strategy"], key)
            cell = rows[(r["world"], r["strategy"])][[k for k, _, _ in FIELDS].index(key)]
            shown = fmt.format(r["median"][key]) + ("" if r["strategy"] == "dcp" or want is None else f" ({want:.2f}x)")
            assert cell == shown, (r["strategy"], key, cell, shown)


def test_the_bytes_written_are_the_files_on_disk(bench):
    _, _, doc, _ = bench
    for r in (r for r in doc["rows"] if "median" in r):
        kept = Path(r["kept"])
        on_disk = sum(p.stat().st_size for p in kept.rglob("*") if p.is_file())
        assert on_disk > 0 and r["runs"][-1]["bytes"] == on_disk, (r["strategy"], r["world"], r["runs"][-1]["bytes"], on_disk)
        assert math.isclose(r["median"]["mb_written"], on_disk / 1e6)
        assert math.isclose(r["median"]["save_gbps"], on_disk / 1e9 / r["runs"][-1]["save_total_s"])


def test_a_world_figure_is_the_slowest_rank_and_rank0s_bytes():
    rank = {"save_block_s": 1.0, "save_total_s": 2.0, "load_s": 3.0, "bytes": 100,
            "save_peak_rss": 10, "save_peak_delta": 1, "load_peak_rss": 10, "load_peak_delta": 1}
    slow = {**rank, "save_total_s": 5.0, "load_s": 0.5, "bytes": 0, "save_peak_delta": 7}
    (fig,) = world_figures([[rank], [slow]])
    assert (fig["save_total_s"], fig["load_s"], fig["bytes"], fig["save_peak_delta"]) == (5.0, 3.0, 100, 7)


def test_memory_is_the_largest_repeats_and_times_the_median():
    runs = [{"save_block_s": t, "save_total_s": t, "load_s": t, "bytes": 10**9, "save_peak_rss": 9 * 2**20,
             "save_peak_delta": d * 2**20, "load_peak_rss": 9 * 2**20, "load_peak_delta": 0} for t, d in ((1.0, 8), (3.0, 0), (2.0, 0))]
    m = medians(runs)
    assert (m["save_total_s"], m["save_gbps"], m["save_peak_delta_mib"]) == (2.0, 0.5, 8.0)  # GB/s: median of 1, 1/3, 1/2


def test_a_model_it_cannot_run_is_named(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), "--models", "hf-llama", "--worlds", "1"]) == 2
    assert "hf-llama" in capsys.readouterr().err and not (tmp_path / "bench.json").exists()


def test_nccl_without_a_gpu_per_rank_is_refused_before_any_world(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "--out", str(tmp_path), "--models", "gpt-25m", "--worlds", "1", "2", "--dist-backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "--dist-backend nccl: nccl requested for 2 ranks but 1 GPU(s) are visible" in err and "Traceback" not in err
    assert not (tmp_path / "bench.json").exists()
