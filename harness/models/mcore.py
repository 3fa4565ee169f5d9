"""The Megatron side of a GPT zoo model: build it at a topology, fill it with the canonical
weights through its own sharding metadata, read back every rank's shards, run a forward pass.

What the weights should be is harness.core.truth; which models exist is harness.core.zoo.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal

import torch

from harness.core.parity import Shard
from harness.core.topology import Topology
from harness.core.truth import canonical_tensor
from harness.core.zoo import ModelSpec

#: Fused kernels that need CUDA (or Apex/TE): all off for a CPU build, GPT and Bridge models alike.
FUSIONS = (
    "gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "apply_rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
)


#: Megatron-LM's pipeline p2p setting for the interleaved schedule (training/arguments.py:
#: `--overlap-p2p-communication` is on by default, `batch_p2p_comm = not overlap_p2p_comm`; Megatron-
#: Bridge's CommOverlapConfig sets the same whenever vpp > 1). megatron-core's own TransformerConfig
#: defaults (MCORE_P2P_DEFAULTS) train wrong at PP=2 with vpp: compat.registry.get("vpp_overlap_p2p").
VPP_P2P: dict[str, bool] = {"overlap_p2p_comm": True, "batch_p2p_comm": False}
MCORE_P2P_DEFAULTS: dict[str, bool] = {"overlap_p2p_comm": False, "batch_p2p_comm": True}


#: The precision a GPT zoo model is built in (the `dtype` option of the GPT-zoo cases).
DType = Literal["fp32", "bf16"]
#: The transformer layer a GPT zoo model is built from (the `layer_spec` option of the GPT-zoo
#: cases): megatron-core's local modules (CPU and GPU, CP>1 only through parallel_state), or its
#: Transformer-Engine spec (GPU only; TEDotProductAttention runs CP>1 forwards as ring attention).
#: The TE spec fuses each pre-norm into the next linear, so its checkpoint keys differ
#: (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, no `input_layernorm`) and it
#: adds `_extra_state` objects; the truth is keyed by checkpoint key and global shape, so it holds.
LayerSpec = Literal["local", "te"]
#: Each DType's parameter (and pipeline activation) dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grouped_gemm_unavailable() -> str:
    """Why a zoo model with `moe_grouped_gemm` cannot be built with the local layer spec."""
    return ("grouped GEMM experts need layer_spec: te: megatron-core 0.19.2 builds them only as TEGroupedMLP "
            "(Transformer-Engine grouped linears); its legacy GroupedMLP (grouped_gemm package) is gone, and the local "
            "layer spec ignores moe_grouped_gemm and silently builds SequentialMLP (models/backends.py "
            "LocalSpecProvider.grouped_mlp_modules)")


def unavailable_reason(spec: ModelSpec, layer_spec: LayerSpec = "local") -> str | None:
    """Why this zoo model cannot be built with `layer_spec` (None: it can). Matrix validation refuses
    such an entry with this reason instead of building something else; with `te` a grouped-GEMM
    model builds (and the case needs te: not-run where Transformer-Engine is absent)."""
    if getattr(spec, "moe_grouped_gemm", False) and layer_spec != "te":
        return grouped_gemm_unavailable()
    return None


def moe_config(spec: ModelSpec, topo: Topology) -> dict[str, Any]:
    """The TransformerConfig fields of a MoE zoo model ({} for a dense one). The aux loss (router
    type "aux_loss") is deterministic: a function of each micro-batch's routing, whatever the topology."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_moe_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_size,
        moe_grouped_gemm=spec.moe_grouped_gemm,
        moe_token_dispatcher_type=spec.moe_token_dispatcher,
        moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.etp,
        **({"moe_layer_freq": list(spec.moe_layer_freq)} if getattr(spec, "moe_layer_freq", None) else {}),
    )


