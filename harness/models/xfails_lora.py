"""Named upstream defects of the peft-export (LoRA) cases of matrices/architectures.yaml: strict
xfails keyed "family" (every pair) or "family pair" (one pair), filled from the triage
(docs/architectures.md). Data only; harness.models.architectures writes them into the matrix."""

from __future__ import annotations

from typing import Any

from harness.models.xfails_roundtrip import QWEN25_OMNI_ROPE, ROUNDTRIP, VL_LAYOUT_REFUSALS
from harness.report.grid import MAMBA_TAG

#: peft drops the LoRA of plain gate/up/down_proj Linears in a model whose experts transformers fuses
_PEFT_MOE = ("peft 0.21.2 rewrites the LoRA config of every model transformers 5 fuses the experts of (its qwen2_moe "
             "conversion pattern): peft/utils/transformers_weight_conversion.py:444-482 (_convert_peft_config_moe, run by "
             "get_peft_model and PeftModel.from_pretrained through convert_peft_config_for_transformers :485-506) moves every "
             "target_modules entry gate_proj/up_proj/down_proj (_MOE_TARGET_MODULE_MAPPING :339-344) to target_parameters "
             "gate_up_proj/down_proj, so the plain nn.Linear gate/up/down_proj of the dense first layer and of the shared experts "
             "are no longer targeted: their adapter keys load as unexpected and their LoRA is dropped (peft alone: "
             "get_peft_model(target_modules=[..., 'gate_proj', 'up_proj', 'down_proj']) on the tiny model wraps none of them)")
_PEFT_MOE_MATCH = r"unexpected: base_model\.model\.model\.(?:language_model\.)?layers\.\d+\.mlp\.(?:shared_experts?\.|shared_mlp\.)?(?:gate|up|down)_proj\.lora_"
#: peft-resave: what peft dropped on load is not in its re-save either (cases/shared/peft_resave.py)
_PEFT_MOE_CHECKS = ["peft-load", "merge", "logits", "merged-logits", "lora-targets-matched", "peft-resave"]
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
#: Qwen3.5-MoE: transformers fuses its experts under a conversion pattern peft has no MoE mapping for
_QWEN35_MOE = ("transformers 5.12.1 maps qwen3_5_moe_text to the conversion pattern qwen3_5_text (conversion_mapping.py:99) and "
               "fuses its experts on load (mapping['qwen3_5_moe_text'] += qwen2_moe's, :1452-1453), but peft 0.21.2's "
               "_MOE_TARGET_MODULE_MAPPING (peft/utils/transformers_weight_conversion.py:332-351) has no qwen3_5_text entry, so "
               "_convert_peft_config_moe returns (:418-420): target_modules gate_proj/up_proj/down_proj stay module targets, the "
               "fused experts are not targeted, and the adapter's per-expert keys, renamed to the fused names on load, load as "
               "unexpected: every routed expert's LoRA is dropped (the shared expert's plain Linears keep theirs)")
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
#: matrices/smoke.yaml `tag: defect-ep-adapter`: the export at EP > 1 holds EP rank 0's local experts only
_EP_EXPORT = ("Megatron-Bridge 0.6.2 save_hf_adapter at EP>1 exports only EP rank 0's expert adapters: peft_bridge.py:565-618 "
              "_megatron_global_adapters_info_all_pp_ranks gathers the adapter list over the PP group only, and model_bridge.py:310 "
              "_megatron_local_name_to_global leaves adapter params out of the local->global expert renumbering ('.adapter.' not "
              "in param_name), so the SequentialMLP experts of EP rank 1 are missing from the adapter exported at dp2ep2 (a "
              "grouped-expert family's one adapter per EP rank exports whole: olmoe, minimax_m2, glm4_moe, exaone_moe pass it)")
_EP_EXPORT_MATCH = r"experts\.\d+\.(?:gate|up|down)_proj\.lora_[AB]\.weight \([^)]*\) is in no file of the export"
_EP_CHECKS = ["export-integrity", "resharded-export"]


