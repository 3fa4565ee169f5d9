"""Every ShardedTensor each model-parallel rank of a topology would save or load, as plain records.

One process plays each rank in turn: torch's fake process group (collectives move no data) and
the meta device (no tensor is allocated), re-initialised per rank with destroy_model_parallel +
destroy_process_group (measured: works with megatron-core 0.19.2). Only one rank per distinct
model-parallel coordinate (tp, pp, etp, ep) is built: data-parallel and context-parallel ranks hold
replicas of the same state, and their replica ids are what a save tells apart. Which rank sits at
which coordinate is megatron-core's own RankGenerator's answer (parallel_state's order
tp-cp-ep-dp-pp; the expert side tp-ep-dp-pp with tp = etp), not arithmetic of ours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.compat.cuda import current_device_scope
from harness.core.topology import Topology
from harness.models.mcore import sharded_tensors
from harness.plan.model import PlanInputError, PlanModel

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
#: megatron-core's default rank order (initialize_model_parallel `order`)
ORDER = "tp-cp-ep-dp-pp"


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


def rank_coordinates(topo: Topology) -> list[dict[str, int]]:
    """Per global rank, its rank in each group: tp, cp, dp, pp (the dense side) and etp, ep, edp (the
    expert side), from megatron-core's RankGenerator as initialize_model_parallel builds both."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=topo.tp, ep=1, dp=topo.dp, pp=topo.pp, cp=topo.cp, order=ORDER)
    expert = RankGenerator(tp=topo.etp, ep=topo.ep, dp=topo.expert_dp, pp=topo.pp, cp=1, order=ORDER)
    out: list[dict[str, int]] = [{} for _ in range(topo.world_size)]
    for gen, names in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
                       (expert, {"tp": "etp", "ep": "ep", "dp": "edp"})):
        for token, name in names.items():
            for group in gen.get_ranks(token):
                for i, r in enumerate(group):
                    out[r][name] = i
    return out


def coordinate_ranks(topo: Topology) -> list[int]:
    """The lowest global rank of each distinct (tp, pp, etp, ep) coordinate, ascending: dp and cp
    ranks are replicas (built once), and the lowest rank is dp, cp and expert-dp rank 0 of its
    coordinate wherever one is. Refuses a topology where (tp, pp, ep), the coordinate the
    predictions key rows by (harness/plan/predict.py, memory.py), would name two built ranks
    (etp not dividing tp)."""
    first: dict[tuple[int, int, int, int], int] = {}
    for rank, c in enumerate(rank_coordinates(topo)):
        first.setdefault((c["tp"], c["pp"], c["etp"], c["ep"]), rank)
    if len({(t, p, e) for t, p, _, e in first}) != len(first):
        raise PlanInputError(f"topology {topo.id}: etp={topo.etp} does not divide tp={topo.tp}; the plan's per-coordinate "
                             "predictions key ranks by (tp, pp, ep) and would merge two expert-tensor ranks")
    return sorted(first.values())


Split = tuple[int | None, int | None]


