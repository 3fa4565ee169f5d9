"""Probe (run as a script by tests/test_async.py): megatron-core's persistent async checkpoint
worker (PersistentAsyncCaller), scheduled from a one-rank gloo job. Prints one line:
`returned=<bool> worker_alive=<bool>` after at most DEADLINE seconds of schedule_async_call."""

import os
import sys
import threading

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest, PersistentAsyncCaller

DEADLINE = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0


def write(*args, **kwargs) -> None:
    """The save's work (nothing: the probe asks whether the request is taken at all)."""


def preload() -> dict:
    return {}


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[2] if len(sys.argv) > 2 else "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    caller = PersistentAsyncCaller()
    request = AsyncRequest(write, (None, None, None), [], preload_fn=preload)
    t = threading.Thread(target=caller.schedule_async_call, args=(request,), daemon=True)
    t.start()
    t.join(DEADLINE)
    worker = PersistentAsyncCaller._persistent_process
    print(f"returned={not t.is_alive()} worker_alive={worker is not None and worker.is_alive()}", flush=True)
    if worker is not None:
        worker.kill()
    os._exit(0)