def _with_ep(xfail: dict[str, Any] | None = None) -> dict[str, Any]:
    """The EP export defect at tp1 -> dp2ep2, with the family's own named defect where it has one."""
    if xfail is None:
        return {"reason": _EP_EXPORT, "match": _EP_EXPORT_MATCH, "checks": _EP_CHECKS}
    return {"reason": f"{xfail['reason']}; and {_EP_EXPORT}", "match": xfail["match"], "checks": [*xfail["checks"], *_EP_CHECKS]}


#: transformers fuses MiniMax-M3's experts and shared expert on load but peft does not know it
_M3 = ("transformers 5.12.1 fuses MiniMax-M3 VL's checkpoint on load: each layer's routed experts w1/w3 into experts.gate_up_proj and "
       "w2 into experts.down_proj (3-D parameters), and the shared expert's gate_proj/up_proj into one shared_experts.gate_up_proj "
       "Linear (conversion_mapping.py:458-566), but does not list minimax_m3_vl in _MODEL_TO_CONVERSION_PATTERN "
       "(conversion_mapping.py:39-132), which peft 0.21.2's _convert_peft_config_moe reads (peft/utils/"
       "transformers_weight_conversion.py:413-416 returns for an unlisted model_type): target_modules w1/w2/w3/gate_proj/up_proj "
       "stay module names, no fused expert parameter and no fused gate_up_proj is targeted, and every routed expert's LoRA and the "
       "shared expert's gate/up LoRA are dropped (peft alone: get_peft_model(target_modules=[w1, w2, w3, gate_proj, up_proj, "
       "down_proj]) on the tiny model wraps the 4 shared_experts.down_proj and nothing else)")
_M3_MATCH = r"linear_fc1(?:_up|_gate)?: megatron \d+, peft 0 \(only megatron: model\.layers\.\d+\.mlp\.experts\."
_M3_CHECKS = ["peft-load", "lora-targets-matched", "merge", "logits", "merged-logits", "peft-resave"]


#: a VL or audio model's exported adapter_config targets the encoder tower too
_VL_TARGETS = ("Megatron-Bridge 0.6.2 save_hf_adapter writes adapter_config.json's target_modules as bare leaf names "
               "(conversion/peft_bridge.py:1436-1452 infer_target_modules_from_adapter_weights, called at auto_bridge.py:905): "
               "on a VL or audio model PEFT's suffix match also wraps the encoder tower's linears of the same names (Qwen2.5-VL ViT "
               "mlp.gate/up/down_proj, SigLIP self_attn.q/k/v_proj, Pixtral attention.*_proj and feed_forward.*_proj, "
               "Qwen2-Audio's Whisper encoder self_attn.q/k/v_proj), for which the adapter has no weights: "
               "PeftModel.from_pretrained warns of missing adapter keys and the tower gets "
               "fresh LoRA layers the adapter never trained (zero lora_B: no effect until trained)")
# the tower in transformers' memory: `model.audio_tower.` (5.12.1), `audio_tower.` (5.8.1), an omni thinker's `thinker.`
_VL_TARGETS_MATCH = r"only peft: (?:(?:model|thinker)\.)?(?:visual|vision_tower|audio_tower)\."
_VL_TARGETS_CHECKS = ["peft-load", "lora-targets-matched"]
#: peft applies transformers 5's checkpoint renaming by model_type only
_QWEN_VL_NOOP = ("peft 0.21.2 renames an adapter's checkpoint keys for transformers 5 only when "
                 "get_checkpoint_conversion_mapping(model_type) has an entry (peft/utils/transformers_weight_conversion.py:569-571; "
                 "else the legacy model._checkpoint_conversion_mapping, peft_model.py:510-511, which transformers 5 models no longer "
                 "carry); transformers 5.12.1 registers Qwen2.5-VL's `^model` -> `model.language_model` renaming under the class name "
                 "(conversion_mapping.py:123 -> :646-651) and looks classes up first (:1512-1519), so transformers loads the checkpoint "
                 "but peft leaves the adapter's checkpoint-named keys (base_model.model.model.layers.N..., as the base checkpoint and "
                 "the Bridge's export name them) unmapped: nothing loads, every lora_B stays zero, the adapter is a no-op")
