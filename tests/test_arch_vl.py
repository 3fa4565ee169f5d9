"""The language path of the VL families (harness.models.vl, path "vl-text" in harness.core.families):
the tiny VL config keeps each family's options in its text sub-config and shrinks the vision tower,
the fixture is the whole model (vision and language keys, every one mapped by the Bridge), the
classification and the matrix, the text-only forward adapter, the TE-globals swap."""

from __future__ import annotations

import sys
import types
from unittest.mock import MagicMock

import pytest
import torch

from harness.core.families import BY_NAME, FAMILIES
from harness.core.zoo import get_model
from harness.models import architectures as arch
from harness.models import vl


def test_vl_tiny_config_keeps_the_family_options():
    c = arch.tiny_config(get_model("hf-qwen2_5_vl"))
    t, v = c.text_config, c.vision_config
    assert (t.hidden_size, t.num_attention_heads, t.num_hidden_layers, t.vocab_size) == (256, 2, 4, 128)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24]  # the sections the Bridge hard-codes: head_dim 128
    assert v.depth == 2 and v.hidden_size == 32 and v.out_hidden_size == t.hidden_size
    assert c.architectures == ["Qwen2_5_VLForConditionalGeneration"] and c.tie_word_embeddings is False
    m = arch.tiny_config(get_model("hf-mistral3"))
    assert m.text_config.model_type == "ministral3" and m.text_config.rope_parameters["rope_type"] == "yarn"
    assert m.text_config.rope_parameters["truncate"] is False and m.text_config.rms_norm_eps == 1e-5
    assert m.image_token_index >= m.text_config.vocab_size  # a text token never lands on the image placeholder


def test_vl_fixture_holds_vision_and_language_keys_all_mapped(tmp_path):
    from safetensors import safe_open

    from harness.compat.te import import_megatron_bridge
    from harness.models.hf import write_fixture

    import_megatron_bridge()
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    spec = get_model("hf-qwen2_5_vl")
    d = write_fixture(spec, tmp_path / "q")
    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert any(k.startswith("visual.blocks.") for k in keys) and any(k.startswith("visual.merger.") for k in keys)
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    registry = get_model_bridge(spec.architecture).mapping_registry()
    assert [k for k in keys if registry.hf_to_megatron_lookup(k) is None] == []


def test_vl_classification_and_matrix():
    assert arch.classify(BY_NAME["qwen2_5_vl"])[0] == "vl-text"
    status, why = arch.classify(BY_NAME["qwen3_vl"])  # its TE-only spec builders run on CPU stand-ins, said in the note
    assert status == "vl-text" and "qwen3_vl_provider.py:148" in why and "localize_te_spec_builders" in why
    assert arch.classify(BY_NAME["qwen3_asr"])[0] == "vl"  # the vendored remote ASR model: no fixture
    text = arch.matrix_yaml()
    runnable = [f for f in FAMILIES if f.path == "vl-text"]
    assert len(runnable) >= 3 and all(f"models: [{f.zoo_name}]" in text for f in runnable)
    assert "models: [hf-qwen3_asr]" not in text and "Qwen3ASRForConditionalGeneration" in text.split("# deferred")[-1]
    assert "requires" not in text.split("models: [hf-qwen3_vl]")[1].split("- case")[0]
    # their LoRA adapts the language path only (the ViT's adapters not judged: named in xfails_lora)
    from harness.models.xfails_lora import LANGUAGE_ONLY_LORA

    for name in LANGUAGE_ONLY_LORA:
        peft = [e for e in text.split("  - case: ")[1:] if e.startswith("peft-export") and f"models: [hf-{name}]" in e]
        assert peft and all("options: {scope: language}" in e for e in peft), name
    lora = [e for e in text.split("  - case: ")[1:] if e.startswith("peft-export")]
    from harness.models.xfails_lora import LORA_NOT_GENERATED

    for f in runnable:  # LoRA on every VL language path, or the harness's named gap
        assert any(f"models: [{f.zoo_name}]" in e for e in lora) != (f.name in LORA_NOT_GENERATED), f.name
    assert all(f"# not generated: peft-export of hf-{n}: {why}" in text for n, why in LORA_NOT_GENERATED.items())