def pipeline_split(model: PlanModel, topo: Topology, first: int | str | None = None,
                   last: int | str | None = None) -> Split:
    """(num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage) for megatron-core.
    Uneven stages only on request (a topology whose layers do not divide stays refused otherwise):
    ints as given (megatron-core's TransformerConfig checks them); "auto" where the layers do not
    divide over pp*vpp derives the split Megatron-LM users write for DeepSeek-V3's 61 layers: the
    middle stages hold ceil(layers / pp) rounded up to a multiple of vpp, the first and last stages
    share the rest (the first the larger half), each a multiple of vpp."""
    if topo.pp == 1 or (first is None and last is None):  # one stage holds every layer, or even stages asked
        return None, None
    if "auto" not in (first, last):
        return (None if first is None else int(first)), (None if last is None else int(last))
    chunk = topo.vpp
    if model.num_layers % (topo.pp * chunk) == 0:
        return None, None
    middle = -(-model.num_layers // topo.pp)
    middle = -(-middle // chunk) * chunk
    rest = model.num_layers - (topo.pp - 2) * middle
    tail = (rest // 2) // chunk * chunk
    if rest <= 0 or tail <= 0 or (rest - tail) % chunk:
        raise PlanInputError(f"topology {topo.id}: no uneven split of {model.num_layers} layers over pp={topo.pp} "
                             f"vpp={chunk} derived; give --first-stage-layers/--last-stage-layers N")
    return rest - tail, tail


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def moe_layer_pattern(model: PlanModel) -> list[int] | None:
    """megatron-core's moe_layer_freq as a per-layer list (1 MoE, 0 dense), or None (every layer alike)."""
    if not model.num_moe_experts:
        return None
    if model.moe_layer_freq:
        return list(model.moe_layer_freq)
    if model.first_k_dense:
        return [0] * model.first_k_dense + [1] * (model.num_layers - model.first_k_dense)
    return None


def transformer_config(model: PlanModel, topo: Topology, split: Split = (None, None)):
    """The model's config at `topo` as Megatron-LM builds it; MLA models (DeepSeek-V3) an MLATransformerConfig.
    context_parallel_size stays 1: the local DotProductAttention asserts it, and the CP group that
    decides replica ids is parallel_state's (as harness/models/mcore.py builds CP worlds)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = _torch_dtype(model.dtype)
    extra: dict[str, Any] = {}
    if model.num_moe_experts:
        extra = dict(num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk or 1,
                     moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
                     moe_shared_expert_intermediate_size=model.moe_shared_expert_size,
                     expert_model_parallel_size=topo.ep, expert_tensor_parallel_size=topo.etp, moe_grouped_gemm=False,
                     # the dispatcher decides no checkpoint key; the alltoall one makes a CUDA stream when built
                     # (torch.cuda.Stream: fails on a CPU-only torch), the allgather one builds anywhere
                     moe_token_dispatcher_type="allgather")
        pattern = moe_layer_pattern(model)
        if pattern is not None:
            extra["moe_layer_freq"] = pattern
    if topo.vpp > 1:
        extra["virtual_pipeline_model_parallel_size"] = topo.vpp
    if split != (None, None):
        extra.update(num_layers_in_first_pipeline_stage=split[0], num_layers_in_last_pipeline_stage=split[1])
    cls = TransformerConfig
    if model.multi_latent_attention:
        cls = MLATransformerConfig
        extra.update(multi_latent_attention=True, q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
                     qk_head_dim=model.qk_head_dim, qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
                     v_head_dim=model.v_head_dim, rope_type="rope")
    else:
        extra.update(num_query_groups=model.num_query_groups, kv_channels=model.kv_channels)
    try:
        return cls(
            num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
            ffn_hidden_size=model.ffn_hidden_size, tensor_model_parallel_size=topo.tp,
            pipeline_model_parallel_size=topo.pp, gated_linear_unit=True, normalization="RMSNorm",
            add_bias_linear=False, qk_layernorm=model.qk_layernorm or model.multi_latent_attention,  # DeepSeek's q_a/kv_a norms
            use_cpu_initialization=True, perform_initialization=False, bf16=model.dtype == "bfloat16",
            fp16=model.dtype == "float16", params_dtype=dtype, pipeline_dtype=dtype, **extra)
    except (ValueError, AssertionError) as e:
        raise PlanInputError(f"topology {topo.id}: megatron-core refuses the config of {model.name}: {e}") from e


def layer_spec(model: PlanModel, config, vp_stage: int | None):
    """The local layer spec; for mixed dense/MoE layers or MLA megatron-core's decoder block spec of this
    (virtual) stage, as Megatron-LM builds it, with the CPU MLA core attention where MLA (the local
    DotProductAttention takes no differing k/v head dims: harness/models/cpu_attention.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if moe_layer_pattern(model) is None and not model.multi_latent_attention:
        return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_moe_experts, moe_grouped_gemm=False,
                                                        qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                       vp_stage=vp_stage)
    if model.multi_latent_attention:
        from harness.models.cpu_attention import localize_mla

        block = localize_mla(block)
    return block


def build_chunks(model: PlanModel, topo: Topology, split: Split = (None, None)) -> list:
    """This rank's model chunks on meta, as megatron-core's get_model builds them: one GPTModel per
    virtual stage (vp_stage=i; one without vpp). Needs parallel_state initialised."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(model, topo, split)
    chunks = []
    with torch.device("meta"), current_device_scope():  # MLA RotaryEmbedding, rotary_pos_embedding.py:78
        for vp in range(topo.vpp) if topo.vpp > 1 else (None,):
            chunks.append(GPTModel(
                config=cfg, transformer_layer_spec=layer_spec(model, cfg, vp), vocab_size=model.padded_vocab(topo.tp),
                max_sequence_length=model.seq_length, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), position_embedding_type="rope",
                share_embeddings_and_output_weights=model.tied, vp_stage=vp))
    return chunks


def rank_records(model: PlanModel, topo: Topology, rank: int,
                 split: Split = (None, None)) -> list[Record]:
    """Be `rank` of `topo` for a moment: its model chunks on meta, their sharded_state_dicts as records."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=topo.world_size, store=FakeStore())
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=topo.tp, pipeline_model_parallel_size=topo.pp,
                                     virtual_pipeline_model_parallel_size=topo.vpp if topo.vpp > 1 else None,
                                     context_parallel_size=topo.cp, expert_model_parallel_size=topo.ep,
                                     expert_tensor_parallel_size=topo.etp, order=ORDER,
                                     create_gloo_process_groups=False)  # gloo on a FakeStore segfaults
        chunks = build_chunks(model, topo, split)
        # Megatron-LM's layout: one chunk's dict as it is, several under model0, model1, ... (keys inside are global)
        sharded = chunks[0].sharded_state_dict() if len(chunks) == 1 else {
            f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
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


def check_topology(model: PlanModel, topo: Topology, split: Split = (None, None)) -> None:
    """topo.validate, with the layer-count rule left to megatron-core where the pipeline split is uneven."""
    from dataclasses import replace

    shape = model if split == (None, None) else replace(model, num_layers=topo.pp * topo.vpp)
    try:
        topo.validate(shape)
    except ValueError as e:
        hint = " (uneven pipeline stages: --first-stage-layers/--last-stage-layers N or auto)" if "num_layers=" in str(e) else ""
        raise PlanInputError(f"{e}{hint}") from e
    if split != (None, None):
        transformer_config(model, topo, split)  # megatron-core's own checks of the split


def topology_records(model: PlanModel, topo: Topology, progress=None, first: int | str | None = None,
                     last: int | str | None = None) -> list[Record]:
    """Every record of every distinct model-parallel coordinate of `topo` (`first`/`last`: layers in the
    first/last pipeline stage, pipeline_split)."""
    from harness.compat.cuda import guard_megatron_import

    guard_megatron_import()
    split = pipeline_split(model, topo, first, last)
    check_topology(model, topo, split)
    records: list[Record] = []
    ranks = coordinate_ranks(topo)
    for i, rank in enumerate(ranks):
        records += rank_records(model, topo, rank, split)
        if progress:
            progress(topo, i + 1, len(ranks))
    return records
