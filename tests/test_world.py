"""The launcher: results in rank order, failures carry the rank's traceback, nothing left behind."""

import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from harness.run.preload import warm
from harness.run.procs import live_children
from harness.run.world import (
    WorldError,
    WorldTimeout,
    choose_backend,
    exception_of,
    launch,
)

warm()  # as the runner does: ranks fork from a parent that already imported megatron-core


def _sum_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": float(t) * scale, "device": str(ctx.device)}


def _raise_on_rank1(ctx, _):
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever without the launcher tearing the world down


def _sleep_forever(ctx, _):
    time.sleep(3600)


def _hang_on_rank1(ctx, _):
    if ctx.rank == 1:
        time.sleep(3600)
    dist.barrier()


def _grandchild_then_raise(ctx, _):
    p = subprocess.Popen(["sleep", "600"])
    (ctx.workdir / f"grandchild{ctx.rank}.pid").write_text(str(p.pid))
    raise RuntimeError("rank left a child behind")


def _chatty_then_die_on_rank1(ctx, _):
    print(f"banner from rank {ctx.rank}", flush=True)
    if ctx.rank == 1:
        import os

        os._exit(3)  # dies without a Python traceback: only its output can say what happened
    return ctx.rank


def _no_children_left():
    return live_children() == []


def _errorfiles():
    return set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A system temp of this test's own: torch writes a pytorch-errorfile per rank of every world into
    it, so a neighbour xdist worker's live world would otherwise be counted as this one's leftovers."""
    own = tmp_path / "sys"
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    return own


def test_results_come_back_in_rank_order(tmp_path):
    out = launch(_sum_ranks, 2.0, 3, tmp_path, timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 6.0 and o["device"] == "cpu" for o in out)
    assert list(tmp_path.iterdir()) == []  # result files are consumed
    assert _no_children_left()


def test_a_rank_that_raises_fails_the_world_with_its_traceback(tmp_path, private_tmp):
    start = time.monotonic()
    with pytest.raises(WorldError) as exc:
        launch(_raise_on_rank1, None, 2, tmp_path / "w", timeout_s=60)
    assert exc.value.rank == 1
    assert "boom on rank 1" in str(exc.value) and "_raise_on_rank1" in exc.value.rank_traceback
    assert time.monotonic() - start < 30
    assert _no_children_left()
    assert _errorfiles() == set() and list(private_tmp.iterdir()) == []


class _NotAnException(BaseException):
    """What torch DCP's CheckpointException is: a BaseException that is no Exception."""


def _raise_base_exception(ctx, _):
    raise _NotAnException("refused: global shape mismatch")


@pytest.mark.parametrize("verbose", ["", "1"])
def test_a_rank_that_raises_a_base_exception_still_reports_it(tmp_path, monkeypatch, verbose):
    """torch's spawn wrapper catches Exception only: such a rank died with no error file, and under
    CKPT_HARNESS_VERBOSE (no rank log to quote) its cause was lost, so a refusal read as unrecognised."""
    monkeypatch.setenv("CKPT_HARNESS_VERBOSE", verbose)
    with pytest.raises(WorldError) as exc:
        launch(_raise_base_exception, None, 1, tmp_path, timeout_s=60)
    assert exc.value.rank_traceback and "_raise_base_exception" in exc.value.rank_traceback
    assert exception_of(exc.value.rank_traceback) == ("_NotAnException", "refused: global shape mismatch")


def test_a_hung_world_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorldTimeout, match="still running after 3s"):
        launch(_sleep_forever, None, 2, tmp_path, timeout_s=3)
    assert time.monotonic() - start < 15
    assert _no_children_left()


def test_one_hung_rank_ends_the_world_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorldError) as exc:
        launch(_hang_on_rank1, None, 2, tmp_path, timeout_s=4)
    # either rank 0's collective times out first, or the launcher's deadline does
    assert "rank 0" in str(exc.value) or "still running" in str(exc.value)
    assert time.monotonic() - start < 20
    assert _no_children_left()


