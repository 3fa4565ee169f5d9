"""The Megatron side of a GPT zoo model: build it at a topology, fill it with the canonical
weights through its own sharding metadata, read back every rank's shards, run a forward pass.

What the weights should be is harness.truth; which models exist is harness.zoo.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from harness.parity import Shard
from harness.topology import Topology
from harness.truth import canonical_tensor
from harness.zoo import ModelSpec


#: Fused kernels that need CUDA (or Apex/TE): all off for a CPU build, GPT and Bridge models alike.
FUSIONS = (
    "gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "apply_rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
)


def rank_device() -> torch.device:
    """The device of this rank's model: its GPU on an NCCL rank (the launcher set it), else CPU
    (gloo ranks hide GPUs before CUDA initialises)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(topo: Topology) -> None:
    """parallel_state for `topo`; CP>1 lives only here (see `build_gpt`)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        context_parallel_size=topo.cp,
    )


def transformer_config(spec: ModelSpec, topo: Topology, **overrides: Any):
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
        # The local (non-TE) DotProductAttention asserts context_parallel_size == 1. CP>1 is
        # exercised through parallel_state only, which is what decides shard and replica ids.
        context_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **dict.fromkeys(FUSIONS, False),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(spec: ModelSpec, topo: Topology, **config_overrides: Any):
    """A megatron-core GPTModel (local layer spec, fp32) for this rank's pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harness.compat import seed_model_parallel

    seed_model_parallel(spec.seed)
    config = transformer_config(spec, topo, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=spec.normalization),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=spec.position_embedding,
    )
    return model.to(rank_device())  # built on CPU (use_cpu_initialization), used where the rank runs


def _expand(sharded: dict) -> tuple[dict, dict]:
    """(sharded state dict with factories applied, the factories) as dist_checkpointing sees them."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    factories, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(sharded)
    return sharded, factories


def _sharded_tensors(tree: Any) -> Iterator[Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(tree, dict):
        for v in tree.values():
            yield from _sharded_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _sharded_tensors(v)
    elif isinstance(tree, ShardedTensor):
        yield tree


def fill_canonical(model, spec: ModelSpec) -> None:
    """Set every parameter to its slice of the canonical tensors, through the model's own
    sharding metadata (the same mapping dist_checkpointing uses, not its storage)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges

    sharded, factories = _expand(model.sharded_state_dict())
    cache: dict[str, torch.Tensor] = {}

    def to_plain(x):
        if isinstance(x, ShardedTensor):
            if x.key not in cache:
                cache[x.key] = canonical_tensor(spec, x.key, tuple(x.global_shape), x.dtype)
            return cache[x.key][x.global_slice()].clone()
        if isinstance(x, ShardedObject):
            return x.data
        return x

    dict_list_map_inplace(to_plain, sharded)
    state = apply_factory_merges(sharded, factories)
    model.load_state_dict(state, strict=True)


def shards_of(sharded_tree: Any, keep=lambda sh: True) -> list[Shard]:
    """Every ShardedTensor of a sharded state dict (factories applied) as a plain Shard."""
    sharded, _ = _expand(sharded_tree)
    out = []
    for sh in _sharded_tensors(sharded):
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
    """This rank's view of every checkpointed model tensor: key, where it sits globally, its data."""
    return shards_of(model.sharded_state_dict())


@torch.no_grad()
def forward_logits(model, batch: dict[str, torch.Tensor], hidden_size: int, device: torch.device) -> torch.Tensor | None:
    """Full-vocabulary logits of `batch`, returned on every last-stage TP-rank-0 rank.

    Pipeline stages hand activations on with plain send/recv so the forward pass does not
    depend on megatron's schedules (which have their own CUDA assumptions).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    model.eval()
    batch = {k: v.to(device) for k, v in batch.items()}
    b, s = batch["input_ids"].shape
    if not parallel_state.is_pipeline_first_stage():
        recv = torch.empty((s, b, hidden_size), dtype=torch.float32, device=device)
        dist.recv(recv, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(recv)
    out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return logits.detach().cpu().clone()