def transformer_config(spec: ModelSpec, topo: Topology, dtype: DType = "fp32", layer_spec: LayerSpec = "local", **overrides: Any):
    """The TransformerConfig of a zoo model at `topo`. bf16 sets what Megatron-LM's `--bf16` sets
    (bf16=True, params_dtype and pipeline_dtype bfloat16): params are created in bf16 and the
    pipeline sends bf16 activations between stages. The model config carries CP>1 only with the
    TE layer spec (see below). vpp sets the virtual pipeline size and Megatron-LM's p2p setting for
    the interleaved schedule (VPP_P2P)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        normalization=spec.normalization,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        virtual_pipeline_model_parallel_size=topo.vpp if topo.vpp > 1 else None,
        # The local (non-TE) DotProductAttention asserts context_parallel_size == 1. CP>1 is
        # exercised through parallel_state only, which is what decides shard and replica ids.
        context_parallel_size=topo.cp if layer_spec == "te" else 1,
        use_cpu_initialization=True,
        bf16=dtype == "bf16",
        params_dtype=TORCH_DTYPES[dtype],
        pipeline_dtype=TORCH_DTYPES[dtype],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **dict.fromkeys(FUSIONS, False),
        **(VPP_P2P if topo.vpp > 1 else {}),
    )
    kwargs.update(moe_config(spec, topo))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec_module(spec: ModelSpec, layer_spec: LayerSpec, config: Any = None, vp_stage: int | None = None):
    """megatron-core's layer spec for `layer_spec` (the TE one imports Transformer-Engine: GPU ranks only).
    A model mixing dense and MoE layers (`moe_layer_freq`) gets megatron-core's decoder block spec, as
    Megatron-LM builds it: one layer spec per layer of this (virtual) pipeline stage, from `config`."""
    from megatron.core.models.gpt import gpt_layer_specs

    if getattr(spec, "moe_layer_freq", None):
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=layer_spec == "te",
                                                          normalization=spec.normalization, vp_stage=vp_stage)
    if layer_spec == "te":
        moe = dict(num_experts=spec.num_moe_experts, moe_grouped_gemm=spec.moe_grouped_gemm) if spec.is_moe else {}
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    # the local spec has no grouped GEMM: it would silently build SequentialMLP (unavailable_reason refuses that)
    moe = dict(num_experts=spec.num_moe_experts, moe_grouped_gemm=False) if spec.is_moe else {}
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=spec.normalization, **moe)


def build_gpt(spec: ModelSpec, topo: Topology, dtype: DType = "fp32", layer_spec: LayerSpec = "local", **config_overrides: Any) -> list:
    """This rank's model chunks, a list as Megatron-LM's `get_model` builds it: one megatron-core
    GPTModel (local or Transformer-Engine layer spec) per virtual pipeline stage, `topo.vpp` of
    them (one without vpp).

    Chunk `i` is built with `vp_stage=i`, so megatron-core's `get_transformer_layer_offset` gives
    it layers `i * num_layers / vpp + pp_rank * layers_per_chunk ...`: with pp2vpp2 and 4 layers,
    pp rank 0 holds layers 0 and 2, pp rank 1 layers 1 and 3. The embedding is on the first chunk
    of the first stage, the output layer on the last chunk of the last stage. Checkpoint keys use
    global layer numbers, so they are the same at pp1, pp4 and pp2vpp2.

    fp32: the bare GPTModels. bf16: each GPTModel in bf16 wrapped in megatron-core's
    `Float16Module`, as Megatron-LM's `get_model` does under `--bf16` (and as verl's engine does):
    the wrapper casts float inputs to bf16 on the first stage and logits back to fp32 on the last,
    and megatron's optimizer pairs each bf16 param with an fp32 main param only through it (a bare
    bf16 GPTModel under DDP leaves optimizer and model shapes disagreeing). Float16Module's
    `sharded_state_dict`/`state_dict` delegate to the wrapped module without a prefix, so the
    checkpoint keys are the same as fp32's and as Megatron-LM's (`embedding.word_embeddings.weight`,
    not `module.embedding...`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from harness.compat.attention_env import fresh_attention_env
    from harness.models.parallel import seed_model_parallel

    unavailable = unavailable_reason(spec, layer_spec)
    if unavailable:
        raise RuntimeError(f"model {spec.name!r}: {unavailable}")
    seed_model_parallel(spec.seed)
    fresh_attention_env()  # the NVTE_* an earlier model of this process wrote (harness.compat.attention_env)
    config = transformer_config(spec, topo, dtype, layer_spec, **config_overrides)
    chunks = []
    for vp_stage in range(topo.vpp) if topo.vpp > 1 else (None,):
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec_module(spec, layer_spec, config, vp_stage),
            vocab_size=spec.padded_vocab_size(topo.tp),  # == vocab_size unless the spec asks for padding
            max_sequence_length=spec.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=spec.tied_embeddings,
            position_embedding_type=spec.position_embedding,
            vp_stage=vp_stage,
        )
        from harness.models.parallel import rank_device

        model = model.to(rank_device())  # built on CPU (use_cpu_initialization), used where the rank runs
        chunks.append(Float16Module(config, model) if dtype == "bf16" else model)
    return chunks


