"""The architectures Megatron-Bridge registers, as data: one `Family` per registered HF
architecture (AutoBridge.list_supported_models() of the installed Bridge), with what a tiny
fixture of it keeps on. Values only (the bottom floor): the zoo makes an `hf-<family>` model of
each; harness.models.architectures enumerates the installed registry, classifies each
architecture against the installed transformers, derives the tiny config (a generic shrink of
the config class's defaults plus `overrides`) and writes matrices/architectures.yaml.

`overrides`: config fields on top of the generic shrink: the family's distinctive options kept
ON (MLA ranks, biases, soft-capping, sliding windows, sinks, shared experts, dense first layers).
`needs`: a Python module the family needs and this kind of machine lacks (a CUDA-only kernel,
or the transformers package that would hold modeling code the hub ships as remote code): the
matrix entry `requires: [module:<needs>]`, so the case is not-run naming it. `path`: "text" (a
causal LM), "vl-text" (a VL model: the language path of a whole-model fixture, harness.models.vl) or
"vl" (a VL/omni/audio model without a language-path case: `note` says why), "unbuilt" (a text model without a
case: `note` says what would reach it) or "remote" (modeling code only
as hub remote code: a fixture of `layout`'s weights under a configuration of the harness's writing,
harness.models.remote; round trips without a logits check).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # the zoo's hf-<name>
    architecture: str  # the HF architecture class name the Bridge registers
    model_type: str | None  # transformers' model_type of the fixture's config (None: transformers has none)
    path: str = "text"  # "text" | "vl-text" (a VL model's language path runs) | "vl" | "unbuilt" | "remote"
    num_layers: int = 4
    num_experts: int | None = None
    tied: bool = False
    overrides: tuple[tuple[str, Any], ...] = ()
    needs: str = ""  # a module (dotted) this family needs to run; "" none beyond the harness's
    note: str = ""
    #: path "remote": the transformers model_type whose checkpoint layout the hub's remote modeling code
    #: writes (the fixture's weights are that class's); model_type is then the remote one (not in transformers)
    layout: str = ""
    #: path "remote": config fields the remote configuration names apart from `layout`'s (its own spelling)
    remote_fields: tuple[tuple[str, Any], ...] = ()

    @property
    def zoo_name(self) -> str:
        return f"hf-{self.name}"

    @property
    def has_cases(self) -> bool:
        """Whether the matrix builds cases for it: a deferred VL model ("vl") and a model not built
        ("unbuilt") have none, only their row's reason."""
        return self.path not in ("vl", "unbuilt")


class Nested(str):
    """A nested config value (a dict: DeepSeek-V4's rope_parameters) carried as its JSON text, so a
    Family stays hashable and frozen; harness.models.architectures.tiny_config decodes it (`value()`)."""

    def value(self) -> Any:
        return json.loads(self)


def _o(**kw: Any) -> tuple[tuple[str, Any], ...]:
    def hold(v: Any) -> Any:
        if isinstance(v, dict):
            return Nested(json.dumps(v, sort_keys=True))
        return tuple(v) if isinstance(v, list) else v

    return tuple(sorted((k, hold(v)) for k, v in kw.items()))


_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, qk_head_dim=16)
_DSMOE = dict(n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, moe_intermediate_size=32)
_TE_VL = ("a Megatron-built ViT and language model from Transformer-Engine specs: {c}.provide builds the language layers "
          "with get_gpt_layer_with_transformer_engine_spec whatever transformer_layer_spec says ({f}) and the ViT with "
          "get_vit_layer_with_transformer_engine_spec ({v}); on CPU both built with harness.models.cpu_spec's stand-ins "
          "under TE's names (harness.models.vl.localize_te_spec_builders)")