#: Families whose LoRA case the harness does not generate yet, with what the harness lacks (a gap of the harness's
#: own derivation, not an upstream finding: listed in matrices/architectures.yaml and docs/architectures.md).
LORA_NOT_GENERATED: dict[str, str] = {}
#: VL families whose Megatron model builds its ViT from Megatron layers (vision_model.decoder.layers.N: the same
#: linear_qkv / linear_proj / linear_fc1 / linear_fc2 names as the language layers): their LoRA cases adapt the language
#: path only (PeftOptions scope "language"), as the Qwen2.5-VL / Gemma 3 ones do by construction (an HF vision tower)
LANGUAGE_ONLY_LORA = ("qwen3_vl", "qwen3_vl_moe", "exaone4_5", "qwen3_5_vl", "qwen3_5_moe_vl")
#: why (docs/architectures.md, the matrix comment)
LANGUAGE_ONLY_WHY = ("the ViT's adapters are not judged yet: the harness's adapter mapping (harness.models.peft_mapping) "
                     "has no Megatron-ViT -> HF visual-block layout (fused qkv per head, the mergers' fc1/fc2)")
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
    # VL language paths: every family's exported adapter_config also targets its vision tower (_VL_TARGETS)
    "qwen2_5_vl": {"reason": f"{_QWEN_VL_NOOP}; and {_VL_TARGETS}", "match": "no-op adapter: all \\d+ lora_B of the loaded adapter are zero",
                   "checks": [*_VL_TARGETS_CHECKS, "merge", "logits", "merged-logits", "peft-resave"]},
    "gemma3_vl": {"reason": f"{_POST_NORM_LORA['reason']}; and {_VL_TARGETS}", "match": _VL_TARGETS_MATCH,
                  "checks": [*_VL_TARGETS_CHECKS, *_POST_NORM_LORA["checks"]]},
    "mistral3": {"reason": _VL_TARGETS, "match": _VL_TARGETS_MATCH, "checks": _VL_TARGETS_CHECKS},
    "qwen2_audio": {"reason": _VL_TARGETS, "match": _VL_TARGETS_MATCH, "checks": _VL_TARGETS_CHECKS},
    # the VL model's provider is the dense one's subclass (gemma_vl/gemma4_vl_provider.py:77 Gemma4DenseVLProvider)
    "gemma4_vl": _GEMMA4,
    "glm4v_moe tp1 -> pp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS),
    # tp1 -> dp2ep2: the experts over two EP ranks
    "qwen3_moe tp1 -> dp2ep2": _with_ep(),
    **{f"{f} tp1 -> dp2ep2": _with_ep(_xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS))
       for f in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")},
    "ernie4_5_moe tp1 -> dp2ep2": _with_ep(_xfail(_PEFT_MOE + _ERNIE_ROUTER, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS)),
    "hy_v3 tp1 -> dp2ep2": _with_ep(_xfail(_HY_V3, _HY_V3_MATCH, _PEFT_MOE_CHECKS)),
    **{f"{f} tp1 -> dp2ep2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS) for f in ("exaone_moe", "exaone_moe_caps", "glm4v_moe")},
    "glm4v_moe tp1 -> tp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS, etp=True),
    # MiniMax-M3 VL: its fused experts and shared expert unknown to peft, and its vision tower targeted (_VL_TARGETS)
    **{f"minimax_m3_vl {p}": _xfail(f"{_M3}; and {_VL_TARGETS}", _M3_MATCH, _M3_CHECKS) for p in ("tp1 -> pp2", "tp1 -> dp2ep2")},
    "minimax_m3_vl tp1 -> tp2": _xfail(f"{_M3}; and {_VL_TARGETS}", _M3_MATCH, _M3_CHECKS, etp=True),
    "gpt_oss": {"reason": _GPT_OSS, "match": r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at non-singleton dimension 1",
                "raised_in": "megatron.bridge.peft"},
    # gated DeltaNet hybrids: Qwen3-Next's shared expert meets _PEFT_MOE (its qwen2_moe pattern), Qwen3.5-MoE's routed experts
    # _QWEN35_MOE; the tp2 export (expert TP 2) the expert fc1 LoRA-B cut, dp2ep2 the EP export defect
    "qwen3_next tp1 -> pp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS),
    "qwen3_next tp1 -> tp2": _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS, etp=True),
    "qwen3_next tp1 -> dp2ep2": _with_ep(_xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS)),
    "qwen3_5_moe_text tp1 -> pp2": _xfail(_QWEN35_MOE, _HY_V3_MATCH, _PEFT_MOE_CHECKS),
    "qwen3_5_moe_text tp1 -> tp2": _xfail(_QWEN35_MOE, _HY_V3_MATCH, _PEFT_MOE_CHECKS, etp=True),
    "qwen3_5_moe_text tp1 -> dp2ep2": _with_ep(_xfail(_QWEN35_MOE, _HY_V3_MATCH, _PEFT_MOE_CHECKS)),
}