def test_processes_started_by_a_rank_are_killed(tmp_path):
    with pytest.raises(WorldError, match="rank left a child behind"):
        launch(_grandchild_then_raise, None, 1, tmp_path, timeout_s=30)
    pid = int((tmp_path / "grandchild0.pid").read_text())
    assert _gone(pid)


def _gone(pid, within_s=5.0):
    """SIGKILL is delivered asynchronously: on a loaded machine the state changes a moment later."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_rank_output_stays_out_of_the_terminal_but_reaches_a_failure_report(tmp_path, capfd):
    assert launch(_sum_ranks, 1.0, 2, tmp_path / "ok", timeout_s=60)
    with pytest.raises(WorldError) as err:
        launch(_chatty_then_die_on_rank1, None, 2, tmp_path / "bad", timeout_s=60)
    assert "banner from rank 1" in str(err.value) and err.value.rank == 1
    assert "banner from rank" not in capfd.readouterr().out


def test_backend_choice_on_this_machine():
    if torch.cuda.device_count() >= 2:
        pytest.skip("GPU box: auto picks nccl here")
    assert choose_backend(2) == "gloo"
    with pytest.raises(WorldError, match="nccl requested for 2 ranks"):
        choose_backend(2, "nccl")
    with pytest.raises(ValueError):
        choose_backend(2, "mpi")


def test_exception_of_reads_multiline_messages():
    from harness.run.world import exception_of

    tb = (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    raise E\n"
        "megatron.core.dist_checkpointing.core.CheckpointingException: Some keys are missing.\nMissing keys: {'a'}\n"
    )
    assert exception_of(tb) == ("CheckpointingException", "Some keys are missing.\nMissing keys: {'a'}")
    assert exception_of("Traceback...\nKeyError: 'step'\n") == ("KeyError", "'step'")
    assert exception_of("Traceback...\nAssertionError\n") == ("AssertionError", "")


@pytest.mark.slow  # torchrun starts fresh interpreters: ~60 s per world on 2 cores
def test_the_cause_is_the_rank_that_raised_not_a_peer_whose_transport_it_reset(tmp_path):
    """Bridge 0.5.1's pp2vpp2 LoRA: rank 1 raised in get_model's pre_wrap_hook, rank 0's gloo
    transport was reset by it and reached disk first; the world quotes rank 1."""
    import os
    import pickle

    from harness.run.world import _first_failure

    peer = ('Traceback (most recent call last):\n  File "/x/torch/distributed/distributed_c10d.py", line 1, in broadcast\n'
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer\n")
    cause = ('Traceback (most recent call last):\n  File "/x/megatron/bridge/models/model_provider.py", line 9, in get_model\n'
             "ValueError: pre_wrap_hook failed\n")
    files = [tmp_path / "e0", tmp_path / "e1"]
    for f, tb, t in ((files[0], peer, 1_000), (files[1], cause, 2_000)):  # the peer's follow-on is older on disk
        f.write_bytes(pickle.dumps(tb))
        os.utime(f, ns=(t, t))
    err = _first_failure([str(f) for f in files], 2)
    assert err.rank == 1 and "pre_wrap_hook failed" in err.rank_traceback
    assert "(then rank 0 failed: RuntimeError: [../third_party/gloo" in str(err)
    # every failure a follow-on (a rank killed outright): the earliest one still stands
    files[1].write_bytes(pickle.dumps(peer.replace("reset", "closed")))
    os.utime(files[1], ns=(2_000, 2_000))
    assert _first_failure([str(f) for f in files], 2).rank == 0


def test_the_same_rank_body_runs_under_torchrun(tmp_path):
    from harness.run.probes import allreduce_ranks
    from harness.run.world import launch_torchrun

    out = launch_torchrun(allreduce_ranks, 3.0, 2, tmp_path, timeout_s=240)
    assert [o["rank"] for o in out] == [0, 1] and all(o["sum"] == 3.0 and o["backend"] == "gloo" for o in out)


@pytest.mark.slow
def test_a_failing_rank_under_torchrun_is_reported(tmp_path):
    from probes import raise_on_rank
    from harness.run.world import launch_torchrun

    with pytest.raises(WorldError, match="boom on rank 1") as exc:
        launch_torchrun(raise_on_rank, 1, 2, tmp_path, timeout_s=240)
    assert exc.value.rank == 1


# torchrun's copy is a launcher test (slow tier); test_the_same_rank_body_runs_under_torchrun stays default
@pytest.mark.parametrize("launcher", ["mp", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_what_ranks_leave_in_their_temp_goes_with_the_world(tmp_path, launcher):
    """verl's checkpoint manager leaves a ckpt_<hash>.lock per save in tempfile.gettempdir(): a rank's
    temp is its world's own (one for all ranks, so such a lock still works), removed with the world."""
    from probes import leave_temp_file
    from harness.run.world import launch_torchrun

    run = launch if launcher == "mp" else launch_torchrun
    out = run(leave_temp_file, f"probe-{launcher}", 2, tmp_path, timeout_s=240)
    assert len({o["tmp"] for o in out}) == 1 and Path(out[0]["tmp"]).name.startswith("ckpt-harness-tmp-")
    assert all(o["env"] == o["tmp"] for o in out) and out[0]["tmp"] != tempfile.gettempdir()
    assert not Path(out[0]["tmp"]).exists() and not any(Path(o["path"]).exists() for o in out)


