"""The save-memory benchmark's report from rows alone (`--replot`): killed worlds and the host-wide
column are in the table, an old results.json without host numbers says so, and the plot renders."""

from __future__ import annotations

import json

from benchmarks.save_memory import NO_HOST, main

OK = {"model": "m", "dp": 1, "variant": "fully_reshardable", "rank0_state_mib": 10.0, "rank0_peak_delta_mib": 30.0,
      "other_ranks_max_peak_delta_mib": 0.0, "save_s": 1.0}
KILLED = {"model": "m", "dp": 4, "variant": "fully_reshardable", "error": "rank 1 of 4 died: process 1 terminated with signal SIGKILL"}
HOST = {"host_used_peak_mib": 9000.0, "host_used_baseline_mib": 8000.0, "host_total_mib": 24000.0}


def _replot(tmp_path, rows):
    (tmp_path / "results.json").write_text(json.dumps(rows))
    main(["--replot", "--out", str(tmp_path), "--model", "m"])
    assert (tmp_path / "save_memory.png").stat().st_size > 10_000
    return (tmp_path / "table.md").read_text()


def test_old_results_say_the_host_total_was_not_recorded(tmp_path):
    table = _replot(tmp_path, [OK, KILLED])
    assert "**rank 1 of 4 died: process 1 terminated with signal SIGKILL**" in table and NO_HOST in table


def test_new_results_show_the_host_wide_peak_of_its_total(tmp_path):
    table = _replot(tmp_path, [{**OK, **HOST}, KILLED])
    assert "| 9000.0 (of 24000.0) |" in table and NO_HOST not in table