#: CanonicalLoRA (one adapter per q/k/v and per fc1 gate/up) at one pair per family: tp1 -> pp2 where the layers
#: split (a TP change meets smoke's CanonicalLoRA fc1 reshard defect in every family), else the family's first pair
_CANON_NONGATED = ("Megatron-Bridge 0.6.2 CanonicalLoRA assumes a gated fc1: canonical_lora.py:173 LoRALinearSplitFC1UpGate.forward "
                   "calls adapter_gate unconditionally (None on Nemotron's non-gated squared-ReLU fc1: TypeError), and "
                   "canonical_lora.py:398-400 build adapter_up/adapter_gate with out_features // 2 without looking at "
                   "gated_linear_unit (smoke's defect-canonical-nongated)")
_CANON_GROUPED = ("Megatron-Bridge 0.6.2 merged export of grouped experts with CanonicalLoRA: "
                  "peft_bridge.py:1292-1300 _merge_grouped_export_adapter_weights accepts exactly one adapter with adapter_key "
                  "None per expert linear and raises on CanonicalLoRA's adapter_gate/adapter_up pair (GPT-OSS's expert "
                  "mappings are grouped exports, gpt_oss/gpt_oss_bridge.py:253-265)")
_CANON_GATED = ("Megatron-Bridge 0.6.2 CanonicalLoRA ignores attention_output_gate (Qwen3-Next, Qwen3.5): "
                "LoRALinearSplitQKV._interleave_qkv (peft/canonical_lora.py:90-142) lays the q/k/v adapters' outputs out as "
                "[q, k, v] per query group, while the gated linear_qkv's output is [q, gate, k, v] per group (megatron-core "
                "attention.py:1829-1881), so the forward adds tensors of different widths (canonical_lora.py:156)")
CANONICAL: dict[str, dict[str, Any]] = {
    **{f: ROUNDTRIP[f] for f in ("deepseek_v4", "glm_moe_dsa")},  # blocked at build as the family's hf-roundtrip
    **{f: ROUNDTRIP[f"{f} tp1 -> pp2"] for f in ("gemma4", "gemma4_vl")},  # the provider's PP=1 refusal
    **{f: _POST_NORM_LORA for f in ("gemma2", "gemma3", "exaone4")},
    "nemotron": {"reason": _CANON_NONGATED, "match": "'NoneType' object is not callable", "raised_in": "megatron.bridge.peft"},
    "gpt_oss": {"reason": _CANON_GROUPED, "match": "Unsupported adapter configuration for grouped export weight merging",
                "raised_in": "megatron.bridge.models.conversion"},
    **{f: _xfail(_PEFT_MOE, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS)
       for f in ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "exaone_moe", "exaone_moe_caps", "glm4v_moe")},
    "ernie4_5_moe": _xfail(_PEFT_MOE + _ERNIE_ROUTER, _PEFT_MOE_MATCH, _PEFT_MOE_CHECKS),
    "hy_v3": _xfail(_HY_V3, _HY_V3_MATCH, _PEFT_MOE_CHECKS),
    **{f: {"reason": _CANON_GATED, "match": r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at non-singleton dimension 2",
           "raised_in": "megatron.bridge.peft"} for f in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
}


