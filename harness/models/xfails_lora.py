"""Named upstream defects of the peft-export (LoRA) cases of matrices/architectures.yaml: strict
xfails keyed "family" (every pair) or "family pair" (one pair), filled from the triage
(docs/architectures.md). Data only; harness.models.architectures writes them into the matrix."""

from __future__ import annotations

from typing import Any

from harness.models.xfails_roundtrip import ROUNDTRIP

#: peft drops the LoRA of plain gate/up/down_proj Linears in a model whose experts transformers fuses
_PEFT_MOE = ("peft 0.21.2 rewrites the LoRA config of every model transformers 5 fuses the experts of (its qwen2_moe "
             "conversion pattern): peft/utils/transformers_weight_conversion.py:444-482 (_convert_peft_config_moe, run by "
             "get_peft_model and PeftModel.from_pretrained through convert_peft_config_for_transformers :485-506) moves every "
             "target_modules entry gate_proj/up_proj/down_proj (_MOE_TARGET_MODULE_MAPPING :339-344) to target_parameters "
             "gate_up_proj/down_proj, so the plain nn.Linear gate/up/down_proj of the dense first layer and of the shared experts "
             "are no longer targeted: their adapter keys load as unexpected and their LoRA is dropped (peft alone: "
             "get_peft_model(target_modules=[..., 'gate_proj', 'up_proj', 'down_proj']) on the tiny model wraps none of them)")
_PEFT_MOE_MATCH = r"unexpected: base_model\.model\.model\.layers\.\d+\.mlp\.(?:shared_experts\.|shared_mlp\.)?(?:gate|up|down)_proj\.lora_"
_PEFT_MOE_CHECKS = ["peft-load", "merge", "logits", "merged-logits", "lora-targets-matched"]
_PEFT_MOE_XFAIL = {"reason": _PEFT_MOE, "match": _PEFT_MOE_MATCH, "checks": _PEFT_MOE_CHECKS}

#: matrices/smoke.yaml `tag: defect-etp-fc1`: the export at expert-TP > 1 cuts the experts' fc1 LoRA-B wrong
_ETP_FC1 = ("Megatron-Bridge 0.6.2 save_hf_adapter with expert tensor parallel > 1: peft_bridge.py:498 "
            "_split_fused_fc1_linear_out_weight takes tp_size = 1 for experts, so the expert fc1 LoRA-B gathered over ETP "
            "([gate_0; up_0; gate_1; up_1]) is cut in halves instead of de-interleaved: every expert's gate_proj/up_proj "
            "lora_B exported at D (ETP 2) differs from the export at S (ETP 1), which the harness's derivation matches")
_ETP_FC1_MATCH = r"experts\.\d+\.(?:gate|up)_proj\.lora_B"

#: transformers fuses HY-V3's experts on load but peft does not know it
_HY_V3 = ("transformers 5.12.1 fuses HY-V3's per-expert checkpoint keys on load (conversion_mapping.py:1446-1450) but does not "
          "list hy_v3 in _MODEL_TO_CONVERSION_PATTERN (conversion_mapping.py:39-132), which peft 0.21.2's _convert_peft_config_moe "
          "reads (peft/utils/transformers_weight_conversion.py:413-416 returns for an unlisted model_type): target_modules "
          "gate_proj/up_proj/down_proj stay module targets, the fused HYV3Experts parameters are not targeted, and the adapter's "
          "per-expert keys, renamed to the fused names on load, load as unexpected: every routed expert's LoRA is dropped (peft "
          "alone: get_peft_model(target_modules=[..., 'gate_proj', 'up_proj', 'down_proj']) on the tiny HY-V3 wraps the dense "
          "and shared MLPs and no expert)")
_HY_V3_MATCH = r"unexpected: base_model\.model\.model\.layers\.\d+\.mlp\.experts\.(?:base_layer\.)?lora_[AB]"
_ERNIE_ROUTER = "; and, for the logits, " + ROUNDTRIP["ernie4_5_moe"]["reason"]
_GPT_OSS = ("Megatron-Bridge 0.6.2 merged export (save_hf_pretrained with LoRA): GPT-OSS's expert mappings are grouped exports "
            "whose megatron_to_hf un-interleaves and transposes to HF's (hidden, 2 x ffn) / (ffn, hidden) layout "
            "(gpt_oss/gpt_oss_bridge.py:253-265, :303-308), then model_bridge.py:1361-1372 -> peft_bridge.py:1275-1333 "
            "_merge_grouped_export_adapter_weights adds the Megatron-layout delta B @ A (2 x ffn, hidden) to that converted "
            "tensor: lora_merge.py:70 raises on the shape (it would be the wrong layout even where the shapes agreed)")