def as_chunks(model: Any) -> list:
    """A model as its list of chunks: `build_gpt`'s list, a list of DDP-wrapped chunks (each
    unwrapped to the module it holds, as Megatron-LM's checkpointing unwraps DDP), or one module (a
    Bridge model's, a chunk list of one)."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [c.module if isinstance(c, _BaseDataParallel) else c for c in chunks]


def sharded_state_dict(model: Any, metadata: dict | None = None) -> dict:
    """The model's sharded state dict in Megatron-LM's layout (training/checkpointing.py
    `generate_state_dict`): one chunk's as it is, several under `model0`, `model1`, ... The
    ShardedTensor keys inside carry global layer numbers, so what lands on disk does not depend on
    how the layers were split into chunks. `metadata`: the sharded_state_dict metadata a training
    checkpoint passes (None: the model-only call, without it)."""
    chunks = as_chunks(model)
    kw = {} if metadata is None else {"metadata": metadata}
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict(**kw)
    return {f"model{i}": c.sharded_state_dict(**kw) for i, c in enumerate(chunks)}


def load_state_dict(model: Any, state: dict, retry_non_strict: bool = False) -> None:
    """Put a loaded `sharded_state_dict(model)`-shaped state into every chunk (strict). With
    `retry_non_strict`, a chunk whose strict load raises is loaded again non-strict, as Megatron-LM's
    load_model_state_dict does (megatron/training/checkpointing.py): what a dist load that dropped the
    keys the checkpoint lacks (a log_all / return_all strictness) leaves keeps the job's own values."""
    chunks = as_chunks(model)
    states = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, st in zip(chunks, states):
        try:
            chunk.load_state_dict(st, strict=True)
        except RuntimeError:
            if not retry_non_strict:
                raise
            chunk.load_state_dict(st, strict=False)


def _expand(sharded: dict) -> tuple[dict, dict]:
    """(sharded state dict with factories applied, the factories) as dist_checkpointing sees them."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensorFactory,
        apply_factories,
    )

    factories, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(sharded)
    return sharded, factories


def sharded_tensors(tree: Any) -> Iterator[Any]:
    """Every ShardedTensor of a (nested dict/list/tuple) sharded state dict, in order."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(tree, dict):
        for v in tree.values():
            yield from sharded_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from sharded_tensors(v)
    elif isinstance(tree, ShardedTensor):
        yield tree


