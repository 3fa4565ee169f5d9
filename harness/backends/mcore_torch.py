"""Megatron-LM's legacy `--ckpt-format torch` with the distributed optimizer: one pickle per
model-parallel rank and the optimizer's parameter state gathered on each DP group's rank 0.

What megatron/training/checkpointing.py writes for `--ckpt-format torch --use-distributed-optimizer`
(older runs, and the format a torch_dist checkpoint is converted to and from):

  <root>/latest_checkpointed_iteration.txt      the tracker, written last by rank 0
  <root>/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
        written by a rank whose DP or expert-DP rank is 0: `model` (one chunk) or `model0`, `model1`, ...
        (virtual pipeline stages), each chunk's `state_dict_for_save_checkpoint()`; `optimizer`:
        `DistributedOptimizer.state_dict()` (the param groups and step, no tensors); `opt_param_scheduler`,
        `iteration`, `checkpoint_version`
  <root>/iter_NNNNNNN/mp_rank_.../distrib_optim.pt
        `DistributedOptimizer.save_parameter_state`: every DP rank's main params and Adam moments
        gathered (`get_parameter_state_dp_zero`) and written by DP rank 0

The load mirrors Megatron-LM's: each rank reads the file its own TP/PP/EP ranks name (`torch.load(...,
map_location="cpu")`, torch's weights-only unpickler), `load_state_dict` on each chunk (strict, the
harness's rule; Megatron-LM retries a failing strict load non-strict), `DistributedOptimizer.load_state_dict`,
then `load_parameter_state` (DP rank 0 reads, `load_parameter_state_from_dp_zero` scatters). So a DP
change loads, while a TP/PP/EP change finds another rank's shard or no file at all: the format was never
reshardable across model parallelism. The optimizer state is the same gathered form megatron-core's
torch_dist `dp_zero_gather_scatter` sharding writes, so a case asks for that sharding.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.backends._megatron_lm import CHECKPOINT_VERSION, TRACKER, restore_scheduler, write_tracker
from harness.core.context import RankContext
from harness.run.events import record_event

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
SHARDING = "dp_zero_gather_scatter"  # the optimizer state's form in distrib_optim.pt


def rank_dir(iteration_dir: Path) -> Path:
    """This rank's `mp_rank_...` directory, named as Megatron-LM's get_checkpoint_name names it: the TP
    rank, the PP rank when PP > 1, the EP rank when EP > 1."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return Path(iteration_dir) / name


def tracked_iteration(root: Path) -> Path:
    """The iteration directory the root's tracker names; a root without a tracker is refused by name."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"{root}: no {TRACKER}, not a Megatron-LM checkpoint root")
    it = tracker.read_text().strip()
    return Path(root) / ("release" if it == "release" else f"iter_{int(it):07d}")


def _chunk_keys(chunks: list) -> list[str]:
    """Megatron-LM's state keys for the model: `model` for one chunk, `model<i>` per virtual stage."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _writes_model_file() -> bool:
    """Megatron-LM: every unique (TP, EP) shard is written once, by a rank whose DP or expert-DP rank is 0."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0


def _args(step: int, with_optim: bool) -> argparse.Namespace:
    """The run's args as Megatron-LM pickles them (megatron-core registers argparse.Namespace with torch's
    weights-only unpickler, so its own load reads them back): the parallel sizes and what was saved."""
    from megatron.core import parallel_state as ps

    return argparse.Namespace(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        use_distributed_optimizer=True, no_save_optim=not with_optim, no_save_rng=True, ckpt_format="torch",
        iteration=step)


def _load(path: Path) -> dict[str, Any]:
    """torch.load as Megatron-LM's legacy load calls it (map_location cpu, torch's weights-only unpickler)
    with the classes megatron-core allows it (its `safe_globals.SAFE_GLOBALS`: argparse.Namespace, ...,
    registered process-wide on import; named here for this call, whatever else changed the process's
    list since): never an arbitrary object. A Core without that module allows nothing beyond torch's own."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        SAFE_GLOBALS = []
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(path, map_location="cpu", weights_only=True)


