"""The canonical truth: what every tensor, adapter and input should be, as pure functions of seeds.

A loaded checkpoint is judged against these values, never against what the backend under test
wrote, so this module imports nothing from the harness (tests/test_truth.py enforces it): only
torch and hashlib. Every topology derives its shard of a tensor from the same full tensor, so a
model built at tp2pp1 and one built at tp1pp2 hold the same weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

#: The load side of a case starts from other weights (seed + this), so a load that does nothing fails.
DECOY_SEED_OFFSET = 9973


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the parts (`seed:key[:tp_rank]`): stable across processes and versions."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _noise(shape: tuple[int, ...], *parts: Any) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(derive_seed(*parts)), dtype=torch.float32)


#: Checkpoint keys whose first dim is the (possibly padded) vocabulary.
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_padded_vocab(model: Any, key: str, shape: tuple[int, ...]) -> bool:
    """Whether `key` at `shape` holds padding rows beyond the model's `vocab_size` (only a model with
    `make_vocab_size_divisible_by` set pads; every zoo model leaves it None)."""
    return (
        getattr(model, "make_vocab_size_divisible_by", None) is not None
        and key.endswith(VOCAB_KEYS)
        and len(shape) >= 1
        and shape[0] > model.vocab_size
    )


def _vocab_noise(model: Any, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Noise whose first `vocab_size` rows do not depend on the padded size: the real rows are drawn
    at their own shape and the padding rows separately (torch.randn's prefix changes with the
    total size), so a model padded to 104 rows at tp1 and 112 at tp2 holds the same real rows."""
    if not is_padded_vocab(model, key, shape):
        return _noise(shape, model.seed, key)
    real = _noise((model.vocab_size, *shape[1:]), model.seed, key)
    pad = _noise((shape[0] - model.vocab_size, *shape[1:]), model.seed, key, "vocab-padding")
    return torch.cat([real, pad])


def canonical_tensor(model: Any, key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full tensor a megatron checkpoint key holds in a GPT zoo model (scaled so logits stay sane).

    With vocab padding the real rows are the same at every padded size (see `_vocab_noise`); the
    padding rows are a function of the padded size too (reshard-weights' vocab-padding check holds a
    checkpoint's padding rows to them, at the padded size of the TP it was saved at)."""
    noise = _vocab_noise(model, key, shape)
    leaf = key.rsplit(".", 1)[-1]
    if "norm" in key and leaf in ("weight", "layer_norm_weight"):
        t = 1.0 + 0.1 * noise
    elif leaf in ("bias", "layer_norm_bias"):
        t = 0.02 * noise
    else:
        t = 0.05 * noise
    return t.to(dtype)


def _layer_shapes(model: Any, moe: bool) -> dict[str, tuple[int, ...]]:
    """One transformer layer's checkpoint keys (local spec names; TE's fused layers write the same)
    and their full shapes."""
    h, head_dim = model.hidden_size, model.hidden_size // model.num_attention_heads
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * head_dim
    gated = 2 if model.swiglu else 1
    out: dict[str, tuple[int, ...]] = {}

    def norm(prefix: str) -> None:
        out[f"{prefix}.layer_norm_weight"] = (h,)
        if model.normalization == "LayerNorm":
            out[f"{prefix}.layer_norm_bias"] = (h,)

    def mlp(prefix: str, ffn: int, lead: tuple[int, ...] = ()) -> None:
        out[f"{prefix}.linear_fc1.weight"] = (*lead, gated * ffn, h)
        out[f"{prefix}.linear_fc2.weight"] = (*lead, h, ffn)
        if model.add_bias_linear:
            out[f"{prefix}.linear_fc1.bias"] = (*lead, gated * ffn)
            out[f"{prefix}.linear_fc2.bias"] = (*lead, h)

    norm("self_attention.linear_qkv")
    out["self_attention.linear_qkv.weight"] = (qkv, h)
    if model.add_bias_linear or model.add_qkv_bias:
        out["self_attention.linear_qkv.bias"] = (qkv,)
    out["self_attention.linear_proj.weight"] = (h, model.num_attention_heads * head_dim)
    if model.add_bias_linear:
        out["self_attention.linear_proj.bias"] = (h,)
    norm("mlp.linear_fc1")  # the pre-MLP norm, under megatron's fused name (MoE layers too)
    if moe:
        out["mlp.router.weight"] = (model.num_moe_experts, h)
        mlp("mlp.experts.experts", model.moe_ffn_hidden_size, (model.num_moe_experts,))
        if model.moe_shared_expert_size:
            mlp("mlp.shared_experts", model.moe_shared_expert_size)
    else:
        mlp("mlp", model.ffn_hidden_size)
    return out


def gpt_checkpoint_shapes(model: Any, tp: int) -> dict[str, tuple[int, ...]]:
    """Every weight key a megatron-core GPT zoo model built at TP `tp` checkpoints, with its full
    shape, from the model's config alone: what a build or a save that drops, adds or reshapes a
    tensor is judged against (`_extra_state` not included). Uniform layers are stacked on a
    leading layer axis (`decoder.layers.X`); a model mixing dense and MoE layers (`moe_layer_freq`)
    checkpoints each layer under `decoder.layers.<i>.X`."""
    h, vocab = model.hidden_size, model.padded_vocab_size(tp)
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, h), "decoder.final_layernorm.weight": (h,)}
    if model.normalization == "LayerNorm":
        out["decoder.final_layernorm.bias"] = (h,)
    if model.position_embedding == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (model.seq_length, h)
    if not model.tied_embeddings:
        out["output_layer.weight"] = (vocab, h)
    pattern = getattr(model, "moe_layer_freq", None)
    if pattern:
        for i, moe in enumerate(pattern):
            out.update({f"decoder.layers.{i}.{k}": v for k, v in _layer_shapes(model, bool(moe)).items()})
    else:
        out.update({f"decoder.layers.{k}": (model.num_layers, *v) for k, v in _layer_shapes(model, bool(model.num_moe_experts)).items()})
    return out


