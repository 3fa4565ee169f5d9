"""The schedulers: one protocol, one module each, picked by name; today's flags
pick the same ones they ran before (--jobs N: pool, --gpus-per-node: packing, --shard: shard, which
runs its part through what the other flags pick). Cases here are stand-ins (`fake_case`): what is
tested is who runs what, in which order, not the cases."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from harness.orchestration.matrix import load_matrix
from harness.orchestration.runner import RunOptions, run_cases
from harness.orchestration.schedulers import SCHEDULERS, Scheduler, Settings, get, implied
from harness.orchestration.schedulers._balance import select
from harness.orchestration.schedulers._common import bare
from harness.orchestration.schedulers._flags import add_flags, scheduler_of

SMOKE = Path(__file__).resolve().parent.parent / "matrices" / "smoke.yaml"
K = "reshard-weights gpt tp1pp1dp1cp1->"


def fake_case(spec, options) -> object:
    """A stand-in for run_case: earlier cases take longer, so a pool finishes them out of order."""
    time.sleep(0.05 * (len(spec.id) % 3))
    result = bare(spec, "passed")
    result.notes.append(f"pid {os.getpid()}")
    return result


def _specs():
    specs = load_matrix(SMOKE).select(K)
    assert len(specs) >= 4
    return specs


def _flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=1)
    add_flags(p)
    return p.parse_args(list(argv))


def test_every_name_builds_a_scheduler_of_that_name():
    settings = Settings(gpus_per_node=2, shard="1/2")
    for name in SCHEDULERS:
        scheduler = get(name, settings)
        assert isinstance(scheduler, Scheduler) and scheduler.name == name
    with pytest.raises(ValueError, match="scheduler 'nope': one of serial, pool, packing, cluster, shard"):
        get("nope")


@pytest.mark.parametrize("argv, name, inner", [
    ((), "serial", None), (("--jobs", "1"), "serial", None), (("--jobs", "2"), "pool", None),
    (("--gpus-per-node", "2"), "packing", None), (("--shard", "1/2"), "shard", "serial"),
    (("--shard", "2/3", "--jobs", "2"), "shard", "pool"), (("--shard", "1/2", "--gpus-per-node", "4"), "shard", "packing"),
    (("--scheduler", "pool", "--jobs", "2"), "pool", None), (("--scheduler", "serial", "--jobs", "2"), "serial", None),
    (("--scheduler", "pool", "--shard", "1/2", "--jobs", "2"), "shard", "pool"),
    (("--scheduler", "cluster", "--jobs", "2", "--shards", "3"), "cluster", "pool"),
])
def test_todays_flags_pick_the_scheduler_they_ran_before(argv, name, inner):
    scheduler = scheduler_of(_flags(*argv))
    assert scheduler.name == name
    assert getattr(getattr(scheduler, "inner", None), "name", None) == inner
    assert implied(Settings(jobs=2, gpus_per_node=1, shard="1/2")) == "shard"


def test_flags_that_make_no_run_are_refused_by_name():
    for argv, message in [(("--gpus-per-node", "2", "--jobs", "2"), "cannot take --jobs too"),
                          (("--shard", "3/2"), "I must be between 1 and N"),
                          (("--scheduler", "packing",), "needs --gpus-per-node N"),
                          (("--scheduler", "shard",), "needs --shard I/N"),
                          (("--scheduler", "cluster", "--shard", "1/2"), "serial, pool or packing, not cluster")]:
        with pytest.raises(ValueError, match=message):
            scheduler_of(_flags(*argv))
    specs = _specs()
    with pytest.raises(ValueError, match="gloo worlds from the mp launcher only"):
        get("pool", Settings(jobs=2)).check(specs, RunOptions(dist_backend="nccl"))
    get("pool", Settings(jobs=2)).check(specs[:1], RunOptions(dist_backend="nccl"))  # one case: nothing at once
    with pytest.raises(ValueError, match="cannot take --jobs too"):  # run_cases' old keywords, as before
        run_cases(specs, RunOptions(), jobs=2, gpus_per_node=2)


@pytest.mark.parametrize("name", ["serial", "pool"])
def test_results_come_back_in_matrix_order_and_on_result_sees_each_once(name):
    specs, seen = _specs(), []
    results = get(name, Settings(jobs=2)).run(specs, RunOptions(), fake_case, seen.append)
    assert [r.id for r in results] == [s.id for s in specs] and sorted(r.id for r in seen) == sorted(s.id for s in specs)
    pids = {n for r in results for n in r.notes if n.startswith("pid ")}
    assert (pids == {f"pid {os.getpid()}"}) == (name == "serial")  # the pool's cases ran in its workers


def test_a_shard_runs_exactly_its_part_through_its_inner_scheduler_and_the_parts_cover_the_matrix():
    specs, ran = _specs(), []
    for i in (1, 2, 3):
        shard = get("shard", Settings(shard=f"{i}/3", jobs=2))
        part = shard.select(specs)
        assert part == select(specs, i, 3) and shard.inner.name == "pool"
        results = shard.run(specs, RunOptions(), fake_case)
        assert [r.id for r in results] == [s.id for s in part]
        ran += [r.id for r in results]
    assert sorted(ran) == sorted(s.id for s in specs)