def canonical_pair(pairs: list[str]) -> str:
    """The one pair a family's CanonicalLoRA case runs at (CANONICAL's comment)."""
    return "tp1 -> pp2" if "tp1 -> pp2" in pairs else pairs[0]


# the VL language paths' CanonicalLoRA meets the LoRA findings (adapter_config targets, Qwen2.5-VL's no-op load)
CANONICAL.update({f: LORA[f] for f in ("qwen2_5_vl", "gemma3_vl", "mistral3", "qwen2_audio")})
CANONICAL["minimax_m3_vl"] = LORA["minimax_m3_vl tp1 -> pp2"]

# ---- the Mamba hybrids: the provider's VPP refusal, as their round trips; Nemotron-H's squared-ReLU MLP as Nemotron's
for _f in ("nemotron_h", "falcon_h1"):
    LORA[f"{_f} tp1 -> pp2vpp2"] = ROUNDTRIP[f"{_f} tp1 -> pp2vpp2"]
CANONICAL["nemotron_h"] = CANONICAL["nemotron"]

# ---- the Mamba-2 projections' LoRA (targets in_proj / out_proj: no adapter kind's default, named in `targets`), on the
#      families whose HF Mamba layer is transformers' `mixer` (Nemotron-H): family -> (pair, targets, tag, xfail or None)
_MAMBA_IN_PROJ_TP = ("Megatron-Bridge 0.6.2 exports a Mamba in_proj LoRA trained at TP > 1 with lora_B's rows as the TP shards "
                     "concatenated ([z_0, x_0, B_0, C_0, dt_0, z_1, ...], megatron-core's MambaMixer splits each part over TP), "
                     "not HF's [z, x, B, C, dt]: the base in_proj's export de-interleaves its parts, the adapter's does not "
                     "(the harness's own derivation equals the plain concatenation only with its de-interleave switched off); "
                     "Nemotron-H trained at TP 2: transformers + PEFT on that adapter is off Megatron + LoRA by 1.14 in the logits")
_MAMBA_OUT_PROJ = ("peft 0.21.2 refuses a LoRA on a Mamba model's out_proj (tuners_utils.py _check_lora_target_modules_mamba: "
                   "'conv1d' and 'out_proj' are incompatible with Mamba-based models, nemotron_h and falcon_h1 among them, whose "
                   "fused kernel reads out_proj.weight directly), while Megatron-Bridge 0.6.2 trains one on the Mamba mixer's "
                   "out_proj without a word and save_hf_adapter writes it to target_modules: the adapter it exports does not load in PEFT")
