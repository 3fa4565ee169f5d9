"""pruned-export's checks (cases/pruned_export.py, harness/judge/auto_export.py), each shown going
red on a planted fault and on empty input, without a process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.cases.pruned_export import Options, judge, loaded_forward_check, student_of
from harness.core.zoo import get_model
from harness.judge.auto_export import STUDENT_FIELDS, config_check, dtype_check, expected_hf, per_layer, tied_check

HEADS, KV, D, H, F = 8, 4, 8, 64, 96


def _hf(layers: int = 2, tied: bool = False, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    out = {"model.embed_tokens.weight": r(128, H), "model.norm.weight": r(H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": r(HEADS * D, H), p + "self_attn.k_proj.weight": r(KV * D, H),
                p + "self_attn.v_proj.weight": r(KV * D, H), p + "self_attn.o_proj.weight": r(H, HEADS * D),
                p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H), p + "mlp.down_proj.weight": r(H, F),
                p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H)}
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if tied else r(128, H)
    return out


def _megatron(hf: dict[str, torch.Tensor], layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """The fused, layer-stacked form a Bridge dist checkpoint holds (Megatron's GQA layout: per query
    group its q heads, then k, then v), written here from the HF side, plus optimizer entries."""
    def qkv(i):
        q = hf[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(KV, HEADS // KV * D, H)
        k = hf[f"model.layers.{i}.self_attn.k_proj.weight"].reshape(KV, D, H)
        v = hf[f"model.layers.{i}.self_attn.v_proj.weight"].reshape(KV, D, H)
        return torch.cat([q, k, v], dim=1).reshape(-1, H)

    def stack(f):
        return torch.stack([f(i) for i in range(layers)])

    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"], "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "decoder.layers.self_attention.linear_qkv.weight": stack(qkv),
           "decoder.layers.self_attention.linear_proj.weight": stack(lambda i: hf[f"model.layers.{i}.self_attn.o_proj.weight"]),
           "decoder.layers.mlp.linear_fc1.weight": stack(lambda i: torch.cat([hf[f"model.layers.{i}.mlp.gate_proj.weight"],
                                                                              hf[f"model.layers.{i}.mlp.up_proj.weight"]])),
           "decoder.layers.mlp.linear_fc2.weight": stack(lambda i: hf[f"model.layers.{i}.mlp.down_proj.weight"]),
           "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack(lambda i: hf[f"model.layers.{i}.input_layernorm.weight"]),
           "decoder.layers.mlp.linear_fc1.layer_norm_weight":
               stack(lambda i: hf[f"model.layers.{i}.post_attention_layernorm.weight"]),
           "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.zeros(1)}
    if not tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_the_layout_gives_back_the_hf_tensors_a_faithful_export_writes(tied):
    hf = _hf(tied=tied)
    got = expected_hf(_megatron(hf, 2, tied), HEADS, KV, tied)
    assert sorted(got) == sorted(hf) and all(torch.equal(got[k], hf[k]) for k in hf)


def test_the_layout_keeps_an_unknown_key_and_splits_stacked_layers():
    assert sorted(per_layer({"decoder.layers.x.weight": torch.zeros(3, 2), "optimizer.a": torch.zeros(1)})) == [
        f"decoder.layers.{i}.x.weight" for i in range(3)]
    assert "decoder.layers.0.odd.weight" in expected_hf({"decoder.layers.odd.weight": torch.zeros(1, 2)}, HEADS, KV, False)


def _case(tied=False, dtype="fp32", ffn=96):
    teacher = get_model("hf-llama-tied" if tied else "hf-llama", "hf")
    student = student_of(teacher, Options(student_layers=2, student_ffn=ffn, dtype=dtype))
    teacher_cfg = {"num_hidden_layers": 4, "intermediate_size": 128, "hidden_size": H, "num_attention_heads": HEADS,
                   "num_key_value_heads": KV, "vocab_size": 128, "tie_word_embeddings": tied, "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-6, "model_type": "llama", "dtype": "float32", "transformers_version": "5"}
    exported_cfg = {**teacher_cfg, **{k: getattr(student, f) for k, f in STUDENT_FIELDS}, "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}
    hf = _hf(tied=tied, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    logits = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1))
    return dict(student=student, dtype=dtype, exported_cfg=exported_cfg, teacher_cfg=teacher_cfg, exported=dict(hf),
                checkpoint=_megatron(hf, 2, tied), megatron_logits=logits, hf_logits=logits + 1e-7, dst="tp1pp1dp1cp1")


def _status(**kw) -> dict[str, str]:
    return {c.name: c.status for c in judge(**kw)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_faithful_export_passes_every_check(tied, dtype):
    assert set(_status(**_case(tied, dtype)).values()) == {"passed"}


def test_export_config_fails_on_the_teachers_architecture_a_changed_shared_field_and_nothing():
    kw = _case()
    assert _status(**{**kw, "exported_cfg": dict(kw["teacher_cfg"])})["export-config"] == "failed"  # the teacher's copied
    assert _status(**{**kw, "exported_cfg": {**kw["exported_cfg"], "rope_theta": 5e5}})["export-config"] == "failed"
    assert _status(**{**kw, "exported_cfg": {**kw["exported_cfg"], "max_window": 3}})["export-config"] == "failed"
    assert config_check({}, kw["teacher_cfg"], {"num_hidden_layers": 2}).status == "failed"
    assert config_check(kw["teacher_cfg"], kw["teacher_cfg"], {"num_hidden_layers": 4}).status == "failed"  # no student


def test_export_dtype_fails_on_the_teachers_dtype_a_tensor_in_another_and_no_tensor():
    kw = _case(dtype="bf16")
    assert _status(**{**kw, "exported_cfg": {**kw["exported_cfg"], "dtype": "float32"}})["export-dtype"] == "failed"
    assert _status(**{**kw, "exported": {**kw["exported"], "model.norm.weight": torch.ones(H)}})["export-dtype"] == "failed"
    assert dtype_check("bfloat16", {}, "bf16").status == "failed"
    assert dtype_check(None, {"a": torch.ones(1)}, "fp32").status == "failed"


def test_export_weights_fails_on_one_changed_element_a_missing_and_an_extra_tensor():
    kw = _case()
    changed = dict(kw["exported"])
    changed["model.layers.1.self_attn.k_proj.weight"] = changed["model.layers.1.self_attn.k_proj.weight"].clone()
    changed["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1e-3
    assert _status(**{**kw, "exported": changed})["export-weights"] == "failed"
    assert _status(**{**kw, "exported": {k: v for k, v in kw["exported"].items() if "up_proj" not in k}})["export-weights"] == "failed"
    assert _status(**{**kw, "exported": {**kw["exported"], "model.rotary.inv_freq": torch.ones(4)}})["export-weights"] == "failed"
    assert _status(**{**kw, "exported": {}, "checkpoint": {}})["export-weights"] == "failed"


def test_tied_output_fails_on_a_missing_or_different_head_and_a_wrong_flag():
    kw = _case(tied=True)
    head = kw["exported"]["lm_head.weight"].clone()
    head[3, 3] += 1.0
    assert _status(**{**kw, "exported": {**kw["exported"], "lm_head.weight": head}})["tied-output"] == "failed"
    assert _status(**{**kw, "exported": {k: v for k, v in kw["exported"].items() if k != "lm_head.weight"}})["tied-output"] == "failed"
    assert _status(**{**kw, "exported_cfg": {**kw["exported_cfg"], "tie_word_embeddings": False}})["tied-output"] == "failed"
    assert tied_check({}, True, True).status == "failed"
    assert tied_check({}, False, False).status == "failed"


def test_hf_logits_fails_past_the_bound_without_megatrons_logits_and_when_transformers_refuses():
    kw = _case()
    assert _status(**{**kw, "hf_logits": kw["megatron_logits"] + 1e-3})["hf-logits"] == "failed"
    assert _status(**{**kw, "megatron_logits": None})["hf-logits"] == "failed"
    assert _status(**{**kw, "hf_logits": "OSError: no file"})["hf-logits"] == "failed"
    assert _status(**{**kw, "megatron_logits": torch.empty(0), "hf_logits": torch.empty(0)})["hf-logits"] == "failed"


def test_the_student_is_the_teacher_pruned():
    teacher = get_model("hf-llama", "hf")
    assert student_of(teacher, Options(student_layers=2)) == replace(teacher, name="hf-llama-student", num_layers=2)
    assert student_of(teacher, Options(student_layers=3, student_ffn=64)).intermediate_size == 64


def test_loaded_forward_fails_on_a_raise_a_different_forward_and_nothing():
    """The loaded model as load_megatron_model returns it must run the forward-only schedule and give the
    logits it gives with the training hooks cleared (the hooks it carried are named either way)."""
    cleared = torch.linspace(-1.0, 1.0, 24).reshape(1, 4, 6)
    hooks = {"no_sync_func": "DistributedDataParallel.no_sync"}
    assert loaded_forward_check(cleared.clone(), "", cleared, {}, "D").status == "passed"
    raised = loaded_forward_check(None, "TypeError: no_sync() missing 1 required positional argument: 'self'", cleared, hooks, "D")
    assert raised.status == "failed" and "TypeError" in raised.detail and "no_sync_func=DistributedDataParallel.no_sync" in raised.detail
    other = loaded_forward_check(cleared + 1e-6, "", cleared, hooks, "D")
    assert other.status == "failed"
    assert loaded_forward_check(None, "", cleared, {}, "D").status == "failed"
    assert loaded_forward_check(None, "", None, {}, "D").status == "failed"
