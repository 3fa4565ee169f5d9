"""Fault-injecting doubles of the mcore_fsdp backend (tests/test_fsdp.py), in the style of
tests/doubles.py: each damages what a correct fsdp_dtensor save writes, or skips one step of a
correct load, the way a real defect would. Named by import path (`doubles_fsdp:DropShard`)."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from harness.backends.mcore_fsdp import McoreFsdp

#: the model tensor the key-dropping doubles remove (not a SwiGLU fc1 half, not a norm)
DROPPED = "layers.0.self_attention.linear_proj.weight"


def drop_chunk(directory: Path, writer_rank: int = 1) -> str:
    """Cut from DCP's index (`.metadata`) the chunk `writer_rank` wrote of the first model tensor it
    holds a shard of: the bytes stay on disk, the checkpoint no longer says where that shard is.
    Returns the tensor's key."""
    path = Path(directory) / ".metadata"
    meta = pickle.loads(path.read_bytes())
    index = min((i for i, s in meta.storage_data.items()
                 if i.fqn.startswith("model.") and s.relative_path.startswith(f"__{writer_rank}_")), key=lambda i: i.fqn)
    fqn = index.fqn
    del meta.storage_data[index]
    tensor = meta.state_dict_metadata[fqn]
    tensor.chunks = [c for c in tensor.chunks if tuple(c.offsets) != tuple(index.offset)]
    path.write_bytes(pickle.dumps(meta))
    return fqn


class DropShard(McoreFsdp):
    """After a correct weights save (not the re-save), rank 1's shard of one model tensor is gone
    from the checkpoint's index (`drop_chunk`)."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.is_rank0 and not Path(directory).name.endswith("resaved"):
            drop_chunk(Path(directory))
        dist.barrier()


class DropKey(McoreFsdp):
    """Every rank leaves one model tensor (DROPPED) out of the state dict it saves (not the re-save)."""

    def _write(self, ctx, state, model, directory):
        if not Path(directory).name.endswith("resaved"):
            state = {**state, "model": {k: v for k, v in state["model"].items() if DROPPED not in k}}
        super()._write(ctx, state, model, directory)


class DropExpAvg(McoreFsdp):
    """Every rank saves the optimizer state of one param (DROPPED) without its exp_avg."""

    def _write(self, ctx, state, model, directory):
        if "optimizer" in state:
            opt = dict(state["optimizer"])
            opt["state"] = {k: ({s: t for s, t in v.items() if s != "exp_avg"} if DROPPED in k else v) for k, v in opt["state"].items()}
            state = {**state, "optimizer": opt}
        super()._write(ctx, state, model, directory)


@contextmanager
def _no_model_load() -> Iterator[None]:
    from megatron.bridge.training import checkpointing

    real = checkpointing._load_model_state_dict
    checkpointing._load_model_state_dict = lambda module, state_dict, strict: None
    try:
        yield
    finally:
        checkpointing._load_model_state_dict = real


class SkipInstall(McoreFsdp):
    """A weights load that reads the checkpoint into the DTensors (torch DCP, in place) but never
    hands the state to the adapter's load_state_dict, so Megatron-FSDP never installs the loaded
    main weights into the weights its forward computes with."""

    def load(self, ctx, model, directory):
        with _no_model_load():
            super().load(ctx, model, directory)
