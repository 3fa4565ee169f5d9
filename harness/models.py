"""The tiny model zoo, and the one definition of "the same model" across topologies.

Canonical weights are a pure function of (model seed, checkpoint key, global shape): every rank
of every topology derives its shard of a tensor from the same full tensor, so a model built at
tp2pp1 and one built at tp1pp2 hold the same weights, and the truth a loaded checkpoint is judged
against never comes from the backend under test.

Sizes are chosen so that every topology the matrices use (tp, pp, 2*cp in {1, 2, 4}) divides them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from harness.parity import Shard
from harness.topology import Topology


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_query_groups: int = 4
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    swiglu: bool = True
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tied_embeddings: bool = False
    position_embedding: str = "rope"
    seed: int = 1234

    def with_seed(self, seed: int) -> "ModelSpec":
        return replace(self, seed=seed)


ZOO: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "gpt-gqa",
            "GQA (8 heads, 4 query groups) + SwiGLU + RoPE + RMSNorm, untied embeddings",
        ),
        ModelSpec(
            "gpt-tied",
            "MHA + GeLU + LayerNorm + linear biases + learned positions, tied embeddings",
            num_query_groups=8,
            swiglu=False,
            normalization="LayerNorm",
            add_bias_linear=True,
            add_qkv_bias=True,
            tied_embeddings=True,
            position_embedding="learned_absolute",
        ),
        # Heavier models for memory budgets and the save-memory benchmark (not in the smoke matrix).
        ModelSpec(
            "gpt-25m",
            "gpt-gqa shape at ~25M params: memory-tier cases",
            num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=2048,
            vocab_size=8192, seq_length=16,
        ),
        ModelSpec(
            "gpt-150m",
            "gpt-gqa shape at ~150M params: the save-memory benchmark",
            num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=4096,
            vocab_size=16384, seq_length=16,
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}") from None


def get_any_model(name: str):
    """A GPT zoo model (ModelSpec) or an HF fixture (HFModelSpec), by name."""
    from harness.hf_models import HF_ZOO

    if name in ZOO:
        return ZOO[name]
    if name in HF_ZOO:
        return HF_ZOO[name]
    raise KeyError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}, the HF zoo has {sorted(HF_ZOO)}")


# --------------------------------------------------------------------------- canonical weights


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def canonical_tensor(spec: ModelSpec, key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full tensor a checkpoint key holds in this model: scaled so that logits stay sane."""
    g = torch.Generator().manual_seed(_key_seed(spec.seed, key))
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = key.rsplit(".", 1)[-1]
    if "norm" in key and leaf in ("weight", "layer_norm_weight"):
        t = 1.0 + 0.1 * noise
    elif leaf in ("bias", "layer_norm_bias"):
        t = 0.02 * noise
    else:
        t = 0.05 * noise
    return t.to(dtype)


# --------------------------------------------------------------------------- rank side


def preload(bridge: bool = False) -> None:
    """Import megatron-core (and Megatron-Bridge for HF cases) in the parent once, so forked
    ranks start in ~1 s instead of ~6 s (~15 s with the Bridge)."""
    from harness.compat import import_megatron_bridge, quiet_known_noise

    quiet_known_noise()
    if bridge:
        import_megatron_bridge()
        import megatron.bridge.training.checkpointing  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401


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
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
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
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=spec.normalization),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=spec.position_embedding,
    )


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


def fixed_batch(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Tokens from the model seed; an explicit causal mask (the default one is built on CUDA)."""
    g = torch.Generator().manual_seed(spec.seed + 7)
    tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length), generator=g)
    positions = torch.arange(spec.seq_length).unsqueeze(0).expand_as(tokens).contiguous()
    mask = torch.triu(torch.ones(spec.seq_length, spec.seq_length, dtype=torch.bool), diagonal=1)
    return {"input_ids": tokens, "position_ids": positions, "attention_mask": mask[None, None]}


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
