"""The CPU pieces behind the dense/MLA architecture cases: the MLA core-attention stand-in
(harness.models.cpu_attention) against torch's own attention, megatron-core's local MLA spec
defect kept visible (strict xfail), the hf-roundtrip reference (eager attention where the default
sdpa path drops Gemma2's soft-cap) and its fp32 bound measured from transformers' own fp64 forward."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cases import hf_roundtrip as hr
from harness.core.parity import compare_tensors

SQ, B, HEADS, GROUPS, HK, HV = 6, 2, 4, 2, 16, 8  # MLA: q/k head dim (nope + rope) != v head dim


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SQ, B, HEADS, HK, generator=g), torch.randn(SQ, B, GROUPS, HK, generator=g),
            torch.randn(SQ, B, GROUPS, HV, generator=g))


def _torch_attention(q, k, v, scale):
    """torch's own causal attention, [s, b, n, h] in, [s, b, n * hv] out (GQA by repeated heads)."""
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3).double() for t in (q, k, v)),
                                                           is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q.size(0), q.size(1), -1).float()


def _config():
    return SimpleNamespace(context_parallel_size=1, kv_channels=HV, attention_dropout=0.0, num_attention_heads=HEADS,
                           num_query_groups=GROUPS)


def test_mla_stand_in_is_torch_causal_attention_with_mla_head_dims():
    from megatron.core.transformer.enums import AttnMaskType

    from harness.models.cpu_attention import MLADotProductAttention

    scale = 0.7 / math.sqrt(HK)  # MLA's mscale^2 / sqrt(q_head_dim): not the default 1/sqrt(hk)
    attn = MLADotProductAttention(_config(), 1, AttnMaskType.causal, softmax_scale=scale, k_channels=HK, v_channels=HV).eval()
    q, k, v = _qkv()
    mask = torch.ones(SQ, SQ, dtype=torch.bool).triu(1)[None, None]
    out = attn(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (SQ, B, HEADS * HV)
    assert torch.allclose(out, _torch_attention(q, k, v, scale), atol=1e-6)
    assert not torch.allclose(out, _torch_attention(q, k, v, 1 / math.sqrt(HK)), atol=1e-3)  # the scale is MLA's


def test_localize_mla_swaps_the_local_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from harness.models.cpu_attention import MLADotProductAttention, localize_mla

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    localize_mla(spec)
    assert spec.submodules.self_attention.submodules.core_attention is MLADotProductAttention


@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "megatron-core 0.19.2: MLASelfAttention builds core_attention with k_channels/v_channels "
    "(transformer/multi_latent_attention.py:207-218, k_channels at :214); the local spec's DotProductAttention "
    "(transformer/dot_product_attention.py:41-51) takes neither: the local (non-TE) MLA spec cannot build"))
