"""harness.compat.gloo: Megatron-FSDP's coalesced collectives on gloo, issued one at a time. The
manager must run every collective a block records, in order, with the values torch's own coalesced
launch gives, leave nothing recorded behind, delegate a group that is not gloo, and refuse an op it
has no serial form for (never drop one)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from harness.compat import gloo
from harness.run.preload import warm
from harness.run.world import WorldError, launch

warm()


def _block(ctx, manager_name):
    """What Megatron-FSDP does in one backward step: async all-gathers of parameter buckets in one
    block, reduce-scatters of gradient buckets in another, then the all-gathers' wait."""
    manager = gloo.serial_coalescing(_coalescing_manager) if manager_name == "serial" else _coalescing_manager
    rank, group = ctx.rank, dist.group.WORLD
    sizes = (5, 3, 8)
    gathered = [torch.full((2 * n,), -1.0) for n in sizes]
    with manager(group, async_ops=True) as cm:
        for out, n in zip(gathered, sizes):
            dist.all_gather_into_tensor(out, torch.arange(n, dtype=torch.float32) + 10 * rank, group=group, async_op=True)
    scattered = [torch.full((n,), -1.0) for n in sizes]
    with manager(group):
        for out, n in zip(scattered, sizes):
            dist.reduce_scatter_tensor(out, torch.arange(2 * n, dtype=torch.float32) * (rank + 1), group=group)
    with manager(group):  # torch's manager takes one kind of collective per block
        dist.all_reduce(summed := torch.tensor([float(rank + 1)]), group=group)
    cm.wait()
    with manager(group) as empty:  # a block that records nothing issues nothing
        pass
    empty.wait()
    from torch.distributed import distributed_c10d as c10d

    return {"gathered": gathered, "scattered": scattered, "summed": summed,
            "left_recorded": {str(g): len(ops) for g, ops in c10d._world.pg_coalesce_state.items()}}


def test_the_serial_manager_gives_what_torchs_coalesced_launch_gives(tmp_path):
    serial = launch(_block, "serial", 2, tmp_path / "serial", backend="gloo", timeout_s=120)
    reference = launch(_block, "torch", 2, tmp_path / "torch", backend="gloo", timeout_s=120)
    for mine, theirs in zip(serial, reference):
        assert mine["left_recorded"] == {}
        for key in ("gathered", "scattered"):
            assert len(mine[key]) == 3 and all(torch.equal(a, b) for a, b in zip(mine[key], theirs[key])), key
        assert torch.equal(mine["summed"], theirs["summed"]) and float(mine["summed"]) == 3.0
    # the values themselves, not only agreement: rank 1's all-gather half is its arange + 10
    assert torch.equal(serial[1]["gathered"][1], torch.tensor([0.0, 1, 2, 10, 11, 12]))
    assert torch.equal(serial[0]["scattered"][0], torch.arange(5, dtype=torch.float32) * 3)


def _drop_reduce_scatters(op, group):
    if op.op is torch.distributed.distributed_c10d.all_reduce:
        gloo_issue(op, group)


gloo_issue = gloo._issue


def _planted(ctx, _):
    gloo._issue = _drop_reduce_scatters
    return _block(ctx, "serial")


def test_a_manager_that_drops_a_recorded_op_is_caught(tmp_path):
    """The planted fault: every op but the all-reduce dropped. The block's results differ from torch's."""
    planted = launch(_planted, None, 2, tmp_path / "planted", backend="gloo", timeout_s=120)
    reference = launch(_block, "torch", 2, tmp_path / "torch", backend="gloo", timeout_s=120)
    assert not all(torch.equal(a, b) for a, b in zip(planted[0]["scattered"], reference[0]["scattered"]))


def _unknown_op(ctx, _):
    from torch.distributed import distributed_c10d as c10d

    manager = gloo.serial_coalescing(_coalescing_manager)
    with manager(dist.group.WORLD):
        c10d._world.pg_coalesce_state[dist.group.WORLD].append(c10d._CollOp(dist.broadcast, torch.zeros(1)))


def test_an_op_without_a_serial_form_is_refused_by_name_never_dropped(tmp_path):
    with pytest.raises(WorldError, match="no serial form of .*broadcast"):
        launch(_unknown_op, None, 2, tmp_path, backend="gloo", timeout_s=120)


def test_a_group_that_is_not_gloo_gets_torchs_own_manager(monkeypatch):
    entered = []

    @contextmanager
    def original(group, device=None, async_ops=False):
        entered.append((group, async_ops))
        yield "torch's"

    monkeypatch.setattr(gloo, "_gloo", lambda group: False)
    with gloo.serial_coalescing(original)("nccl-group", async_ops=True) as cm:
        pass
    assert cm == "torch's" and entered == [("nccl-group", True)]


def test_the_probe_says_gloo_on_a_cpu_rank_before_and_inside_a_world(tmp_path):
    assert gloo._fsdp_group_is_gloo(torch.device("cpu"))
    assert not gloo._fsdp_group_is_gloo(torch.device("cuda", 0)) or dist.is_initialized()
    assert launch(lambda_probe, None, 2, tmp_path, backend="gloo", timeout_s=60) == [True, True]


def lambda_probe(ctx, _):
    return gloo._fsdp_group_is_gloo(ctx.device)
