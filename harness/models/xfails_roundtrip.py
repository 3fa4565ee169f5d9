"""Named upstream defects of the hf-roundtrip cases of matrices/architectures.yaml: strict xfails
keyed "family" (every pair) or "family pair" (one pair), filled from the triage (docs/architectures.md).
Data only; harness.models.architectures writes them into the matrix."""

from __future__ import annotations

from typing import Any

#: the Qwen2.5-Omni thinker's text-only rotary positions read a Megatron attention mask as HF's (measured on the tiny fixture)
QWEN25_OMNI_ROPE = ("Megatron-Bridge 0.6.2 Qwen2.5-Omni's thinker derives text-only M-RoPE positions from the attention mask it is "
                    "given (modeling_qwen25_omni/thinker_model.py:313-331 always calls get_rope_index) and reads Megatron's "
                    "[b, 1, s, s] mask (True = masked) as HF's keep-mask: rope.py:312-316 collapses it with any(dim=-1), "
                    "rope.py:318-319 then put the last token at position 1 instead of s - 1, so its logits are 0.52 off "
                    "transformers' (every other position within 1.7e-6; with position_ids = arange the whole output is); "
                    "Qwen3-Omni builds text-only positions without the mask (modeling_qwen3_omni/thinker_model.py:394-400)")

#: a VL provider that does not hand vp_stage down: megatron-core then refuses virtual pipeline stages by an assert
VP_STAGE_DROPPED = ("Megatron-Bridge 0.6.2 drops vp_stage on the way to the language model's decoder: {where}, so megatron-core's "
                    "get_transformer_layer_offset asserts (transformer/transformer_layer.py:190): the model cannot be built with "
                    "virtual pipeline stages")
_VP_MATCH = "vp_stage must be provided if virtual pipeline model parallel size is set"

#: The VL language paths at the pipeline layouts whose model is not built: providers that drop vp_stage, and Qwen3-VL's
#: DeepStack taps; their LoRA cases meet the same refusal (harness.models.xfails_lora)
VL_LAYOUT_REFUSALS: dict[str, dict[str, Any]] = {
    **{f"{f} tp1 -> pp2vpp2": {"reason": VP_STAGE_DROPPED.format(where=where), "match": _VP_MATCH, "raised_in": raised}
       for f, where, raised in (
           ("qwen3_vl", "Qwen3VLModelProvider.provide builds Qwen3VLModel without it (qwen_vl/qwen3_vl_provider.py:155-166)",
            "megatron.bridge.models.qwen_vl"),
           ("qwen3_vl_moe", "Qwen3VLMoEModelProvider.provide builds Qwen3VLModel without it (qwen_vl/qwen3_vl_provider.py:322-333)",
            "megatron.bridge.models.qwen_vl"),
           ("qwen2_5_omni", "the Qwen2.5-Omni thinker builds its Qwen3VLGPTModel without it (qwen_omni/modeling_qwen25_omni/"
            "thinker_model.py:100, :112-125)", "megatron.bridge.models.qwen_vl"),
           ("qwen3_omni", "the Qwen3-Omni thinker builds its Qwen3VLGPTModel without it (qwen_omni/modeling_qwen3_omni/"
            "thinker_model.py:218)", "megatron.bridge.models.qwen_vl"),
           ("ernie4_5_vl_moe", "get_ernie45_vl_decoder_block_spec slices the layers by get_transformer_layer_offset(config) "
            "without it (ernie_vl/modeling_ernie45_vl/ernie_decoder_layer_spec.py:267-268)", "megatron.bridge.models.ernie_vl"))},
    **{f"{f} tp1 -> pp2 uneven": {
        "reason": "Megatron-Bridge 0.6.2 puts every Qwen3-VL DeepStack merge on the first pipeline stage and asserts that stage "
                  "holds at least as many language layers as there are taps (qwen_vl/modelling_qwen3_vl/model.py:358-362): "
                  "with num_layers_in_first_pipeline_stage 1 and the fixture's 2 taps (the real checkpoints have 3) the "
                  "model is not built, so a first stage lightened for the ViT must still hold every tap's layer",
        "match": "the deepstack_visual_embeds should on the first pp-stage of language model",
        "raised_in": "megatron.bridge.models.qwen_vl"} for f in ("qwen3_vl", "qwen3_vl_moe")},
}