FAMILIES: tuple[Family, ...] = (
    # ---- dense text causal LMs
    Family("llama", "LlamaForCausalLM", "llama", note="GQA, SwiGLU, RMSNorm (zoo hf-llama's shape)"),
    Family("mistral", "MistralForCausalLM", "mistral", overrides=_o(sliding_window=None),
           note="Llama-like GQA; the Bridge maps no sliding window (None, as Mistral >= v0.2)"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", note="q/k/v biases (zoo hf-qwen2)"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", note="QK RMSNorm, head_dim 8"),
    Family("gemma", "GemmaForCausalLM", "gemma", tied=True, note="tied, GeGLU (gelu_tanh), (1 + w) RMSNorm, embedding scaled by sqrt(h)"),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", tied=True,
           overrides=_o(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=8, query_pre_attn_scalar=8),
           note="attention and final logit soft-capping, sliding window 8 on alternate layers, pre/post norms"),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", tied=True, num_layers=6, overrides=_o(sliding_window=8, query_pre_attn_scalar=8),
           note="QK norm, sliding window 8 (5 local : 1 global), local/global RoPE bases"),
    Family("gemma4", "Gemma4ForCausalLM", "gemma4_text", tied=True, overrides=_o(sliding_window=8, hidden_size_per_layer_input=8,
           vocab_size_per_layer_input=128, global_head_dim=16), note="per-layer input embeddings, global head_dim 16"),
    Family("nemotron", "NemotronForCausalLM", "nemotron", note="non-gated squared ReLU, LayerNorm1p (zoo hf-nemotron)"),
    Family("exaone4", "Exaone4ForCausalLM", "exaone4", tied=True,  # the Bridge maps no lm_head (exaone4_bridge.py:177)
           # full attention on every layer, RoPE on every layer (EXAONE-4.0-1.2B's shape): the Bridge's spec has no
           # local/global branch (exaone4_provider.py:54-93, "1.2B model uses full attention only"; the 32B hybrid is unmapped)
           overrides=_o(sliding_window=None, layer_types=["full_attention"] * 4),
           note="tied, QK norm, pure post-norms (no pre-norms), full attention (the 1.2B shape the Bridge maps)"),
    # ---- MoE text causal LMs
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", num_experts=4, note="routed experts top-2, QK norm"),
    # MHA as OLMoE ships (16/16): the Bridge's OLMoESelfAttention sizes k_layernorm head_dim * num_attention_heads
    # (olmoe/olmoe_provider.py:129-134), transformers' k_norm head_dim * num_key_value_heads
    Family("olmoe", "OlmoeForCausalLM", "olmoe", num_experts=4, overrides=_o(num_key_value_heads=8),
           note="MHA, QK norm over the full q/k width, top-2 of 4"),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek_v2", num_experts=4, overrides=_o(**_MLA, **_DSMOE, num_experts_per_tok=2),
           note="MLA (q_lora_rank 32, kv_lora_rank 16), 1 shared expert, first layer dense"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", num_experts=4, overrides=_o(**_MLA, **_DSMOE),
           note="MLA, sigmoid router with expert bias, 1 shared expert, first layer dense"),
    Family("deepseek_v4", "DeepseekV4ForCausalLM", "deepseek_v4", num_experts=4,
           overrides=_o(q_lora_rank=32, o_lora_rank=16, o_groups=2, head_dim=16, qk_rope_head_dim=8,
                        index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2, n_shared_experts=1,
                        num_nextn_predict_layers=0,
                        # V4's YaRN on the compressed layers (deepseek_v4_bridge.py:441-446 reads factor,
                        # original_max_position_embeddings, beta_fast/slow from rope_parameters["compress"])
                        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                             beta_fast=32.0, beta_slow=1.0)),
           note="MLA-like q LoRA, grouped o LoRA, hyper-connections, indexer, YaRN on compressed layers"),
    Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", num_experts=4,
           overrides=_o(n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True),
           note="partial RoPE 0.5, q/k/v biases, QK norm, 1 shared expert, first layer dense"),
    Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "glm4_moe_lite", num_experts=4, overrides=_o(**_MLA, **_DSMOE),
           note="MLA, shared expert, first layer dense"),
    Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", "glm_moe_dsa", num_experts=4,
           overrides=_o(**_MLA, **_DSMOE, index_n_heads=2, index_head_dim=16, index_topk=4),
           note="MLA + DeepSeek sparse attention indexer"),
    Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", num_experts=4, overrides=_o(sliding_window=8, attention_bias=True),
           note="attention sinks, q/k/v/o biases, expert biases, clamped SwiGLU, sliding window 8 on alternate layers"),
    Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "ernie4_5_moe", num_experts=4, tied=True,
           overrides=_o(moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=3),
           note="tied, 1 shared expert, first layer dense, expert-bias router"),
    Family("exaone_moe", "ExaoneMoeForCausalLM", "exaone_moe", num_experts=4,
           overrides=_o(num_shared_experts=1, first_k_dense_replace=1, sliding_window=8),
           note="shared expert, first layer dense, sliding window"),
    Family("exaone_moe_caps", "ExaoneMoEForCausalLM", "exaone_moe", num_experts=4,
           overrides=_o(num_shared_experts=1, first_k_dense_replace=1, sliding_window=8),
           note="the Bridge's second spelling of Exaone-MoE (remote-code name): config.architectures names it"),
    Family("hy_v3", "HYV3ForCausalLM", "hy_v3", num_experts=4, overrides=_o(num_shared_experts=1, first_k_dense_replace=1),
           note="shared expert, QK norm"),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", "minimax_m2", num_experts=4, note="sigmoid router with bias, QK norm over all heads"),
    # ---- hybrid / linear attention (Megatron's layers need CUDA-only kernels)
    Family("qwen3_next", "Qwen3NextForCausalLM", "qwen3_next", num_experts=4,
           note="gated DeltaNet layers: Megatron's GatedDeltaNet, on fla's kernels or, where fla is missing, the CPU stand-ins (harness.models.cpu_gdn)"),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen3_5_text",
           note="gated DeltaNet layers: Megatron's GatedDeltaNet, on fla's kernels or, where fla is missing, the CPU stand-ins (harness.models.cpu_gdn)"),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", num_experts=4,
           note="gated DeltaNet layers: Megatron's GatedDeltaNet, on fla's kernels or, where fla is missing, the CPU stand-ins (harness.models.cpu_gdn)"),
    Family("nemotron_h", "NemotronHForCausalLM", "nemotron_h", overrides=_o(
           mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=16, layers_block_type=["mamba", "attention", "mamba", "mlp"],
           layer_norm_epsilon=1e-5),
           note="Mamba-2 layers: Megatron's MambaMixer, on mamba_ssm's kernels or, where mamba_ssm is missing, the CPU stand-ins (harness.models.cpu_mamba)"),
    Family("falcon_h1", "FalconH1ForCausalLM", "falcon_h1", overrides=_o(
           mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16, mamba_norm_before_gate=False,
           mamba_n_groups=2),
           note="parallel attention + Mamba-2: Megatron's MambaMixer (Core asserts norm_before_gate False, as Falcon-H1's released "
                "configs set it; transformers' default is True), on mamba_ssm's kernels or the CPU stand-ins (harness.models.cpu_mamba)"),
    # ---- registered by name only: modeling code is hub remote code
    Family("bailing_moe_v2", "BailingMoeV2ForCausalLM", "bailing_moe_v2", path="remote", layout="bailing_moe_v2", num_experts=4,
           note="remote code (Ling 2.0), written by the Bridge's vendored copy of it (bailing/modeling_bailing_moe_v2.py): "
                "fused query_key_value, QK norm, sigmoid router with expert bias, shared expert, first layer dense"),
    Family("kimi_k2", "KimiK2ForCausalLM", "kimi_k2", path="remote", layout="deepseek_v3", num_experts=4,
           overrides=_o(**_MLA, **_DSMOE), remote_fields=_o(scoring_func="sigmoid", topk_method="noaux_tc"),
           note="remote code in DeepSeek-V3's layout (its hub configuration is DeepSeek-V3's "
           "under model_type kimi_k2): MLA, sigmoid router with expert bias, shared expert, first layer dense"),
    Family("mimo", "MiMoForCausalLM", "mimo", path="remote", layout="qwen2", remote_fields=_o(num_nextn_predict_layers=1),
           note="remote code: Qwen2 (q/k/v biases) plus one MTP layer under model.mtp_layers.0 (MiMoMTPLayers: a Qwen2 "
                "decoder layer, token/hidden/final norms, input_proj [H, 2H]), as MiMo-7B ships"),
    Family("mimo_v2_flash", "MiMoV2FlashForCausalLM", "mimo_v2_flash", path="unbuilt",
           note="remote code; the Bridge's own model needs Transformer-Engine's attention for its sliding-window layers' "
                "learnable softmax sinks (MiMoV2FlashTEDotProductAttention subclasses TEDotProductAttention, "
                "mimo_v2_flash/modeling_mimo_v2_flash.py:231, :285), which no harness CPU stand-in computes yet; and no "
                "HF modeling class (transformers or the Bridge) lays its checkpoint out for a fixture"),
    # Llama-3.3-Nemotron-Super's kind of blocks: GQA groups of 2, a block without attention, MLPs of two widths
    # (ffn_mult 2.625 -> 256, 7.0 -> 512 at hidden 64: harness.models.remote.ffn_width), a block without MLP
    Family("llama_nemotron", "DeciLMForCausalLM", "nemotron-nas", path="remote", layout="llama",
           overrides=_o(intermediate_size=256), remote_fields=(("block_configs", Nested(json.dumps([
               {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
                "ffn": {"ffn_mult": 2.625, "no_op": False, "replace_with_linear": False}},
               {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
                "ffn": {"ffn_mult": 2.625, "no_op": False, "replace_with_linear": False}},
               {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
                "ffn": {"ffn_mult": 7.0, "no_op": False, "replace_with_linear": False}},
               {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
                "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}}]))),),
           note="remote code (DeciLM, Llama-Nemotron Super/Ultra): Llama blocks made heterogeneous by block_configs "
                "(a block without attention, MLP widths by ffn_mult, a block without MLP): megatron-core's heterogeneous "
                "layer spec"),
    Family("sarvam_mla", "SarvamMLAForCausalLM", "sarvam_mla", path="remote", layout="deepseek_v3", num_experts=4,
           overrides=_o(**{**_MLA, "q_lora_rank": None}, **_DSMOE),
           remote_fields=_o(num_experts=4, num_shared_experts=1, rope_theta=10000.0),  # sarvam/common.py:27-40 reads these names
           note="remote code in DeepSeek-V3's layout without a q LoRA (q_proj): MLA, sigmoid router with expert bias, "
                "shared expert, first layer dense; its configuration names the experts num_experts / num_shared_experts"),
    Family("sarvam_moe", "SarvamMoEForCausalLM", "sarvam_moe", path="remote", layout="bailing_moe_v2", num_experts=4,
           note="remote code in Bailing-MoE-V2's layout (the Bridge maps the same names: word_embeddings, "
                "attention.query_key_value / dense, query/key_layernorm, gate.expert_bias): GQA, QK norm, shared expert, "
                "first layer dense"),
    Family("step3p5", "Step3p5ForCausalLM", "step3p5", path="unbuilt",
           note="remote code: the Bridge ships and registers only its configuration (stepfun/configuration_step35.py, "
                "step35_bridge.py:57); its checkpoint layout (per-layer attention kinds and head counts, the head-wise "
                "attention gate g_proj, stacked MoE experts moe.gate_proj/up_proj/down_proj, MTP layers with "
                "transformer.shared_head) has no modeling class in transformers or the Bridge to write a fixture from "
                "(the harness derives no layout from the mapping under test)"),
    # each attention layer materializes the sbd_block_diff mask over [2S, 2S] at build, S the provider's seq_length 32768
    # (diffusion/common/dllm.py:181-215 compute_block_mask, create_block_mask uncompiled: a 34 GiB transient per layer,
    # two ranks at once; the Bridge sets no seq_length from the checkpoint: ministral3_provider.py:90)
    Family("nemotron_labs_diffusion", "NemotronLabsDiffusionModel", "nemotron_labs_diffusion", path="remote", layout="ministral3",
           needs="host-memory-gib>=96",
           note="remote code: a diffusion LM continued from Ministral 3, its text-only checkpoint the Ministral 3 model under "
                "encoder.* with a diffusion_head (the Bridge's text-only mapping); its attention builds a 34 GiB block mask "
                "per layer at the provider's seq_length 32768 (diffusion/common/dllm.py:181-215)"),
    # ---- VL / omni / audio, language path ("vl-text"): the fixture is the whole ConditionalGeneration model
    # (vision tower too: import and export see every key), logits on text tokens alone (harness.models.vl)
    # Qwen2.5-VL keeps the real head_dim 128 and M-RoPE sections [16, 24, 24]: the Bridge hard-codes the
    # sections (qwen_vl/qwen25_vl_provider.py:36; qwen25_vl_bridge.py reads no mrope_section)
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", path="vl-text",
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])),
           note="M-RoPE (sections 16/24/24), q/k/v biases, Qwen2.5 ViT (window attention) + merger"),
    # two DeepStack taps (of the ViT's 2 blocks): the Bridge puts every DeepStack merge on the first pipeline stage,
    # so a stage must hold at least as many layers as there are taps (modelling_qwen3_vl/model.py:360 asserts)
    Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3_vl", path="vl-text",
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True),
                        **{"vision.deepstack_visual_indexes": [0, 1]}),
           note=_TE_VL.format(c="Qwen3VLModelProvider", f="qwen_vl/qwen3_vl_provider.py:148",
                              v="qwen_vl/modelling_qwen3_vl/model.py:305")),
    Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", path="vl-text", num_experts=4,
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True),
                        **{"vision.deepstack_visual_indexes": [0, 1]}),
           note=_TE_VL.format(c="Qwen3VLMoEModelProvider", f="qwen_vl/qwen3_vl_provider.py:314",
                              v="qwen_vl/modelling_qwen3_vl/model.py:305")),
    # SigLIP without its pooling head, as Gemma 3 ships (vision_use_head false; modeling_gemma3_vl.py:96 builds none)
    Family("gemma3_vl", "Gemma3ForConditionalGeneration", "gemma3", path="vl-text", tied=True, num_layers=6,
           overrides=_o(sliding_window=8, query_pre_attn_scalar=8, **{"vision.vision_use_head": False}),
           note="Gemma 3 text (as hf-gemma3) + SigLIP tower + avg-pool projector"),
    Family("gemma4_vl", "Gemma4ForConditionalGeneration", "gemma4", path="vl-text", tied=True,
           overrides=_o(sliding_window=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, global_head_dim=16),
           note="Gemma 4 text (as hf-gemma4) + its vision tower"),
    Family("glm4v_moe", "Glm4vMoeForConditionalGeneration", "glm4v_moe", path="vl-text", num_experts=4,
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128, n_shared_experts=1,
                        first_k_dense_replace=1, use_qk_norm=False,  # as GLM-4.5V's config.json carries it (glm_45v_bridge.py:72 reads it)
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[8, 12, 12])),
           note="M-RoPE over half the head (sections 8/12/12), shared expert, first layer dense, GLM-4V ViT"),
    # Ministral 3's text config (the Bridge's Ministral3ModelProvider): its provider_bridge reads neither rms_norm_eps nor
    # the rope (ministral3_bridge.py:97-113): the provider's defaults stand (eps 1e-5, YaRN factor 16 over 16384,
    # ministral3_provider.py:86-100), which are Ministral 3's own (ministral3 config defaults, kept), but for YaRN's
    # `truncate`: the provider's correction range is unrounded (yarn_correction_range_round_to_int False, :97), so the
    # fixture says truncate false (transformers' default True: logits 5.4e-5 off); untied, as Ministral 3 ships
    Family("mistral3", "Mistral3ForConditionalGeneration", "mistral3", path="vl-text",
           overrides=_o(text_model_type="ministral3", rms_norm_eps=1e-5, max_position_embeddings=262144,
                        rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                                             max_position_embeddings=262144, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                             mscale_all_dim=1.0, llama_4_scaling_beta=0.1, truncate=False)),
           note="Ministral 3 text (YaRN, Llama-4 attention scaling) + Pixtral tower + patch-merger projector"),
    Family("exaone4_5", "Exaone4_5_ForConditionalGeneration", "exaone4_5", path="vl-text",
           note="EXAONE 4 text + a Megatron-built ViT: its ViT layers are get_vit_layer_with_transformer_engine_spec() "
                "(exaone/exaone45/modelling_exaone45/model.py:130) and its block spec use_transformer_engine=True "
                "(exaone45_provider.py:48): Transformer-Engine only"),
    Family("qwen3_5_vl", "Qwen3_5ForConditionalGeneration", "qwen3_5", path="vl-text",
           note="gated DeltaNet text (as hf-qwen3_5_text, which runs) + a Megatron-built ViT: the provider's provide() builds "
                "its language block with megatron-core's TE-only get_transformer_block_with_experimental_attention_variant_spec "
                "(qwen_vl/qwen35_vl_provider.py:215, :460; experimental_attention_variant_module_specs.py:442-453) and its ViT "
                "with get_vit_layer_with_transformer_engine_spec() (:507): Transformer-Engine only"),
    Family("qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", path="vl-text", num_experts=4,
           note="gated DeltaNet MoE text (as hf-qwen3_5_moe_text, which runs) + a Megatron-built ViT: as hf-qwen3_5_vl, "
                "its language block and ViT specs are Transformer-Engine only (qwen_vl/qwen35_vl_provider.py:419-460, :507)"),
    # RoPE over half the head, as MiniMax-M3 (64 of 128), said both ways: the Bridge reads rotary_dim (rotary_percent =
    # rotary_dim / head_dim, minimax_m3_bridge.py:333-337), transformers rope_parameters' partial_rotary_factor
    # (modeling_minimax_m3_vl.py:301-303); layer_types: the class default's (full attention) cut to 4 layers
    Family("minimax_m3_vl", "MiniMaxM3SparseForConditionalGeneration", "minimax_m3_vl", path="vl-text", num_experts=4,
           overrides=_o(rotary_dim=4, rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5)),
           note="MiniMax-M3 text (experts, QK norm, partial RoPE, (1 + w) norms) + its vision tower; the Bridge's flex "
                "(DeepEP HybridEP, CUDA-only) token dispatcher runs as alltoall here (harness.models.bridge)"),
    # audio-text: transformers' Qwen2-Audio (Whisper-like encoder, avg-pool, linear projector) whole; the Bridge's
    # Qwen2AudioModel holds the same HF encoder (modeling_qwen2_audio.py:137) beside its Megatron language model
    Family("qwen2_audio", "Qwen2AudioForConditionalGeneration", "qwen2_audio", path="vl-text",
           note="Qwen2 text (q/k/v biases) + a Whisper-like audio tower and linear projector, both replicated"),
    # omni: the thinker (text + ViT + audio encoder) of a thinker-only checkpoint (enable_audio_output false, as
    # Qwen3-Omni-30B-A3B-Thinking ships): the Bridge maps the thinker alone (qwen25_omni_bridge.py:101-150); text as
    # Qwen2.5-VL's / Qwen3-VL-MoE's (M-RoPE sections the Bridge reads or defaults)
    Family("qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration", "qwen2_5_omni", path="vl-text",
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])),
           note="omni thinker: Qwen2.5 text (M-RoPE 16/24/24, q/k/v biases) + Qwen2.5 ViT + audio encoder; no talker"),
    Family("qwen3_omni", "Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe", path="vl-text", num_experts=4,
           overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True),
                        **{"vision.deepstack_visual_indexes": [0, 1]}),
           note="omni thinker: Qwen3 MoE text (M-RoPE, QK norm) + Qwen3 ViT (DeepStack) + audio encoder; no talker"),
    # ERNIE-4.5-VL: its language block is the provider's own (ernie_decoder_layer_spec.py:219: a dense first layer, then
    # text and vision expert pools and shared experts), built on CPU where its TE-or-local picker is swapped for the
    # stand-ins (harness.models.vl TE_PICKER)
    Family("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration", "ernie4_5_vl_moe", path="vl-text", num_experts=4,
           tied=True, overrides=_o(hidden_size=256, num_attention_heads=2, num_key_value_heads=2),  # head_dim 128: its 3-D RoPE
           note="ERNIE 4.5 MoE text with text and vision expert pools (the text pool on text tokens), shared experts, "
                "3-D RoPE; its own heterogeneous block on the CPU stand-ins (vl.TE_PICKER)"),
    # ---- VL / omni / audio without a language-path case here: the reason in the note
    *(Family(n, a, mt, path="vl", note=why) for n, a, mt, why in (
        ("kimi_k25_vl", "KimiK25ForConditionalGeneration", None, "remote code; the Bridge builds its vision tower from the checkpoint's own hub code (kimi_vl/modeling_kimi_k25_vl.py:156-160: get_class_from_dynamic_module('modeling_kimi_k25.MoonViT3dPretrainedModel', hf_model_path)), which neither transformers nor the Bridge ships: no fixture can be built without it"),
        ("nemotron_vl", "NemotronH_Nano_VL_V2", None, "remote code; the Bridge's NemotronVLModel is a language-only stub (nemotron_vl/modeling_nemotron_vl.py:23-28: vision inputs raise NotImplementedError until a reference vision encoder is open-sourced), and no modeling class lays out its RADIO tower and projector for a fixture"),
        ("nemotron_omni", "NemotronH_Nano_Omni_Reasoning_V3", None, "remote code; its vision and sound towers' checkpoint layout comes only with the hub's modeling code (the Bridge copies it through ADDITIONAL_FILE_PATTERNS, nemotron_omni/nemotron_omni_bridge.py:74), which transformers lacks: no fixture here"),
        ("qwen3_asr", "Qwen3ASRForConditionalGeneration", None, "remote code the Bridge vendors (qwen3_asr/hf_qwen3_asr, "
         "registered with transformers' Auto classes at hf_qwen3_asr/__init__.py:39-50), which cannot build its HF model under "
         "the transformers Megatron-Bridge 0.6.2 requires (>=5.8, <=5.12.1): Qwen3ASRThinkerTextModel reads config.pad_token_id, "
         "which transformers 5's PretrainedConfig no longer defines (modeling_qwen3_asr.py:970, AttributeError), and with it "
         "given, its rotary embedding looks up ROPE_INIT_FUNCTIONS['default'] (modeling_qwen3_asr.py:794), which transformers "
         "5.12.1 lacks (KeyError): no fixture can be written from it"),
        ("step3p7_vl", "Step3p7ForConditionalGeneration", None, "remote code: the Bridge ships its configuration only (stepfun/configuration_step37.py, step37_bridge.py:67), no modeling class lays its checkpoint out for a fixture"),
    )),
)

BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
