"""The rank hooks shipped cases need (interrupted-save's `kill-after-shard`, async-save's kills of an
async write in flight): they travel to the ranks as import paths, so they live in the package; every
other fault double is a test's (tests/doubles.py)."""

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


#: Set by async-save's victim rank around the one save to interrupt: "<writer|rank>:<record path>".
#: The forked writer inherits it; every other save of the job runs untouched.
ASYNC_KILL_ENV = "CKPT_HARNESS_ASYNC_KILL"


def _write_partially(transform_list: list, write_buckets: list) -> dict[str, int]:
    """What a writer killed mid-write leaves: the first bucket's .distcp whole, the next one (or the
    only one) cut to half its bytes, the rest never opened. Returns {file name: bytes on disk}."""
    import os

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    left: dict[str, int] = {}
    for i, bucket in enumerate(write_buckets[:2]):
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, None, None, True)
        path = bucket[0]
        if i == min(1, len(write_buckets) - 1):
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 2)
                os.fsync(fh.fileno())
        left[os.path.basename(path)] = os.path.getsize(path)
    return left


def kill_async_write_in_flight() -> None:
    """async-save's `kill-writer` / `kill-rank`: megatron-core's async writer (the function its
    TemporalAsyncCaller runs in a forked child, FileSystemWriterAsync.write_preloaded_data_multithread,
    megatron-core 0.19.2 strategies/filesystem_async.py) is replaced by one that, while ASYNC_KILL_ENV
    is set in the rank that forked it, writes part of the rank's shards (_write_partially), records
    what it left (JSON at the path the variable names, fsynced: the case reads it after the kill),
    then SIGKILLs the writer itself (`writer`: the OOM killer's way; the rank lives on and meets the
    loss at its finalize) or the rank's whole process group (`rank`: a node lost mid-write; the
    harness starts every rank in a group of its own, so the rank, this writer and the rank's
    fork-mode results-queue manager die together: a manager left alive would hold the rank's gloo
    sockets open and its peers would wait forever). Unset, the real writer runs. The write is in flight by construction: the rank has returned from its save
    and nothing has finalized it (the results queue never gets this writer's results)."""
    import json
    import os
    import signal

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data_multithread
    if getattr(real, "_ckpt_harness", False):
        return

    def in_flight(transform_list, use_msc, rank, write_buckets, results_queue):
        armed = os.environ.get(ASYNC_KILL_ENV)
        if not armed:
            return real(transform_list, use_msc, rank, write_buckets, results_queue)
        what, _, record = armed.partition(":")
        left = _write_partially(transform_list, write_buckets)
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, json.dumps({"kill": what, "rank": rank, "writer_pid": os.getpid(), "rank_pid": os.getppid(),
                                 "directory": os.path.dirname(write_buckets[0][0]), "left": left,
                                 "buckets": len(write_buckets)}).encode())
        os.fsync(fd)
        os.close(fd)
        if what == "rank":  # the rank's process group: the rank, this writer, its results-queue manager
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    in_flight._ckpt_harness = True
    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(in_flight)
