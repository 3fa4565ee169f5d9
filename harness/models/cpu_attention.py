"""A CPU stand-in for Transformer-Engine's core attention where multi-latent attention needs it.

megatron-core's MLASelfAttention builds its core attention with `k_channels` (q/k head dim, nope +
rope) and `v_channels` (v_head_dim), which differ (transformer/multi_latent_attention.py:207-218).
On GPU that is TEDotProductAttention, which takes both; megatron-core's local DotProductAttention
takes neither (dot_product_attention.py:41-51), so its local MLA spec cannot build on CPU.
`MLADotProductAttention` does what TEDotProductAttention does for MLA in a forward without CP or
packed sequences: softmax(scale * q k^T + causal mask) v with q/k of one head dim and v of another,
the softmax scale MLA hands in (mscale^2 / sqrt(q_head_dim)), GQA by repeating k/v heads, softmax
in fp32. `localize_mla(block)`: every local DotProductAttention of a spec tree swapped for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class MLADotProductAttention(torch.nn.Module):
    """Core attention with k_channels != v_channels (TEDotProductAttention's signature; see the module doc)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, k_channels: int | None = None,
                 v_channels: int | None = None, cp_comm_type: str | None = None, pg_collection: Any = None, **_: Any):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("MLADotProductAttention (CPU stand-in) has no context parallelism")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.hidden_size_per_attention_head_v = v_channels or config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.k_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None, **_: Any) -> torch.Tensor:
        """query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv] -> [sq, b, np * hv]."""
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("MLADotProductAttention (CPU stand-in): no packed sequences, no attention bias")
        sq, b, heads, _ = query.shape
        sk, groups = key.size(0), key.size(2)
        if heads != groups:
            key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, h]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        masked = torch.zeros(sq, sk, dtype=torch.bool, device=scores.device)
        if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(diagonal=sk - sq + 1)
        if attention_mask is not None and mask_type != AttnMaskType.causal:  # TE ignores the mask of a causal type
            masked = masked | attention_mask.to(torch.bool)
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).to(value.dtype)
        if self.training and self.dropout_p > 0:
            probs = torch.nn.functional.dropout(probs, self.dropout_p)
        context = torch.matmul(probs, v)  # [b, np, sq, hv]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * v.size(-1)).contiguous()


def localize_mla(block: Any) -> Any:
    """The block spec with every local DotProductAttention swapped for MLADotProductAttention (in
    place; returned): for a config with multi_latent_attention, the only core attention there is MLA's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from harness.models.cpu_spec import _walk

    return _walk(block, lambda v, _path: MLADotProductAttention if v is DotProductAttention else v, {})
