"""Every ShardedTensor each model-parallel rank of a topology would save or load, as plain records.

One process plays each rank in turn: torch's fake process group (collectives move no data) and
the meta device (no tensor is allocated), re-initialised per rank with destroy_model_parallel +
destroy_process_group (measured: works with megatron-core 0.19.2). Only one rank per distinct
model-parallel coordinate (tp, pp, ep) is built: the data-parallel ranks hold replicas of the same
state, and their replica ids are what a save tells apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.topology import Topology
from harness.models.mcore import sharded_tensors
from harness.plan.model import PlanInputError, PlanModel

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class Record:
    """One ShardedTensor of one rank: where its box sits in the global tensor (offset and local
    shape have the tensor's full rank: prepended axes, e.g. the layer axis, count as size 1)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    replica_id: tuple[int, ...]
    rank: int
    coord: tuple[int, int, int]  # (tp rank, pp rank, ep rank)

    @property
    def main(self) -> bool:
        return not any(self.replica_id)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_json(self) -> dict:
        return {"key": self.key, "global_shape": list(self.global_shape), "global_offset": list(self.global_offset),
                "local_shape": list(self.local_shape), "dtype": self.dtype, "replica_id": list(self.replica_id),
                "rank": self.rank, "coord": list(self.coord)}


def coordinate_ranks(topo: Topology) -> list[int]:
    """One global rank per distinct (tp, pp, ep) coordinate, in megatron-core's default order
    (tp-cp-ep-dp-pp; with cp 1 and etp = tp the ep rank is the low part of the dp rank)."""
    if topo.cp != 1 or topo.vpp != 1 or topo.etp != topo.tp:
        raise PlanInputError(f"topology {topo.id}: this planner handles cp 1, vpp 1 and etp = tp only")
    stage = topo.tp * topo.dp
    return [t + topo.tp * e + stage * p for p in range(topo.pp) for e in range(topo.ep) for t in range(topo.tp)]


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def transformer_config(model: PlanModel, topo: Topology):
    from megatron.core.transformer import TransformerConfig

    dtype = _torch_dtype(model.dtype)
    moe: dict[str, Any] = {}
    if model.num_moe_experts:
        moe = dict(num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk or 1,
                   moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
                   moe_shared_expert_intermediate_size=model.moe_shared_expert_size,
                   expert_model_parallel_size=topo.ep, moe_grouped_gemm=False,
                   # the dispatcher decides no checkpoint key; the alltoall one makes a CUDA stream when built
                   # (torch.cuda.Stream: fails on a CPU-only torch), the allgather one builds anywhere
                   moe_token_dispatcher_type="allgather")
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size, kv_channels=model.kv_channels,
        tensor_model_parallel_size=topo.tp, pipeline_model_parallel_size=topo.pp, gated_linear_unit=True,
        normalization="RMSNorm", add_bias_linear=False, qk_layernorm=model.qk_layernorm,
        use_cpu_initialization=True, perform_initialization=False, bf16=model.dtype == "bfloat16",
        fp16=model.dtype == "float16", params_dtype=dtype, pipeline_dtype=dtype, **moe)


def rank_records(model: PlanModel, topo: Topology, rank: int) -> list[Record]:
    """Be `rank` of `topo` for a moment: its GPTModel on meta, its sharded_state_dict as records."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=topo.world_size, store=FakeStore())
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=topo.tp, pipeline_model_parallel_size=topo.pp,
                                     expert_model_parallel_size=topo.ep,
                                     create_gloo_process_groups=False)  # gloo on a FakeStore segfaults
        cfg = transformer_config(model, topo)
        spec = get_gpt_layer_local_spec(num_experts=model.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
        with torch.device("meta"):
            gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=model.padded_vocab(topo.tp),
                           max_sequence_length=model.seq_length, pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
                           share_embeddings_and_output_weights=model.tied)
        sharded = gpt.sharded_state_dict()
        apply_factories(sharded)
        coord = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                 ps.get_expert_model_parallel_rank())
        out = []
        for sh in sharded_tensors(sharded):
            box = [(s.start, s.stop) if isinstance(s, slice) else (int(s), int(s) + 1) for s in sh.global_slice()]
            rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
            out.append(Record(key=sh.key, global_shape=tuple(sh.global_shape), global_offset=tuple(b[0] for b in box),
                              local_shape=tuple(b[1] - b[0] for b in box), dtype=str(sh.dtype).removeprefix("torch."),
                              replica_id=tuple(int(r) for r in rid), rank=rank, coord=coord))
        return out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def topology_records(model: PlanModel, topo: Topology, progress=None) -> list[Record]:
    """Every record of every distinct model-parallel coordinate of `topo`."""
    from harness.compat.cuda import guard_megatron_import

    guard_megatron_import()
    try:
        topo.validate(model)
    except ValueError as e:
        raise PlanInputError(f"topology {topo.id} cannot hold model {model.name}: {e}") from e
    records: list[Record] = []
    ranks = coordinate_ranks(topo)
    for i, rank in enumerate(ranks):
        records += rank_records(model, topo, rank)
        if progress:
            progress(topo, i + 1, len(ranks))
    return records