class _FakeVL(torch.nn.Module):
    """A VL model's signature: (input_ids, attention_mask, position_ids, ..., mm_token_type_ids)."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(name="cfg")
        self.language_model = torch.nn.Identity()
        self.seen: dict = {}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, mm_token_type_ids=None):
        self.seen = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, mm=mm_token_type_ids)
        return input_ids.float(), "loss_mask"


def test_text_only_routes_the_positional_call_by_keyword():
    inner = _FakeVL()
    wrapped = vl.TextOnly(inner)
    ids, pos, mask = torch.arange(6).view(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.ones(1, 1, 3, 3, dtype=torch.bool)
    out = wrapped(ids, pos, mask)
    assert torch.equal(out, ids.float())  # the (logits, loss_mask) tuple unwrapped
    assert inner.seen["attention_mask"] is mask and inner.seen["position_ids"] is None  # the model derives its M-RoPE positions
    assert torch.equal(inner.seen["mm"], torch.zeros_like(ids, dtype=torch.int))  # all text
    assert wrapped.config is inner.config


def test_te_globals_of_a_vl_package_are_swapped(monkeypatch):
    from harness.models import cpu_spec

    placeholder = MagicMock(name="TENorm")
    stand_in = object()
    monkeypatch.setattr(cpu_spec, "replacements", lambda: {id(placeholder): stand_in})
    pkg = types.ModuleType("fakevl_pkg")
    modeling = types.ModuleType("fakevl_pkg.modeling")
    modeling.TENorm = placeholder
    for m in (pkg, modeling):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    Provider = type("Provider", (), {"__module__": "fakevl_pkg.provider"})
    text_provider = Provider()
    assert vl.localize_te_globals(text_provider) == [] and modeling.TENorm is placeholder  # no vision_config: left alone
    provider = Provider()
    provider.vision_config = object()
    assert vl.localize_te_globals(provider) == ["fakevl_pkg.modeling.TENorm"] and modeling.TENorm is stand_in


def test_te_spec_builders_of_a_vl_module_build_on_cpu_stand_ins(monkeypatch):
    """A VL modeling module's own TE-only spec builder (Qwen3-VL's ViT spec) is wrapped once so that what it builds
    holds the CPU stand-ins; with Transformer-Engine importable nothing is touched (planted: the wrap undone)."""
    from harness.compat import te
    from harness.models import cpu_spec

    placeholder, stand_in = MagicMock(name="TEDotProductAttention"), object()
    monkeypatch.setattr(cpu_spec, "replacements", lambda: {id(placeholder): stand_in})
    modeling = types.ModuleType("fakevl_pkg.modeling_te")

    def get_vit_layer_with_transformer_engine_spec():
        return [placeholder]

    modeling.get_vit_layer_with_transformer_engine_spec = get_vit_layer_with_transformer_engine_spec
    monkeypatch.setattr(te, "te_importable", lambda: True)
    assert vl.localize_te_spec_builders(modeling) == [] and modeling.get_vit_layer_with_transformer_engine_spec() == [placeholder]
    monkeypatch.setattr(te, "te_importable", lambda: False)
    assert vl.localize_te_spec_builders(modeling) == ["get_vit_layer_with_transformer_engine_spec"]
    assert modeling.get_vit_layer_with_transformer_engine_spec() == [stand_in]
    assert vl.localize_te_spec_builders(modeling) == []  # once


def test_a_te_or_local_picker_picks_the_stand_ins_only_where_its_module_found_no_te(monkeypatch):
    """ERNIE-4.5-VL's spec module picks its classes itself (`_get_linear_modules`, on its HAVE_TE): without TE it
    would give a plain ColumnParallelLinear for the fused norm + linear. Swapped once, for the stand-ins in TE's
    order; a module that found TE is left alone."""
    from harness.compat import te
    from harness.models import cpu_spec

    local = ("Column", "Row", "Attention", "Column", "TorchNorm")
    monkeypatch.setattr(te, "te_importable", lambda: False)
    for have_te, swapped in ((True, False), (False, True)):
        modeling = types.ModuleType(f"fakevl_pkg.ernie_spec_{have_te}")
        modeling.HAVE_TE = have_te
        modeling._get_linear_modules = lambda: local
        done = vl.localize_te_spec_builders(modeling)
        assert (done == [vl.TE_PICKER]) is swapped
        picked = modeling._get_linear_modules()
        assert (picked == cpu_spec.te_linear_stand_ins()) is swapped and (picked == local) is not swapped
        assert vl.localize_te_spec_builders(modeling) == []  # once
    norm_linear = cpu_spec.te_linear_stand_ins()[3]
    assert norm_linear.__name__ == "LayerNormColumnParallelLinear"  # the Bridge's layer_norm_weight lives there


def test_the_stand_in_table_builds_without_the_bridge_s_shared_te_layers(monkeypatch):
    """Megatron-Bridge 0.5.x has no megatron.bridge.models.common.te_layers: the stand-in table leaves its entries out
    instead of failing every VL case of the release (a sweep's coverage hole)."""
    import importlib

    from harness.models import cpu_spec

    real = importlib.import_module

    def no_te_layers(name, *a, **k):
        if name == "megatron.bridge.models.common.te_layers":
            raise ImportError(f"cannot import name 'te_layers' ({name})")
        return real(name, *a, **k)

    saved = cpu_spec._CACHE.pop("map", None)
    post_ln = cpu_spec._classes()["row_post_ln"]  # the stand-in of te_layers.TERowParallelLinearLayerNorm
    try:
        assert post_ln in cpu_spec.replacements().values()  # with te_layers (the pins)
        cpu_spec._CACHE.pop("map", None)
        monkeypatch.setattr(importlib, "import_module", no_te_layers)
        table = cpu_spec.replacements()
        assert post_ln not in table.values() and cpu_spec.te_linear_stand_ins()[3] in table.values()
    finally:
        cpu_spec._CACHE.pop("map", None)
        if saved is not None:
            cpu_spec._CACHE["map"] = saved


@pytest.mark.parametrize("name", ["qwen2_5_vl", "mistral3", "gemma4_vl"])
def test_vl_families_build_a_vl_config(name):
    assert vl.is_vl(type(arch.tiny_config(get_model(f"hf-{name}"))))


def test_bias_as_mask_turns_an_additive_bias_into_the_mask():
    class Core:
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            return attention_mask, attention_bias

    bias = torch.zeros(1, 1, 3, 3).masked_fill_(~torch.ones(3, 3, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    mask, passed = vl.bias_as_mask(Core)().forward(None, None, None, "causal", None, bias)
    assert passed is None and torch.equal(mask, bias < 0) and mask[0, 0, 0, 1] and not mask[0, 0, 1, 0]
    assert vl.bias_as_mask(Core)().forward(None, None, None, "causal") == ("causal", None)  # no bias: the mask as given


def test_integrity_reads_a_vl_models_lm_head():
    """Mistral 3 / MiniMax-M3 VL keep the output layer under language_model.: an untied export holds it there."""
    from harness.judge.hf_integrity import lm_head_key

    assert lm_head_key({"language_model.lm_head.weight": 1, "vision_tower.x": 2}) == "language_model.lm_head.weight"
    assert lm_head_key({"lm_head.weight": 1, "language_model.lm_head.weight": 2}) == "lm_head.weight"
    assert lm_head_key({"model.embed_tokens.weight": 1}) == "lm_head.weight"  # none held: the name an untied one needs


# --------------------------------------------------------------------------- LoRA on the language path


@pytest.mark.parametrize("keys, layers, head", [
    (["model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.mlp.gate_proj.weight", "lm_head.weight"], "model.layers.", "lm_head"),
    (["vision_tower.encoder.layers.0.self_attn.q_proj.weight", "language_model.model.layers.0.self_attn.q_proj.weight"],
     "language_model.model.layers.", "lm_head"),
    (["language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight"], "language_model.model.layers.",
     "language_model.lm_head"),
    (["model.language_model.layers.0.input_layernorm.weight", "lm_head.weight"], "model.language_model.layers.", "lm_head"),
])
def test_checkpoint_layout_finds_the_language_decoder_not_the_vision_tower(keys, layers, head):
    from harness.models.peft_mapping import Layout, checkpoint_layout

    assert checkpoint_layout(keys) == Layout(layers, head)
    assert checkpoint_layout([]) == Layout()  # nothing to read: a text model's names


def test_a_vl_adapter_is_derived_under_the_checkpoints_layout_with_global_layers():
    """The Megatron VL model's `language_model.decoder.layers.<local>` adapter on PP stage 1 is the
    global layer (not stage 0's, whose replicas would then 'differ'), under the checkpoint's names."""
    from harness.models import peft_mapping
    from harness.models.bridge import global_name

    local = "language_model.decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight"
    name = global_name(local, offset=2)
    assert name == "language_model.decoder.layers.2.self_attention.linear_proj.adapter.linear_in.weight"
    a = torch.ones(4, 8)
    layout = peft_mapping.Layout("language_model.model.layers.", "language_model.lm_head")
    head = "language_model.output_layer.adapter.linear_in.weight"
    hf = peft_mapping.to_hf_peft(peft_mapping.gather([{"name": name, "tp_rank": 0, "data": a}, {"name": head, "tp_rank": 0, "data": a}]),
                                 get_model("hf-mistral3"), layout)
    assert set(hf) == {"base_model.model.language_model.model.layers.2.self_attn.o_proj.lora_A.weight",
                       "base_model.model.language_model.lm_head.lora_A.weight"}
    assert set(peft_mapping.to_hf_peft({name: a}, get_model("hf-mistral3"))) == {
        "base_model.model.model.layers.2.self_attn.o_proj.lora_A.weight"}  # the text layout by default


def test_layout_checks_count_a_vl_models_decoder_units_as_a_text_models_and_its_tower_as_no_target():
    import cases.shared.lora_layout as lay

    assert lay.text_name("model.language_model.layers.3.mlp.up_proj") == "model.layers.3.mlp.up_proj"
    assert lay.text_name("language_model.model.layers.3.self_attn.q_proj") == "model.layers.3.self_attn.q_proj"
    assert lay.text_name("language_model.lm_head") == "lm_head"
    assert lay.text_name("model.visual.blocks.0.mlp.gate_proj") == "model.visual.blocks.0.mlp.gate_proj"
    ents = lay.entries(("linear_fc1",))
    owner = lay.attribute({"model.visual.blocks.0.mlp.gate_proj", lay.text_name("model.language_model.layers.0.mlp.gate_proj")},
                          get_model("hf-qwen2_5_vl"), ents)
    assert owner[lay.NO_ENTRY] == {"model.visual.blocks.0.mlp.gate_proj"}  # the tower's same-named MLP: lora-targets-matched fails
    assert owner["linear_fc1"] == {"model.layers.0.mlp.gate_proj"}


def test_a_fused_shared_expert_counts_as_the_gate_and_up_units_its_checkpoint_holds():
    """transformers 5 fuses MiniMax-M3's shared expert into one gate_up_proj Linear on load; the checkpoint and the
    Bridge's adapter keep gate_proj and up_proj apart, so the layout checks count those two units."""
    from harness.cases.shared.lora_layout import mlp_units

    layer = mlp_units(get_model("hf-minimax_m3_vl", "hf"))[0]
    assert "model.layers.0.mlp.shared_experts.gate_proj" in layer["mlp.gate_proj"]
    assert "model.layers.0.mlp.shared_experts.up_proj" in layer["mlp.up_proj"]
    assert not any("gate_up_proj" in u for units in layer.values() for u in units)


def test_audio_and_omni_configs_shrink_their_towers_and_thinker():
    """Qwen2-Audio: the Whisper-like tower shrunk, its projector's input the audio width; the omni families: the
    thinker holds text, ViT and audio encoder (its output width the text width), the talker off."""
    audio = arch.tiny_config(get_model("hf-qwen2_audio"))
    assert audio.audio_config.encoder_layers == 2 and audio.audio_config.d_model == 32
    assert audio.text_config.hidden_size == get_model("hf-qwen2_audio").hidden_size
    for name in ("hf-qwen2_5_omni", "hf-qwen3_omni"):
        c = arch.tiny_config(get_model(name))
        t = c.thinker_config
        assert c.enable_audio_output is False and vl.is_vl(type(c))
        assert t.audio_config.output_dim == t.text_config.hidden_size == 256 and t.audio_config.encoder_layers == 2
        assert c.get_text_config() is t.text_config


def test_the_vendored_qwen3_asr_cannot_build_under_the_pinned_transformers():
    """families.py names why Qwen3-ASR has no fixture: the Bridge's vendored HF modeling fails under transformers 5.
    When this goes red the vendored model builds: give the family a fixture (path "vl-text")."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from transformers import AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=32, rope_scaling=dict(rope_type="default", mrope_section=[8, 4, 4]))
    audio = dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32, output_dim=64)
    cls = CONFIG_MAPPING["qwen3_asr"]
    with pytest.raises(AttributeError, match="pad_token_id"):
        AutoModel.from_config(cls(thinker_config=dict(text_config=text, audio_config=audio)))
    with pytest.raises(KeyError, match="default"):
        AutoModel.from_config(cls(thinker_config=dict(text_config={**text, "pad_token_id": 0}, audio_config=audio)))
    assert "hf_qwen3_asr" in BY_NAME["qwen3_asr"].note and BY_NAME["qwen3_asr"].path == "vl"


def test_the_qwen2_audio_fixture_is_spelled_as_the_hub_and_every_key_is_mapped(tmp_path):
    """transformers 5.12.1 saves Qwen2-Audio's text weights one `model.` too deep; the fixture is respelled to the Hub's
    `language_model.model.*` (hf.HUB_SPELLING), which the Bridge maps, every key."""
    from safetensors import safe_open

    from harness.compat.te import import_megatron_bridge
    from harness.models.hf import respelled, write_fixture

    assert respelled("language_model.model.model.norm.weight", {"language_model.model.model.": "language_model.model."}) \
        == "language_model.model.norm.weight"
    assert respelled("audio_tower.conv1.weight", {"language_model.model.model.": "x."}) == "audio_tower.conv1.weight"
    import_megatron_bridge()
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    spec = get_model("hf-qwen2_audio")
    d = write_fixture(spec, tmp_path / "a")
    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert "language_model.model.embed_tokens.weight" in keys and not any(".model.model." in k for k in keys)
    assert any(k.startswith("audio_tower.layers.") for k in keys)
    registry = get_model_bridge(spec.architecture).mapping_registry()
    assert [k for k in keys if registry.hf_to_megatron_lookup(k) is None] == []