def test_a_world_that_cannot_start_leaves_no_temp(tmp_path, monkeypatch):
    from harness.run import world

    def refuse(*a, **k):
        raise OSError("cannot start")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "sys"))
    (tmp_path / "sys").mkdir()
    monkeypatch.setattr(world, "_start", refuse)
    with pytest.raises(OSError, match="cannot start"):
        launch(_sum_ranks, 1.0, 1, tmp_path / "w", backend="gloo", timeout_s=30)
    assert not list((tmp_path / "sys").iterdir())


def test_torchrun_ranks_get_the_case_timeout_and_hooks(tmp_path):
    """rank_entry used to run with run_from_env's default 1800 s whatever the case asked."""
    import pickle

    from harness.run.probes import allreduce_ranks
    from harness.run.world import dump_spec

    dump_spec(tmp_path / "spec.pkl", allreduce_ranks, 1.0, 42.0, ("probes:mark_hook",))
    spec = pickle.loads((tmp_path / "spec.pkl").read_bytes())
    assert spec["timeout_s"] == 42.0 and spec["hooks"] == ("probes:mark_hook",) and spec["fn"] is allreduce_ranks


def _gc_state(ctx, _):
    import gc

    return gc.get_freeze_count()


def test_ranks_inherit_the_parent_heap_frozen_and_the_parent_collects_as_before(tmp_path):
    import gc

    # forked ranks keep the parent's objects out of their collections (no copy-on-write of the
    # whole heap by the collector); the parent's own collector is back to normal after the start
    counts = launch(_gc_state, None, 2, tmp_path, timeout_s=60)
    assert all(c > 1000 for c in counts), counts
    assert gc.get_freeze_count() == 0


def _segfault_on_rank1(ctx, _):
    if ctx.rank == 1:
        import ctypes
        import faulthandler

        faulthandler.enable()  # as pytest's faulthandler plugin leaves it in the parent the ranks fork from

        def deep_in_the_rank():
            ctypes.string_at(0)  # a native crash: no Python exception, only faulthandler's dump

        deep_in_the_rank()
    return ctx.rank


def test_a_rank_that_crashes_is_reported_with_the_crashing_frame_not_only_the_dump_tail(tmp_path):
    with pytest.raises(WorldError) as err:
        launch(_segfault_on_rank1, None, world_size=2, workdir=tmp_path, backend="gloo", timeout_s=60)
    text = str(err.value)
    assert "rank 1 of 2 died" in text and "SIGSEGV" in text
    assert "--- rank 1 crashed ---" in text, text
    crash = text.split("--- rank 1 crashed ---", 1)[1].split("--- rank 1 output", 1)[0]
    assert "Fatal Python error: Segmentation fault" in crash
    assert "Current thread" in crash and "in deep_in_the_rank" in crash and "_segfault_on_rank1" in crash


def test_fatal_head_is_empty_without_a_fatal_error():
    from harness.run.ranklog import fatal_head

    assert fatal_head("") == "" and fatal_head("Traceback (most recent call last):\n  File x\nValueError: y") == ""