def fill_canonical(model, spec: ModelSpec) -> None:
    """Set every parameter of every chunk to its slice of the canonical tensors, through the
    chunk's own sharding metadata (the same mapping dist_checkpointing uses, not its storage).

    Each tensor is asked of harness.core.truth in the dtype the model holds it in: for a bf16 model that
    is the canonical fp32 tensor cast to bf16 (round to nearest even) inside `truth.canonical_tensor`,
    so the truth stays one function and a bf16 judge asks it the same way."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factory_merges,
    )

    cache: dict[str, torch.Tensor] = {}

    def to_plain(x):
        if isinstance(x, ShardedTensor):
            if x.key not in cache:
                cache[x.key] = canonical_tensor(spec, x.key, tuple(x.global_shape), x.dtype)
            return cache[x.key][x.global_slice()].clone()
        if isinstance(x, ShardedObject):
            return x.data
        return x

    for chunk in as_chunks(model):
        sharded, factories = _expand(chunk.sharded_state_dict())
        dict_list_map_inplace(to_plain, sharded)
        chunk.load_state_dict(apply_factory_merges(sharded, factories), strict=True)


def shards_of(sharded_tree: Any, keep=lambda sh: True) -> list[Shard]:
    """Every ShardedTensor of a sharded state dict (factories applied) as a plain Shard."""
    sharded, _ = _expand(sharded_tree)
    out = []
    for sh in sharded_tensors(sharded):
        if not keep(sh):
            continue
        out.append(
            Shard(
                key=sh.key,
                global_shape=tuple(sh.global_shape),
                index=tuple((s.start, s.stop) if isinstance(s, slice) else int(s) for s in sh.global_slice()),
                replica_id=sh.replica_id if isinstance(sh.replica_id, int) else tuple(sh.replica_id),
                data=sh.data.detach().clone().cpu(),
            )
        )
    return out


def local_shards(model) -> list[Shard]:
    """This rank's view of every checkpointed model tensor, every chunk: key, where it sits
    globally, its data."""
    return shards_of(sharded_state_dict(model))


def cp_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions CP rank `cp_rank` of `cp` holds: megatron's load-balanced split
    (`get_batch_on_this_cp_rank`) cuts the sequence into 2*cp chunks and gives rank r chunks r and
    2*cp-1-r, so every rank gets as much of the causal mask's work."""
    chunk = seq_length // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def cp_unshard(parts: list[torch.Tensor], seq_length: int, dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor from each CP rank's part (in CP rank order), inverse of `cp_positions`."""
    cp = len(parts)
    shape = list(parts[0].shape)
    shape[dim] = seq_length
    full = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        full.index_copy_(dim, cp_positions(seq_length, cp, r).to(part.device), part)
    return full


@torch.no_grad()
def forward_logits(model, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """Full-vocabulary logits of `batch`, returned on every last-stage TP-rank-0 rank.

    Forward-only through megatron-core's own schedule, as Megatron-LM evaluates
    (`get_forward_backward_func()(..., forward_only=True, collect_non_loss_data=True)`): no
    pipelining at pp1, 1F1B across stages, the interleaved schedule (chunk 0 of every stage, then
    chunk 1, ...) with vpp. The activations travel in the config's pipeline_dtype (bf16 for a bf16
    model); logits come back in fp32 either way (Float16Module upcasts on the last stage).
    With CP>1 (TE layer spec) each CP rank feeds its `cp_positions` of the sequence, as megatron's
    training does, and the logits are gathered across the CP group back into sequence order.

    The interleaved schedule refuses fewer micro-batches than `microbatch_group_size_per_vp_stage`
    (default PP; megatron-core 0.19.2 schedules.py forward_backward_pipelining_with_interleaving), so
    the whole batch goes in as that many identical micro-batches and every copy's logits must agree
    bitwise (one micro-batch otherwise: the batch shape, hence every reduction, is the same at
    every topology).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = as_chunks(model)
    for c in chunks:
        c.eval()
    batch = {k: v.to(device) for k, v in batch.items()}
    seq_length = batch["input_ids"].shape[1]
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        idx = cp_positions(seq_length, cp, parallel_state.get_context_parallel_rank()).to(device)
        batch = {"input_ids": batch["input_ids"][:, idx], "position_ids": batch["position_ids"][:, idx],
                 "attention_mask": batch["attention_mask"][:, :, idx, :]}
    b, s = batch["input_ids"].shape
    config = chunks[0].config
    copies = config.microbatch_group_size_per_vp_stage if len(chunks) > 1 else 1

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        return chunk(mb["input_ids"], mb["position_ids"], mb["attention_mask"]), lambda out, non_loss_data=False: out

    iterators = [iter([batch] * copies) for _ in chunks]
    outs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
        num_microbatches=copies, seq_length=s, micro_batch_size=b, forward_only=True, collect_non_loss_data=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = [tensor_parallel.gather_from_tensor_model_parallel_region(o) for o in outs]
    if len(logits) != copies or any(not torch.equal(logits[0], x) for x in logits[1:]):
        raise RuntimeError(f"forward_logits: {len(logits)} micro-batch outputs for {copies} identical micro-batches, "
                           "or copies that disagree")
    logits = logits[0]
    if cp > 1:
        parts = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_context_parallel_group())
        logits = cp_unshard(parts, seq_length)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return logits.detach().cpu().clone()
