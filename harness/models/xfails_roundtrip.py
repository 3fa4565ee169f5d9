"""Named upstream defects of the hf-roundtrip cases of matrices/architectures.yaml: strict xfails
keyed "family" (every pair) or "family pair" (one pair), filled from the triage (docs/architectures.md).
Data only; harness.models.architectures writes them into the matrix."""

from __future__ import annotations

from typing import Any

#: Named upstream defects per family (strict xfails): filled from the triage (docs/architectures.md).
ROUNDTRIP: dict[str, dict[str, Any]] = {
    "deepseek_v4": {
        "reason": "Megatron-Bridge 0.6.2 sets experimental_attention_variant='dsv4_hybrid' (deepseek/deepseek_v4_bridge.py:397) "
                  "with megatron-core's experimental-variant block spec (:403), but megatron-core 0.19.2 knows only "
                  "'gated_delta_net' and 'dsa' (models/gpt/experimental_attention_variant_module_specs.py:142-148 raises "
                  "'Invalid experimental attention variant') and that spec is TE-only (:442): built on CPU from Core's own "
                  "per-layer function (harness.models.cpu_spec.hybrid_block), it raises there (:146)",
        "match": "ValueError: Invalid experimental attention variant: dsv4_hybrid",
        "raised_in": "megatron.core.models.gpt"},
    "olmoe tp1 -> tp2": {
        "reason": "Megatron-Bridge 0.6.2 OLMoESelfAttention builds q/k_layernorm over head_dim * num_attention_heads, the "
                  "full width (olmoe/olmoe_provider.py:120-135), and applies them to the tensor-parallel-local q/k "
                  "(width / TP) with no gather (olmoe_provider.py:177-180): any TP > 1 fails in the norm",
        "match": "Given normalized_shape=\\[64\\], expected input with shape \\[\\*64\\], but got input of size\\[16, 2, 32\\]",
        "raised_in": "megatron.bridge.models.olmoe"},
    "ernie4_5_moe": {
        "reason": "Megatron-Bridge 0.6.2 maps ERNIE-4.5-MoE's router as sigmoid + expert bias (ernie/ernie_45_bridge.py:225-226); "
                  "transformers 5.12.1's Ernie4_5_MoeTopKRouter is softmax, top-k by softmax + e_score_correction_bias, "
                  "renormalized (models/ernie4_5_moe/modeling_ernie4_5_moe.py:371-376), and megatron-core 0.19.2 applies an "
                  "expert bias only with sigmoid/sqrtsoftplus (transformer/moe/moe_utils.py:839-870, the bias only at :862): the expert weights "
                  "differ (with transformers' router patched to sigmoid both pairs pass at 7.2e-07)",
        "checks": ["megatron-logits"]},
    "gemma4 tp1 -> pp2": {
        "reason": "Megatron-Bridge 0.6.2: Gemma4DenseProvider.provide raises for pipeline_model_parallel_size != 1 "
                  "(models/gemma/gemma4_provider.py:199-200)",
        "match": "Gemma4DenseProvider currently supports PP=1 only", "raised_in": "megatron.bridge.models.gemma"},
    "gemma4_vl tp1 -> pp2": {
        "reason": "Megatron-Bridge 0.6.2: Gemma4DenseVLProvider.provide_language_model calls Gemma4DenseProvider.provide "
                  "(models/gemma_vl/gemma4_vl_provider.py:110-111), which raises for pipeline_model_parallel_size != 1 "
                  "(models/gemma/gemma4_provider.py:199-200)",
        "match": "Gemma4DenseProvider currently supports PP=1 only", "raised_in": "megatron.bridge.models.gemma"},
    "glm_moe_dsa": {
        "reason": "Megatron-Bridge 0.6.2 glm_moe_dsa/glm5_bridge.py:135 reads hf_config.indexer_rope_interleave, a field "
                  "transformers 5.12.1's GlmMoeDsaConfig does not define (the model's own config has no such field)",
        "match": "'GlmMoeDsaConfig' object has no attribute 'indexer_rope_interleave'", "raised_in": "megatron.bridge.models.glm_moe_dsa"},
}
