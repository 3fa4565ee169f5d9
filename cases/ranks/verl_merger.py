"""The rank side of verl-merger (and verl-lora-lifecycle's merge): one rank of verl's model_merger
started as `torchrun -m verl.model_merger merge ...` starts it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from harness.core.context import RankContext


@dataclass(frozen=True)
class Merge:
    actor_dir: str
    target_dir: str
    tied: bool


def merger_argv(p: Merge, cpu: bool) -> list[str]:
    """The merger's command line, as verl's docs write it: --tie-word-embedding for a tied model, and on a
    CPU rank the flag its help gives for building the model on the host (--use_cpu_initialization)."""
    return ["verl.model_merger", "merge", "--backend", "megatron", "--local_dir", p.actor_dir, "--target_dir", p.target_dir,
            *(["--tie-word-embedding"] if p.tied else []), *(["--use_cpu_initialization"] if cpu else [])]


def merger_rank(ctx: RankContext, p: Merge) -> dict[str, Any]:
    """One rank of `torchrun -m verl.model_merger merge ...`: the harness's group ends here, the
    merger starts its own from the torchrun environment (a port rank 0 found free)."""
    import torch.distributed as dist

    from harness.compat import require
    from harness.compat.bridge_training import CUDA_RNG_STATE
    from harness.compat.verl import mbridge_te_spec
    from harness.compat.verl_platform import use_cpu_platform
    from harness.models.parallel import teardown_parallel_state
    from harness.run.nodes import free_port

    port = [free_port() if ctx.rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    teardown_parallel_state()
    dist.destroy_process_group()
    use_cpu_platform()
    mbridge_te_spec()  # init_mcore_model asks megatron-core for its Transformer-Engine layer spec
    from harness.models.cpu_experts import te_spec_grouped_experts

    te_spec_grouped_experts()  # and its grouped experts (verl's MoE configs set moe_grouped_gemm) under TE's names
    require(CUDA_RNG_STATE)  # the merger seeds megatron's CUDA RNG tracker (model_parallel_cuda_manual_seed(0))
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.local_rank), WORLD_SIZE=str(ctx.world_size),
                      LOCAL_WORLD_SIZE=str(ctx.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # under torchrun: the merger's group is its own, not the agent's
    from verl.model_merger.__main__ import main

    argv, sys.argv = sys.argv, merger_argv(p, ctx.device.type == "cpu")
    try:
        main()
    finally:
        sys.argv = argv
    return {"rank": ctx.rank}