class McoreTorch(Backend):
    name = "mcore_torch"
    capabilities = frozenset({"training_state"})
    # what a load at another model-parallel layout raises: no file for this rank, or a shard of another size
    refusals = ("FileNotFoundError", "RuntimeError")

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        sharding = getattr(opts, "sharding", None)
        if sharding is not None and sharding != SHARDING:
            raise ValueError(f"backend mcore_torch saves the distributed optimizer's state gathered on each DP group's "
                             f"rank 0 (distrib_optim.pt, the form of sharding {SHARDING!r}): sharding {sharding!r} "
                             "does not apply; use sharding: dp_zero_gather_scatter")
        if getattr(opts, "use_distributed_optimizer", True) is False:
            raise ValueError("backend mcore_torch writes Megatron-LM's --use-distributed-optimizer layout (distrib_optim.pt)")

    # ------------------------------------------------------------------ weights (Megatron-LM --no-save-optim)

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """The model chunks only, as Megatron-LM's `--ckpt-format torch --no-save-optim` writes them."""
        self._write(list(model), None, None, 0, Path(directory))

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        self._read_model(list(model), self._read(Path(directory)))

    # ------------------------------------------------------------------ training checkpoints

    def save_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        self._write(job.chunks, job.optimizer if job.save_optim else None, job.scheduler, job.step, Path(directory))

    def load_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        state = self._read(Path(directory))
        self._read_model(job.chunks, state)
        if "optimizer" not in state:  # Megatron-LM prints this, then re-raises the KeyError
            raise RuntimeError(f"Unable to load optimizer from checkpoint {self._where}: it holds no optimizer state (saved "
                               "with --no-save-optim). Specify --no-load-optim or --finetune to prevent attempting to load "
                               "the optimizer state")
        job.optimizer.load_state_dict(state["optimizer"])
        job.optimizer.load_parameter_state(str(self._where.parent / OPTIM_FILE))
        restore_scheduler(job, state)
        record_event({"op": "load", "file": str(self._where), "iteration": state.get("iteration")}, self.name)

    # ------------------------------------------------------------------ the files

    def _write(self, chunks: list, optimizer: Any, scheduler: Any, step: int, root: Path) -> None:
        where = rank_dir(root / f"iter_{step:07d}")
        where.mkdir(parents=True, exist_ok=True)  # every rank, as Megatron-LM's ensure_directory_exists
        if optimizer is not None:  # collective over each DP group; its rank 0 writes
            optimizer.save_parameter_state(str(where / OPTIM_FILE))
        if _writes_model_file():
            state: dict[str, Any] = {k: c.state_dict_for_save_checkpoint() for k, c in zip(_chunk_keys(chunks), chunks)}
            if optimizer is not None:
                state["optimizer"] = optimizer.state_dict()
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler.state_dict()
            state.update(args=_args(step, optimizer is not None), iteration=step, checkpoint_version=CHECKPOINT_VERSION)
            torch.save(state, where / MODEL_FILE)
        dist.barrier()  # Megatron-LM: everyone is done before the tracker names the iteration
        if dist.get_rank() == 0:
            write_tracker(root, step)
        dist.barrier()
        record_event({"op": "save", "file": str(where / MODEL_FILE), "optimizer": optimizer is not None}, self.name)

    def _read(self, root: Path) -> dict[str, Any]:
        self._where = rank_dir(tracked_iteration(root)) / MODEL_FILE
        if not self._where.is_file():
            raise FileNotFoundError(f"{self._where}: no checkpoint file for this rank's model-parallel ranks (a torch-format "
                                    "checkpoint loads only at the TP/PP/EP layout it was saved at)")
        return _load(self._where)

    def _read_model(self, chunks: list, state: dict[str, Any]) -> None:
        for key, chunk in zip(_chunk_keys(chunks), chunks):
            if key not in state:
                raise KeyError(f"{self._where}: no {key!r} entry (the checkpoint holds {sorted(state)})")
            chunk.load_state_dict(state[key], strict=True)

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """The model tensors of a checkpoint saved without model parallelism (one `mp_rank_00` file): a
        torch-format file holds a rank's shards without the dims they were split on, so more ranks are refused."""
        it = tracked_iteration(Path(directory))
        ranks = sorted(p.name for p in it.glob("mp_rank_*"))
        if ranks != ["mp_rank_00"]:
            raise ValueError(f"{it}: {len(ranks)} model-parallel rank directories ({', '.join(ranks[:4])}...): a torch-format "
                             "checkpoint records no split dims, so only a TP=PP=EP=1 checkpoint reads whole")
        state = _load(it / "mp_rank_00" / MODEL_FILE)
        return {f"{k}.{name}": t for k in state if k == "model" or k[5:].isdigit() and k.startswith("model")
                for name, t in state[k].items() if isinstance(t, torch.Tensor)}


BACKEND = McoreTorch()