_POST_NORM_LORA = {
    "reason": "Megatron-Bridge 0.6.2: LoRA on a post-normed row-parallel linear (linear_proj / linear_fc2 of Gemma2, Gemma3, "
              "EXAONE 4: TERowParallelLinearLayerNorm, models/common/te_layers.py:49-57, applies post_layernorm inside its forward) "
              "adds the adapter after that norm (peft/lora_layers.py:80-84: linear_output + adapter_output): post_norm(Wx) + BAx; "
              "transformers+PEFT adapt o_proj/down_proj before post_attention_layernorm/post_feedforward_layernorm: "
              "post_norm(Wx + BAx) (shown: the adapter moved before the norm matches PEFT, gemma3 fc2 3.17 -> 1.0e-05, "
              "exaone4 proj 1.71 -> 1.4e-06; q/k/v and fc1 LoRA alone pass)",
    "checks": ["logits", "merged-logits"]}
_GEMMA4 = {
    "reason": "Megatron-Bridge 0.6.2 Gemma4Bridge._split_qkv_linear_out_weight (models/gemma/gemma4_bridge.py:572-595) recognises "
              "a global layer's fused LoRA linear_out by hasattr(config, 'global_head_dim') and reads config.global_head_dim / "
              "num_global_key_value_heads (:581-583), fields of the MoE Gemma4ModelProvider (gemma4_provider.py:296-297); the "
              "dense Gemma4DenseProvider (Gemma4ForCausalLM) names them global_kv_channels / num_global_query_groups (:167-168), "
              "so a global layer's q/k/v adapter is split with the sliding layers' shape (conversion/param_mapping.py:3294)",
    "match": "shape '\\[16, 8, 4\\]' is invalid for input of size 1024", "raised_in": "megatron.bridge.models.conversion"}
#: Pairs whose upstream code path needs CUDA (the matrix entry `requires: [cuda]`: not-run on CPU, run on GPU machines).
NEEDS_CUDA: dict[str, str] = {
    "minimax_m2 tp1 -> tp2": "Megatron-Bridge 0.6.2 MiniMax-M2's QK-norm import at TP > 1 broadcasts through "
                             "torch.device('cuda', torch.cuda.current_device()) (minimax_m2/minimax_m2_bridge.py:63)",
}


def _xfail(reason: str, match: str, checks: list[str], etp: bool = False) -> dict[str, Any]:
    """One strict xfail; `etp`: the pair's D has expert-TP 2, so the ETP fc1 export defect fails resharded-export too."""
    if etp:
        return {"reason": f"{reason}; and {_ETP_FC1}", "match": match, "checks": [*checks, "resharded-export"]}
    return {"reason": reason, "match": match, "checks": checks}


LORA: dict[str, dict[str, Any]] = {
    # blocked at build as the family's hf-roundtrip (the same upstream error)
    "deepseek_v4": ROUNDTRIP["deepseek_v4"],
    "glm_moe_dsa": ROUNDTRIP["glm_moe_dsa"],
    "olmoe tp1 -> tp2": ROUNDTRIP["olmoe tp1 -> tp2"],
    "qwen3_moe tp1 -> tp2": {"reason": _ETP_FC1, "match": _ETP_FC1_MATCH, "checks": ["resharded-export"]},
    "glm4_moe": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS),  # tp2etp1: no expert-TP
    **{f"{f} tp1 -> pp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS) for f in ("exaone_moe", "exaone_moe_caps")},
    **{f"{f} tp1 -> tp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS, etp=True) for f in ("exaone_moe", "exaone_moe_caps")},
    "ernie4_5_moe tp1 -> pp2": _xfail(_PEFT_MOE + _ERNIE_ROUTER, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS),
    "ernie4_5_moe tp1 -> tp2": _xfail(_PEFT_MOE + _ERNIE_ROUTER, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS, etp=True),
    # multi-latent attention: the MLA linears' LoRA passes alone (every check, tp1 -> tp2); the dense first layer's and
    # the shared experts' MLP LoRA meet _PEFT_MOE, the tp2 export (ETP 2) the expert fc1 LoRA-B cut
    **{f"{f} tp1 -> pp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS) for f in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")},
    **{f"{f} tp1 -> tp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS, etp=True) for f in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")},
    "hy_v3 tp1 -> pp2": _xfail(_HY_V3, _HY_V3_MATCH, _PEFT_MOE_CHECKS),
    "hy_v3 tp1 -> tp2": _xfail(_HY_V3, _HY_V3_MATCH, _PEFT_MOE_CHECKS, etp=True),
    **{f: _POST_NORM_LORA for f in ("gemma2", "gemma3", "exaone4")},
    "gemma4": _GEMMA4,
    "gpt_oss": {"reason": _GPT_OSS, "match": r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at non-singleton dimension 1",
                "raised_in": "megatron.bridge.peft"},
}