_IN_PROJ_LORA_B = r"\.(?:mixer|mamba)\.in_proj\.lora_B"
_OUT_PROJ = {"reason": _MAMBA_OUT_PROJ, "match": "Module 'out_proj' is incompatible with Mamba-based models", "raised_in": "peft.tuners"}
_IN_PROJ, _OUT = ("in_proj", "linear_qkv"), ("in_proj", "out_proj")
MAMBA_LORA: dict[str, tuple[tuple[str, tuple[str, ...], str, dict[str, Any] | None], ...]] = {
    "nemotron_h": (
        ("tp1 -> pp2", _IN_PROJ, f"{MAMBA_TAG}in-proj", None),
        ("tp1 -> tp2", _IN_PROJ, f"{MAMBA_TAG}in-proj",
         {"reason": _MAMBA_IN_PROJ_TP, "match": _IN_PROJ_LORA_B, "checks": ["resharded-export"]}),
        ("tp2 -> tp1", _IN_PROJ, f"{MAMBA_TAG}in-proj",
         {"reason": _MAMBA_IN_PROJ_TP, "match": _IN_PROJ_LORA_B,
          "checks": ["adapter-derivation", "logits", "merged-logits", "resharded-export"]}),
        ("tp1 -> pp2", _OUT, f"{MAMBA_TAG}out-proj", _OUT_PROJ),
    ),
    # Falcon-H1's Mamba mixer sits beside attention in every layer (HF `mamba.`, Megatron `mamba_mixer.`); no tp2 -> tp1:
    # its dist checkpoints do not save at TP > 1 (the round trip's strict xfail)
    "falcon_h1": (
        ("tp1 -> pp2", _IN_PROJ, f"{MAMBA_TAG}in-proj", None),
        ("tp1 -> tp2", _IN_PROJ, f"{MAMBA_TAG}in-proj",
         {"reason": _MAMBA_IN_PROJ_TP, "match": _IN_PROJ_LORA_B, "checks": ["resharded-export"]}),
        ("tp1 -> pp2", _OUT, f"{MAMBA_TAG}out-proj", _OUT_PROJ),
    ),
}

# ---- the VL families with a Megatron-built ViT (LANGUAGE_ONLY_LORA): their language path's findings
_PER_EXPERT_UNEXPECTED = r"unexpected: base_model\.model\.model\.language_model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.lora_"
_QWEN3VL_MOE = ("Megatron-Bridge 0.6.2 save_hf_adapter exports Qwen3-VL-MoE's routed-expert LoRA as per-expert modules "
                "(model.language_model.layers.N.mlp.experts.E.gate_proj/up_proj/down_proj), while the model holds its experts "
                "fused, on disk too as the Hub's checkpoints do (experts.gate_up_proj / experts.down_proj 3-D parameters; the "
                "Bridge's own weight mapping reads them packed: qwen_vl/qwen3_vl_bridge.py:371-377): PEFT has no such modules, "
                "the keys load as unexpected and every routed expert's LoRA is dropped")
_QWEN35_MOE_VL = ("peft 0.21.2 looks its MoE config rewrite up by the top-level model_type (peft/utils/"
                  "transformers_weight_conversion.py:413-416) and the VL model's qwen3_5_moe has none, so target_modules "
                  "gate_proj/up_proj/down_proj stay module targets; transformers 5.12.1 fuses the language model's experts on "
                  "load by its text config's qwen3_5_moe_text mapping (conversion_mapping.py:1452-1453): the adapter's per-expert "
                  "keys load as unexpected and every routed expert's LoRA is dropped (the shared expert's plain Linears keep theirs)")
for _f, _why in (("qwen3_vl_moe", _QWEN3VL_MOE), ("qwen3_5_moe_vl", _QWEN35_MOE_VL)):
    LORA[f"{_f} tp1 -> pp2"] = _xfail(_why, _PER_EXPERT_UNEXPECTED, _PEFT_MOE_CHECKS)
    LORA[f"{_f} tp1 -> tp2"] = _xfail(_why, _PER_EXPERT_UNEXPECTED, _PEFT_MOE_CHECKS, etp=True)
    LORA[f"{_f} tp1 -> dp2ep2"] = _with_ep(_xfail(_why, _PER_EXPERT_UNEXPECTED, _PEFT_MOE_CHECKS))
LORA["exaone4_5"] = {"reason": f"{_POST_NORM_LORA['reason']}; and {_VL_TARGETS}", "match": _VL_TARGETS_MATCH,
                     "checks": [*_VL_TARGETS_CHECKS, *_POST_NORM_LORA["checks"]]}
