"""Megatron-LM's on-disk training checkpoint around a torch_dist checkpoint (what
megatron/training/checkpointing.py save_checkpoint writes, and what Megatron-Bridge reads as a
"legacy Megatron-LM checkpoint"): `<root>/iter_NNNNNNN/` holding the dist checkpoint, whose common
state carries `args` (the run's argparse Namespace), `iteration`, `checkpoint_version` and
`opt_param_scheduler`, and `<root>/latest_checkpointed_iteration.txt` naming the iteration.

mcore_dist writes it with option `layout: megatron-lm` (no run_config.yaml, no train_state.pt:
those are Bridge's) and reads any such root, Megatron-Bridge's included."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's since 2021


def iteration_dir(directory: Path) -> Path:
    """The iteration a checkpoint root's tracker file names (`iter_NNNNNNN/` or `release/`), as
    Megatron-LM's `--load` resolves it; a directory that is a dist checkpoint itself is returned as is."""
    tracker = Path(directory) / TRACKER
    if not tracker.is_file() or (Path(directory) / "metadata.json").is_file():
        return Path(directory)
    it = tracker.read_text().strip()
    return Path(directory) / ("release" if it == "release" else f"iter_{int(it):07d}")


def common_state(job: Any, fully_parallel_save: bool, consumed_samples: int) -> dict[str, Any]:
    """The common (non-sharded) entries of Megatron-LM's training save for this job: the args
    Megatron-Bridge reads back from a legacy checkpoint (parallel sizes, what was saved, the
    consumed samples), the iteration, the checkpoint version and the scheduler's state."""
    from megatron.core import parallel_state as ps

    args = argparse.Namespace(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        use_distributed_optimizer=job.sharding is not None, no_save_optim=False, no_save_rng=True,
        ckpt_fully_parallel_save=fully_parallel_save, ckpt_format="torch_dist", iteration=job.step,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, skipped_train_samples=0,
    )
    state: dict[str, Any] = {"args": args, "iteration": job.step, "checkpoint_version": CHECKPOINT_VERSION}
    if job.scheduler is not None:
        state["opt_param_scheduler"] = job.scheduler.state_dict()
    return state


def write_tracker(root: Path, iteration: int) -> None:
    """Rank 0, after every rank's save: Megatron-LM writes the tracker last, so a root whose save
    did not finish still names the previous iteration."""
    (Path(root) / TRACKER).write_text(str(iteration))


def restore_scheduler(job: Any, state: dict[str, Any]) -> bool:
    """The scheduler state a Megatron-LM or Megatron-Bridge checkpoint carries (`opt_param_scheduler`,
    or the older `lr_scheduler`) into the job's scheduler; whether there was one to restore."""
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    if saved is None or job.scheduler is None:
        return False
    job.scheduler.load_state_dict(saved)
    return True
