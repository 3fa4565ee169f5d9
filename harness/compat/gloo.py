"""gloo as Megatron-FSDP's transport on CPU: what NCCL does safely and torch's ProcessGroupGloo does not.

Megatron-FSDP batches its parameter all-gathers and gradient reduce-scatters in torch's
`_coalescing_manager`; on gloo that runs ProcessGroupGloo's coalesced collectives
(allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced), the all-gathers asynchronously on
gloo's worker threads while the next backward's reduce-scatter is issued. Under torch 2.14.1 that
corrupts the heap now and then: measured, 2 of 6 runs of extended.yaml's 7 Megatron-FSDP resume cases under
`-n 2` lost a case (SIGSEGV in reduce_scatter_single_coalesced, and glibc's "malloc(): unaligned tcache
chunk detected" abort in a gloo worker thread inside AsyncAllgatherCoalescedWork; CI lost two cases in one
run), a false red with no Megatron defect behind it; with the shim, 12 runs and no crash. The shim issues the collectives a coalescing block recorded one at a
time, synchronously, when the block ends: the same collectives in the same order, as NCCL's coalesced
launch computes them, with nothing left in flight on gloo's threads.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from harness.compat._shim import ADAPTS, REQUIRE, Shim

FSDP_GLOO_SERIAL_COALESCING = "Megatron-FSDP: coalesced collectives on gloo issued one at a time"


def _gloo(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo"


def _issue(op, group) -> None:
    """One recorded collective (torch's _CollOp), run now and waited for (by torch's current names,
    the deprecated ones where a torch has no other)."""
    from torch.distributed import distributed_c10d as c10d

    gather = getattr(c10d, "all_gather_single", c10d.all_gather_into_tensor)
    scatter = getattr(c10d, "reduce_scatter_single", c10d.reduce_scatter_tensor)
    kind = op.op
    if kind is c10d.all_reduce:
        c10d.all_reduce(op.tensor, op=op.redop, group=group)
    elif kind in (gather, c10d.all_gather_into_tensor):
        gather(op.dst_tensor, op.tensor, group=group)
    elif kind in (scatter, c10d.reduce_scatter_tensor):
        scatter(op.dst_tensor, op.tensor, op=op.redop, group=group)
    else:  # a kind torch's own manager coalesces that this one does not know: say so, never drop it
        raise NotImplementedError(f"ckpt-harness: {FSDP_GLOO_SERIAL_COALESCING}: no serial form of {kind!r}")


def serial_coalescing(original):
    """`original` (torch's _coalescing_manager) where the group is not gloo; on gloo, the same
    recording (the collectives called inside append to the group's op list, as torch's manager has
    them do), then each recorded op issued synchronously at the end, in order. The yielded manager has
    no works: its wait() returns at once, as for a block whose ops have completed."""

    @contextmanager
    def manager(group=None, device=None, async_ops: bool = False) -> Iterator[object]:
        from torch.distributed import distributed_c10d as c10d

        group = group or c10d._get_default_group()
        if not _gloo(group):
            with original(group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        state = c10d._world.pg_coalesce_state
        if state.get(group):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        state[group] = []
        try:
            yield c10d._CoalescingManager()
        finally:
            ops = state.pop(group, [])
        for op in ops:
            _issue(op, group)

    manager._ckpt_harness = True
    return manager


def _serialize_fsdp_coalescing() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as module

    if not getattr(module._coalescing_manager, "_ckpt_harness", False):
        module._coalescing_manager = serial_coalescing(module._coalescing_manager)


def _fsdp_group_is_gloo(device: torch.device) -> bool:
    """Megatron-FSDP's groups are the world's backend: gloo wherever the rank is on CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend() == "gloo"
    return device.type == "cpu"


SHIMS: tuple[Shim, ...] = (
    Shim(
        name=FSDP_GLOO_SERIAL_COALESCING,
        upstream="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
        why="Megatron-FSDP (param_and_grad_buffer.py:4038, 4132, 4542, 4561) batches its reduce-scatters and its "
        "asynchronous parameter all-gathers in torch's _coalescing_manager; on gloo, torch 2.14.1's "
        "ProcessGroupGloo coalesced collectives corrupt the heap now and then (SIGSEGV in "
        "reduce_scatter_single_coalesced, 'malloc(): unaligned tcache chunk detected' in a gloo worker thread "
        "in AsyncAllgatherCoalescedWork; 2 of 6 runs of the 7 resume entries): the recorded collectives "
        "are issued one at a time, synchronously, at the block's end",
        probe="Megatron-FSDP's process group is gloo",
        retire_when="never on NCCL; on gloo when torch's coalesced collectives run Megatron-FSDP's resume "
        "entries without a crash (extended.yaml -k 'resume and mcore_fsdp' with the shim off, repeated)",
        kind=ADAPTS,
        apply=_serialize_fsdp_coalescing,
        needed=_fsdp_group_is_gloo,
        trigger=REQUIRE,
    ),
)
