"""Megatron-Bridge training checkpoints on CPU (harness.backends.bridge_training): the on-demand
shims its save_checkpoint / load_checkpoint need where there is no GPU. Each is applied because its
condition is detected (the call raises, the tracker holds no state), never by version."""

from __future__ import annotations

import torch

from harness.compat._shim import ADAPTS, REQUIRE, Shim, fails

CUDA_RNG_STATE = "torch.cuda.get_rng_state on CPU"
RNG_TRACKER_STATE = "megatron RNG tracker holds a state on CPU"


def _cpu_rng_state(device: str | int | torch.device = "cuda") -> torch.Tensor:
    return torch.get_rng_state().clone()


def _seed_tracker() -> None:
    from harness.compat.verl import verl_rng_tracker_state

    verl_rng_tracker_state(0)  # the same stand-in verl's C1 gives: one named state, set_states keeps it


def _tracker_needs_state(device: torch.device) -> bool:
    from harness.compat.verl import rng_tracker_needs_state

    return rng_tracker_needs_state()


SHIMS: tuple[Shim, ...] = (
    Shim(
        name=CUDA_RNG_STATE,
        upstream="torch.cuda",
        why="Bridge's get_rng_state (training/checkpointing.py) calls torch.cuda.get_rng_state() unconditionally, on save "
        "and on load (the load builds its RNG template with it); a CPU rank raises ('Cannot re-initialize CUDA in "
        "forked subprocess'): answered with the CPU generator's state, which the rng check then follows",
        probe="torch.cuda.get_rng_state() raises",
        retire_when="when Bridge asks torch.cuda.is_available() before reading the CUDA generator",
        kind=ADAPTS,
        apply=lambda: setattr(torch.cuda, "get_rng_state", _cpu_rng_state),
        needed=lambda device: fails(torch.cuda.get_rng_state),
        trigger=REQUIRE,
    ),
    Shim(
        name=RNG_TRACKER_STATE,
        upstream="megatron.core.tensor_parallel.random",
        why="a CPU rank's megatron RNG tracker is the inference tracker with no states; Bridge's load raises KeyError on an "
        "empty rng_tracker_states and then sys.exit()s (exit code 0: the rank vanishes): seeded with one state, as "
        "verl's C1 does",
        probe="megatron's RNG tracker is the inference tracker or holds no state",
        retire_when="when the CPU path seeds a real CudaRNGStatesTracker (model_parallel_cuda_manual_seed on CPU)",
        kind=ADAPTS,
        apply=_seed_tracker,
        needed=_tracker_needs_state,
        trigger=REQUIRE,
    ),
)
