"""The one rank hook a shipped case needs (interrupted-save's `kill-after-shard`): it travels to the
ranks as an import path, so it lives in the package; every other fault double is a test's
(tests/doubles.py)."""

from __future__ import annotations


def kill_last_rank_before_save_finalize() -> None:
    """The last rank SIGKILLs itself when its second megatron-core torch_dist save (the first one
    completes: the good checkpoint a resume should fall back to) reaches its finalize step
    (megatron-core 0.19.2 strategies/state_dict_saver.py `save_state_dict_async_finalize`): by
    then every rank has written its own .distcp files and passed the barrier after the writes
    (AsyncRequest.execute_sync), but nothing has gathered the write results, so the coordinator
    never writes torch DCP's `.metadata` and serialization.save never writes `metadata.json`.
    That is a preemption between "my shard is on disk" and "the checkpoint is finalised", the
    window a resuming job must not mistake for a checkpoint (interrupted-save, kill-after-shard).

    The last rank is never the coordinator (rank 0), so the coordinator sits in the gather when
    its peer dies. RANK/WORLD_SIZE are set by both launchers before hooks run. The wrapper is
    looked up at call time (torch.py's _import_mcore_async imports the name on every save)."""
    import os
    import signal

    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    if int(os.environ["RANK"]) != int(os.environ["WORLD_SIZE"]) - 1:
        return
    real = state_dict_saver.save_state_dict_async_finalize
    calls = [0]

    def finalize(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    state_dict_saver.save_state_dict_async_finalize = finalize