#: Named upstream defects per family (strict xfails): filled from the triage (docs/architectures.md).
ROUNDTRIP: dict[str, dict[str, Any]] = {
    "deepseek_v4": {
        "reason": "Megatron-Bridge 0.6.2 sets experimental_attention_variant='dsv4_hybrid' (deepseek/deepseek_v4_bridge.py:397) "
                  "with megatron-core's experimental-variant block spec (:403), but megatron-core 0.19.2 knows only "
                  "'gated_delta_net' and 'dsa' (models/gpt/experimental_attention_variant_module_specs.py:142-148 raises "
                  "'Invalid experimental attention variant') and that spec is TE-only (:442): built on CPU from Core's own "
                  "per-layer function (harness.models.cpu_hybrid.hybrid_block), it raises there (:146)",
        "match": "ValueError: Invalid experimental attention variant: dsv4_hybrid",
        "raised_in": "megatron.core.models.gpt"},
    "sarvam_mla": {
        "reason": "megatron-core 0.19.2 cannot build multi-latent attention without a q LoRA (q_lora_rank None, as "
                  "Sarvam-MLA and DeepSeek-V2-Lite) and with QK norm on anything but Transformer-Engine: the local spec sets "
                  "the QK norm as q_layernorm whatever q_lora_rank is (models/gpt/gpt_layer_specs.py:428) and MLASelfAttention "
                  "refuses it as unused (transformer/mla_qk_norm_config.py:172-173, :259); without it the resolver wants the "
                  "backend's fused norm+linear for linear_q_proj (:147-150, :234-238), which the local backend has not "
                  "(models/backends.py:114-116). SarvamMLAModelProvider builds the local spec where TE is missing "
                  "(sarvam/sarvam_provider.py, use_transformer_engine=HAVE_TE): a Sarvam-MLA job runs only on TE",
        "match": "is non-trivial, but `q_lora_rank is None`",
        "raised_in": "megatron.core.transformer"},
    "mimo": {
        "reason": "Megatron-Bridge 0.6.2 maps MiMo's MTP layer norms only under Transformer-Engine's fused names "
                  "(mimo/mimo_bridge.py:75-86: mtp.layers.*.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight, "
                  "...mlp.linear_fc1.layer_norm_weight), and the registry's aliases for separate norms (input_layernorm, "
                  "pre_mlp_layernorm) apply only where the wildcard directly precedes the module "
                  "(conversion/mapping_registry.py:97, endswith('*.' + name)): megatron-core's local spec (any build "
                  "without TE) names the MTP layer's norms apart, no task maps them, and the import raises "
                  "(model_bridge.py:1100)",
        "match": "'NoneType' object has no attribute 'megatron_module'",
        "raised_in": "megatron.bridge.models.conversion"},
    "falcon_h1 tp1 -> tp2": {
        "reason": "Megatron-Bridge 0.6.2 FalconH1Layer.sharded_state_dict passes its pre-norm to megatron-core's "
                  "sharded_state_dict_default without a tp_group (models/falcon_h1/modeling_falconh1/falconh1_layer.py:479), "
                  "and megatron-core 0.19.2 fills the TP group in only when neither group is given "
                  "(transformer/utils.py:131-133; the metadata always carries dp_cp_group): every TP rank claims the main "
                  "replica of the norm weights (replica_id (0, 0, 0)), and the sharding validation every dist save and strict load "
                  "runs refuses it ('Invalid access pattern', dist_checkpointing/validation.py:403): a Falcon-H1 job at TP > 1 "
                  "can neither load nor save a dist checkpoint",
        "match": "Invalid access pattern for ShardedTensor\\(key='decoder.layers.0.norm.weight'",
        "raised_in": "megatron.core.dist_checkpointing"},
    "falcon_h1 tp1 -> pp2vpp2": {
        "reason": "Megatron-Bridge 0.6.2 FalconH1ModelProvider.provide refuses virtual pipeline stages by an assert "
                  "(models/falcon_h1/falconh1_provider.py:124-127: 'temporarily unsupported in FalconH1 models'): a Falcon-H1 "
                  "job cannot use VPP",
        "match": "Virtual pipeline model parallelism is temporarily unsupported in FalconH1 models",
        "raised_in": "megatron.bridge.models.falcon_h1"},
    "falcon_h1 tp1 -> pp2 uneven": {
        "reason": "Megatron-Bridge 0.6.2 FalconH1Stack splits the layers evenly over the PP stages whatever the config asks "
                  "(models/falcon_h1/modeling_falconh1/falconh1_block.py:242-249, num_layers // pp): "
                  "num_layers_in_first_pipeline_stage=1 builds 2 + 2, not 1 + 3, without a word",
        "checks": ["propagation"]},
    "nemotron_h tp1 -> pp2vpp2": {
        "reason": "Megatron-Bridge 0.6.2 HybridModelProvider.provide refuses virtual pipeline stages by an assert "
                  "(models/hybrid/hybrid_provider.py:295-298: 'temporarily unsupported in Hybrid models due to upstream "
                  "MCore HybridModel API dependency'): a Nemotron-H job cannot use VPP",
        "match": "Virtual pipeline model parallelism is temporarily unsupported in Hybrid models",
        "raised_in": "megatron.bridge.models.hybrid"},
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
    "qwen2_5_omni": {
        "reason": QWEN25_OMNI_ROPE + "; and Megatron-Bridge 0.6.2's Qwen2.5-Omni export omits the checkpoint's spk_dict.pt "
                  "(Qwen25OmniBridge sets no ADDITIONAL_FILE_PATTERNS, model_bridge.py:425), which transformers 5.12.1's "
                  "Qwen2_5OmniForConditionalGeneration.from_pretrained requires even with the talker off "
                  "(modeling_qwen2_5_omni.py:3739-3752): transformers cannot load the export",
        "checks": ["hf-logits", "megatron-logits"]},
    "ernie4_5_vl_moe": {
        "reason": "Megatron-Bridge 0.6.2 maps ERNIE-4.5-VL's text and vision routers as sigmoid + expert bias "
                  "(ernie_vl/ernie45_vl_bridge.py:484-495: moe_router_score_function 'sigmoid', expert bias on); transformers "
                  "5.12.1's Ernie4_5_VLMoeMoeTopKRouter is softmax, top-k by softmax + e_score_correction_bias, renormalized "
                  "(models/ernie4_5_vl_moe/modeling_ernie4_5_vl_moe.py:360-366): the expert weights differ (logits 0.26 off; "
                  "with transformers' router patched to sigmoid the tp2 pair passes within 1e-5), as ERNIE-4.5-MoE's",
        "checks": ["megatron-logits"]},
    **VL_LAYOUT_REFUSALS,  # the VL language paths at the pipeline layouts (defined above)
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
