"""Megatron's process-wide parallel state for one rank: set up for a topology, seeded, torn down.
Its own room because the builders (mcore, bridge, mbridge) and the launcher's teardown need it
and none of them should import another for it."""

from __future__ import annotations

import torch

from harness.core.topology import Topology


def rank_device() -> torch.device:
    """The device of this rank's model: its GPU on an NCCL rank (the launcher set it), else CPU
    (gloo ranks hide GPUs before CUDA initialises)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(topo: Topology) -> None:
    """parallel_state for `topo`; CP>1 lives only here (see `build_gpt`). The expert groups
    (ep x etp, expert-data-parallel) are megatron-core's own derivation from the same sizes."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        virtual_pipeline_model_parallel_size=topo.vpp if topo.vpp > 1 else None,
        context_parallel_size=topo.cp,
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.etp,
    )


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's RNG tracker; model_parallel_cuda_manual_seed needs CUDA."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def teardown_parallel_state() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
