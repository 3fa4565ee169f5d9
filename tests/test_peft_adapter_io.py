"""peft-adapter-io (HF PEFT's own adapter format): the judges on planted faults, and whole cases that go
red when the file or the load is wrong."""

import pytest
import torch

from cases import peft_adapter_io as pio
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
V = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"


def _params():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(4, 3, generator=g) for n in (A, B, V)}


def _file(params):
    return {n.replace(".default", ""): t.clone() for n, t in params.items()}


def test_file_check_passes_a_faithful_file_and_fails_on_empty():
    p = _params()
    assert pio.file_check("default", p, _file(p), {}).status == "passed"
    assert pio.file_check("default", {}, {}, {}).status == "failed"
    assert pio.file_check("default", p, {}, {}).status == "failed"


def test_file_check_names_a_missing_a_moved_and_a_stray_tensor():
    p = _params()
    f = _file(p)
    del f[A.replace(".default", "")]
    assert "no tensor(s) of the file" in pio.file_check("default", p, f, {}).detail
    f = _file(p)  # layer 0's q_proj lora_B values under layer 1's v_proj key, and the other way round
    kb, kv = B.replace(".default", ""), V.replace(".default", "")
    f[kb], f[kv] = f[kv], f[kb]
    detail = pio.file_check("default", p, f, {}).detail
    assert "not under its module" in detail and "layers.0.self_attn.q_proj" in detail
    f = {**_file(p), "base_model.model.lm_head.weight": torch.ones(2)}
    assert "neither an adapter tensor nor a base weight" in pio.file_check("default", p, f, {}).detail


def test_file_check_wants_the_base_weights_the_rule_saves():
    p, emb = _params(), torch.randn(8, 3)
    extras = {"model.embed_tokens.weight": emb}
    with_emb = {**_file(p), "base_model.model.model.embed_tokens.base_layer.weight": emb.clone()}
    assert pio.file_check("default", p, with_emb, extras).status == "passed"
    assert "base weight model.embed_tokens.weight" in pio.file_check("default", p, _file(p), extras).detail
    other = {**_file(p), "base_model.model.model.embed_tokens.base_layer.weight": emb + 1}
    assert pio.file_check("default", p, other, extras).status == "failed"


def test_expected_extras_follow_peft_s_documented_rule():
    plain = {"model.embed_tokens.weight": torch.zeros(1), "lm_head.weight": torch.ones(1), "model.norm.weight": torch.ones(1)}
    assert pio.expected_extras(pio.Options(), plain) == {}
    assert set(pio.expected_extras(pio.Options(targets=("q_proj", "embed_tokens")), plain)) == {"model.embed_tokens.weight"}
    assert pio.expected_extras(pio.Options(targets=("embed_tokens",), trainable_token_indices=(1,)), plain) == {}
    assert set(pio.expected_extras(pio.Options(resize_vocab=160), plain)) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_load_config_warning_effect_and_base_state_judges_go_red():
    p = _params()
    assert pio.load_check("default", p, {n: t.clone() for n, t in p.items()}).status == "passed"
    assert pio.load_check("default", {}, {}).status == "failed"
    assert pio.load_check("default", p, {**p, A: p[A] + 1e-7}).status == "failed"
    assert "not in the loaded model" in pio.load_check("default", p, {B: p[B], V: p[V]}).detail
    opts = pio.Options()
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"], "use_dora": False, "use_rslora": False}
    assert pio.config_check("default", cfg, opts, 4).status == "passed"
    assert "lora_alpha: 16" in pio.config_check("default", {**cfg, "lora_alpha": 16}, opts, 4).detail
    assert pio.config_check("default", None, opts, 4).status == "failed"
    assert pio.warnings_check([], ["UserWarning: Found missing adapter keys while loading the checkpoint: [...]"]).status == "failed"
    assert pio.warnings_check(["PeftWarning: Adapter 'default': 1 LoRA tensor(s) have invalid shape: ..."], []).status == "failed"
    assert pio.warnings_check(["UserWarning: Setting `save_embedding_layers` to `True`"], ["x"]).status == "passed"
    x = torch.randn(2, 3)
    assert pio.effect_check(x, x.clone()).status == "failed" and pio.effect_check(x + 1, x).status == "passed"
    assert pio.base_state_check(p, {n: t.clone() for n, t in p.items()}).status == "passed"
    assert pio.base_state_check(p, None).status == "failed"
    assert "missing" in pio.base_state_check(p, {A: p[A]}).detail


def _spec(backend, tag="", **opts):
    one = Topology.parse("tp1")
    return CaseSpec("peft-adapter-io", "hf-llama", backend, one, one, options=tuple(sorted(opts.items())), timeout_s=120, tag=tag)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_the_case_passes_with_two_adapters_and_the_base_state():
    r = run_case(_spec("hf_peft", modules_to_save=("lm_head",), adapters=2, base_state=True))
    assert r.status == "passed", r.failure_text()
    assert {"adapter-file@second", "adapter-load@second", "logits@second", "base-state", "base-state-logits@second"} <= set(_checks(r))


def test_swapped_lora_b_values_fail_the_file_and_the_load(override):
    r = run_case(_spec(override("PeftSwapsLoraB")))
    assert r.status == "failed"
    c = _checks(r)
    assert c["adapter-file@default"] == "failed" and c["adapter-load@default"] == "failed" and c["logits@default"] == "failed"
    assert c["adapter-config@default"] == "passed"


def test_embeddings_left_out_of_a_resized_vocabulary_s_file_fail(override):
    r = run_case(_spec(override("PeftDropsEmbedding"), resize_vocab=160))
    c = _checks(r)
    assert c["adapter-file@default"] == "failed" and "base weight" in r.check("adapter-file@default").detail
    assert c["logits@default"] == "failed"  # the new rows drawn again on load


def test_a_load_that_loses_the_adapter_fails_though_the_file_is_right(override):
    r = run_case(_spec(override("PeftLoadsIntoNothing")))
    c = _checks(r)
    assert c["adapter-file@default"] == "passed"
    assert c["adapter-load@default"] == "failed" and c["logits@default"] == "failed"


def test_more_than_one_process_is_refused_by_name():
    spec = CaseSpec("peft-adapter-io", "hf-llama", "hf_peft", Topology.parse("tp2"), Topology.parse("tp1"))
    r = run_case(spec)
    assert r.status == "error" and "tp1 -> tp1" in r.error