CANONICAL["exaone4_5"] = LORA["exaone4_5"]
# Qwen3-Omni's thinker: its audio encoder targeted (_VL_TARGETS); at tp2 (expert TP 2) the expert fc1 LoRA-B cut, at dp2ep2
# the EP export defect
LORA.update({"qwen3_omni tp1 -> pp2": _xfail(_VL_TARGETS, _VL_TARGETS_MATCH, _VL_TARGETS_CHECKS),
             "qwen3_omni tp1 -> tp2": _xfail(_VL_TARGETS, _VL_TARGETS_MATCH, _VL_TARGETS_CHECKS, etp=True),
             "qwen3_omni tp1 -> dp2ep2": _with_ep(_xfail(_VL_TARGETS, _VL_TARGETS_MATCH, _VL_TARGETS_CHECKS))})
CANONICAL["qwen3_omni"] = LORA["qwen3_omni tp1 -> pp2"]
# Qwen2.5-Omni's thinker: its audio encoder targeted (_VL_TARGETS), and Megatron's text-only logits off at the last position
LORA["qwen2_5_omni"] = {"reason": f"{_VL_TARGETS}; and {QWEN25_OMNI_ROPE}", "match": _VL_TARGETS_MATCH,
                        "checks": [*_VL_TARGETS_CHECKS, "logits", "merged-logits"]}
CANONICAL["qwen2_5_omni"] = LORA["qwen2_5_omni"]
# ERNIE-4.5-VL: transformers fuses its experts into two pools on load, peft does not know the model_type (as MiniMax-M3
# VL); its logits meet the router finding too (xfails_roundtrip "ernie4_5_vl_moe")
_ERNIE_VL = ("transformers 5.12.1 fuses ERNIE-4.5-VL's per-expert checkpoint keys on load into text and vision pools "
             "(conversion_mapping.py:903-954: experts.* -> text_moe.experts / vision_moe.experts gate_up_proj, down_proj) "
             "but does not list ernie4_5_vl_moe in _MODEL_TO_CONVERSION_PATTERN (conversion_mapping.py:39-132), which peft "
             "0.21.2's _convert_peft_config_moe reads (peft/utils/transformers_weight_conversion.py:413-416 returns for an "
             "unlisted model_type): target_modules gate_proj/up_proj/down_proj wrap the dense layer and the shared experts "
             "only, and every routed expert's LoRA (both pools) loads as unexpected keys and is dropped; and, for the logits, "
             + ROUNDTRIP["ernie4_5_vl_moe"]["reason"])
_ERNIE_VL_MATCH = r"unexpected: base_model\.model\.model\.language_model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.lora_"
LORA.update({"ernie4_5_vl_moe tp1 -> pp2": _xfail(_ERNIE_VL, _ERNIE_VL_MATCH, _PEFT_MOE_CHECKS),
             "ernie4_5_vl_moe tp1 -> tp2": _xfail(_ERNIE_VL, _ERNIE_VL_MATCH, _PEFT_MOE_CHECKS, etp=True),
             "ernie4_5_vl_moe tp1 -> dp2ep2": _with_ep(_xfail(_ERNIE_VL, _ERNIE_VL_MATCH, _PEFT_MOE_CHECKS))})
CANONICAL["ernie4_5_vl_moe"] = LORA["ernie4_5_vl_moe tp1 -> pp2"]
# the VL language paths at the pipeline layouts: blocked at build as their round trips (xfails_roundtrip)
LORA.update(VL_LAYOUT_REFUSALS)
CANONICAL["qwen3_vl_moe"] = {"reason": _CANON_GROUPED.replace(
    "(GPT-OSS's expert mappings are grouped exports, gpt_oss/gpt_oss_bridge.py:253-265)",
    "(Qwen3-VL-MoE's routed experts map packed, as its checkpoints hold them: qwen_vl/qwen3_vl_bridge.py:371-377)"),
    "match": "Unsupported adapter configuration for grouped export weight merging", "raised_in": "megatron.bridge.models.conversion"}
CANONICAL.update({f: CANONICAL["qwen3_5_text"] for f in ("qwen3_5_vl", "qwen3_5_moe_vl")})  # the attention output gate