def canonical_hf_state(model: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """An HF fixture's weights by HF parameter name: norms 1 + noise, everything else (biases
    included, so a dropped bias shows) small noise."""
    return {
        name: (1.0 + 0.1 * _noise(shape, model.seed, name)) if "norm" in name else 0.05 * _noise(shape, model.seed, name)
        for name, shape in shapes.items()
    }


def adapter_tensor(seed: int, global_name: str, tp_rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A LoRA adapter parameter's values on one TP rank: non-zero (lora_B is zero at init, which
    would hide every B-side bug), a function of (seed, global name, TP rank) so any topology can
    rebuild them."""
    return 0.1 * _noise(shape, seed, global_name, tp_rank)


def magnitude_tensor(seed: int, global_name: str, tp_rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A DoRA magnitude vector's values (one per output row) on one TP rank: positive and in the HF
    fixtures' row-norm range (0.3..0.6, canonical_hf_state's 0.05 * noise rows), as a trained magnitude is,
    yet off every row's ||W + s*B@A|| (what PEFT re-initialises a missing magnitude to) by up to ~50%."""
    return 0.45 + 0.15 * torch.tanh(_noise(shape, seed, global_name, tp_rank))


def causal_mask(seq_length: int) -> torch.Tensor:
    """An explicit boolean causal mask [1, 1, s, s] (megatron builds its default one on CUDA)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]


def positions(batch: int, seq_length: int) -> torch.Tensor:
    return torch.arange(seq_length).unsqueeze(0).expand(batch, -1).contiguous()


def fixed_batch(model: Any) -> dict[str, torch.Tensor]:
    """The logits batch of a GPT zoo model: tokens from the model seed."""
    g = torch.Generator().manual_seed(model.seed + 7)
    tokens = torch.randint(0, model.vocab_size, (model.micro_batch_size, model.seq_length), generator=g)
    return {"input_ids": tokens, "position_ids": positions(*tokens.shape), "attention_mask": causal_mask(model.seq_length)}


def fixed_input_ids(model: Any, batch: int = 2) -> torch.Tensor:
    """The logits input of an HF fixture (ids above the special tokens)."""
    g = torch.Generator().manual_seed(model.seed + 11)
    return torch.randint(4, model.vocab_size, (batch, model.seq_length), generator=g)


def hf_batch(model: Any) -> dict[str, torch.Tensor]:
    """`fixed_input_ids` with the positions and mask a Megatron forward needs."""
    ids = fixed_input_ids(model)
    return {"input_ids": ids, "position_ids": positions(*ids.shape), "attention_mask": causal_mask(model.seq_length)}


def train_batch(model: Any, step: int, global_batch: int) -> dict[str, torch.Tensor]:
    """Step `step`'s global batch of a training case: the same samples at every topology."""
    g = torch.Generator().manual_seed(model.seed * 1000 + step)
    tokens = torch.randint(0, model.vocab_size, (global_batch, model.seq_length + 1), generator=g)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": positions(global_batch, model.seq_length),
        "mask": causal_mask(model.seq_length),
    }