def test_megatron_core_local_mla_spec_builds_mla_core_attention():
    """Built as MLASelfAttention builds it, from megatron-core's own local MLA spec; XPASS (strict: a
    failure) once upstream's local attention takes MLA's head dims and computes torch's attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HEADS, num_query_groups=GROUPS,
                               q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=HV,
                               rope_type="rope", attention_dropout=0.0, masked_softmax_fusion=False)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    scale = 1 / math.sqrt(HK)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    try:
        attn = build_module(spec.submodules.self_attention.submodules.core_attention, config=cfg, layer_number=1,
                            attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=scale, k_channels=HK,
                            v_channels=HV, cp_comm_type=None, pg_collection=pg).eval()
    except TypeError as exc:  # only the named defect counts as the xfail
        if "unexpected keyword argument 'k_channels'" not in str(exc):
            raise AssertionError(f"not the named defect: {exc}") from exc
        raise
    q, k, v = _qkv()
    out = attn(q, k, v, torch.ones(SQ, SQ, dtype=torch.bool).triu(1)[None, None], attn_mask_type=AttnMaskType.causal)
    assert torch.allclose(out, _torch_attention(q, k, v, scale), atol=1e-6)


# --------------------------------------------------------------------------- the hf-roundtrip reference


def _tiny(tmp_path, model_type: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tmp_path / model_type
    model.save_pretrained(d)
    return d, model


def test_reference_applies_gemma2_attention_softcap_that_sdpa_drops(tmp_path):
    from transformers import AutoModelForCausalLM

    d, _ = _tiny(tmp_path, "gemma2", attn_logit_softcapping=0.5, final_logit_softcapping=None, query_pre_attn_scalar=8,
                 initializer_range=0.5)  # attention scores of O(1): the soft-cap at 0.5 bends them
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    assert hr.reference_attention(d) == "eager"
    ref = hr.reference_logits(d, ids)
    with torch.no_grad():
        eager = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()(input_ids=ids).logits
        sdpa = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").eval()(input_ids=ids).logits
    assert torch.equal(ref, eager)
    assert (sdpa - eager).abs().max() > 1e-3  # transformers' sdpa path drops the soft-cap (sdpa_attention.py:40-49)
    d2, _ = _tiny(tmp_path / "plain", "gemma2", attn_logit_softcapping=None, query_pre_attn_scalar=8)
    assert hr.reference_attention(d2) is None


def test_fp32_bound_is_the_measured_reference_error_and_a_real_mismatch_still_fails(tmp_path):
    from transformers import AutoModelForCausalLM

    d, _ = _tiny(tmp_path, "gemma3_text", query_pre_attn_scalar=8, sliding_window=4)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = hr.reference_logits(d, ids)
    err = hr.reference_error(d, ids, ref)
    assert 0 < err < 1e-4
    bound = hr.megatron_tolerance("fp32", err)
    assert bound.atol == max(1e-5, hr.REFERENCE_ERROR_FACTOR * err) and f"{err:.3g}" in bound.why
    assert hr.megatron_tolerance("fp32", 1e-7).atol == 1e-5  # never below the fixed bound
    wide = hr.megatron_tolerance("fp32", 1.19e-5)  # hf-gemma3's measured reference error
    logits = ref.clone()
    assert compare_tensors("l", logits, logits + 2.3e-5, "a", "b", wide) is None
    assert compare_tensors("l", logits, logits + 2.3e-5, "a", "b", hr.megatron_tolerance("fp32")) is not None
    assert compare_tensors("l", logits, logits + 1.24e-3, "a", "b", wide) is not None  # gemma2's planted 1.2e-3
    # a perturbed weight (one row of one projection, 1%) fails the measured bound
    bad = AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        bad.model.layers[0].mlp.down_proj.weight[0].mul_(1.01)
        perturbed = bad(input_ids=ids).logits
    assert compare_tensors("l", ref, perturbed, "a", "b", hr.megatron_tolerance("fp32", err)) is not None


# --------------------------------------------------------------------------- LoRA on the fused-norm stand-in


def test_lora_on_the_fused_norm_stand_in_reads_the_normed_input():
    """The Bridge's LoRA adds adapter(layernorm_output) (peft/lora_layers.py:80-84); TE's fused linear
    hands out its normed input once LoRA sets return_layernorm_output: the CPU stand-in must too, or
    the adapter reads the un-normed residual stream (peft-export of Gemma2/Gemma3 off by O(1))."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.peft.lora_layers import LoRALinear
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.models import cpu_spec

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm",
                            layernorm_zero_centered_gamma=True, use_cpu_initialization=True, add_bias_linear=False)
    tp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    kw = dict(config=cfg, init_method=torch.nn.init.normal_, gather_output=False, bias=False, skip_bias_add=True,
              is_expert=False, tp_group=tp)
    torch.manual_seed(0)
    fused = cpu_spec._classes()["norm_linear"](16, 24, **kw)
    with torch.no_grad():
        fused.layer_norm_weight.normal_()
    x = torch.randn(3, 2, 16)
    normed = torch.nn.functional.rms_norm(x, (16,), fused.layer_norm_weight + 1, cfg.layernorm_epsilon)
    out, _ = fused(x)
    seen = []
    adapter = torch.nn.Linear(16, 24, bias=False)
    adapter.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    plain = ColumnParallelLinear(16, 24, **kw)
    model = [torch.nn.ModuleList([LoRALinear(fused, adapter), LoRALinear(plain, torch.nn.Identity())])]
    assert cpu_spec.lora_reads_normed_input(model) is model
    assert fused.return_layernorm_output and not hasattr(plain, "return_layernorm_output")
    (out2, ln), _ = fused(x)
    assert torch.equal(out2, out) and torch.allclose(ln, normed, atol=1e-6)
    lora_out, _ = model[0][0](x)
    assert torch.allclose(seen[-1], normed, atol=1e-6)  # the adapter read the normed input, not x
    assert torch.allclose(lora_out, out + adapter(normed), atol=1e-6)
