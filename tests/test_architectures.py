"""The architectures the installed Megatron-Bridge registers (harness.models.architectures):
the registry enumeration, the families table covering it, each tiny config keeping its family's
distinctive options on, the generated matrix agreeing with the table, and a planted mapping
defect in one family's fixture turning only that family red."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.families import BY_NAME, FAMILIES
from harness.core.zoo import get_model
from harness.models import architectures as arch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def registry():
    return arch.registered()


def test_registry_enumerates_the_installed_bridge(registry):
    names = [r.architecture for r in registry]
    assert len(names) >= 50 and "LlamaForCausalLM" in names and "DeepseekV3ForCausalLM" in names
    assert arch.unknown_architectures(names) == [], "a registered architecture has no row in harness/core/families.py"


def test_empty_registry_fails(monkeypatch):
    arch.registered()  # the Bridge imported once
    from megatron.bridge import AutoBridge

    monkeypatch.setattr(AutoBridge, "list_supported_models", classmethod(lambda cls: []))
    with pytest.raises(RuntimeError, match="registers no architecture"):
        arch.registered()


def test_every_family_resolves_in_the_zoo():
    for f in FAMILIES:
        spec = get_model(f.zoo_name, "hf")
        assert spec.arch in (f.layout,) if f.path == "remote" else spec.arch in (f.model_type, f.name)
        assert spec.remote_type == (f.model_type if f.path == "remote" else "")


def test_matrix_file_is_the_generated_one():
    assert (ROOT / "matrices" / "architectures.yaml").read_text() == arch.matrix_yaml(), \
        "regenerate: python -m harness.models.architectures --write"


def _config(name):
    return arch.tiny_config(get_model(f"hf-{name}"))


# family -> the options its tiny config keeps on
DISTINCTIVE = {
    "deepseek_v3": lambda c: c.q_lora_rank and c.kv_lora_rank and c.n_shared_experts >= 1 and c.first_k_dense_replace == 1,
    "deepseek_v2": lambda c: c.q_lora_rank and c.kv_lora_rank,
    "glm4_moe_lite": lambda c: c.q_lora_rank and c.kv_lora_rank,
    "gemma2": lambda c: c.attn_logit_softcapping and c.final_logit_softcapping and c.sliding_window < 16
    and "sliding_attention" in c.layer_types and "full_attention" in c.layer_types and c.tie_word_embeddings,
    "gemma3": lambda c: c.sliding_window < 16 and "sliding_attention" in c.layer_types and "full_attention" in c.layer_types,
    "gpt_oss": lambda c: c.attention_bias and c.num_local_experts >= 2 and c.sliding_window < 16,
    "glm4_moe": lambda c: c.attention_bias and c.use_qk_norm and c.n_shared_experts >= 1,
    "gemma": lambda c: c.tie_word_embeddings,
    # the Bridge maps EXAONE-4.0-1.2B's shape: tied, full attention (exaone4_bridge.py:177, exaone4_provider.py:54-93)
    "exaone4": lambda c: c.tie_word_embeddings and c.sliding_window is None and set(c.layer_types) == {"full_attention"}
    and len(c.layer_types) == c.num_hidden_layers,
    # V4's YaRN on the compressed layers, carried as a nested override (deepseek_v4_bridge.py:441-446 reads it)
    "deepseek_v4": lambda c: c.rope_parameters["compress"]["rope_type"] == "yarn" and c.rope_parameters["compress"]["factor"] > 1
    and "original_max_position_embeddings" in c.rope_parameters["compress"],
    "ernie4_5_moe": lambda c: c.moe_num_shared_experts >= 1 and c.moe_layer_start_index == 1,
}


@pytest.mark.parametrize("name", sorted(DISTINCTIVE))
def test_tiny_config_keeps_the_family_options_on(name):
    c = _config(name)
    assert DISTINCTIVE[name](c), arch.distinctive(c)
    assert c.num_hidden_layers <= 6 and c.hidden_size <= 64


def test_qwen2_has_qkv_biases():
    from transformers import AutoModelForCausalLM

    from harness.models.hf import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(get_model("hf-qwen2")))
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"} <= names


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.num_experts and f.model_type], ids=lambda f: f.name)
def test_moe_families_route_top_k_of_several(f):
    if arch.classify(f)[0] not in ("text", "vl-text", "remote") and not f.needs:
        pytest.skip(arch.classify(f)[1])
    c = _config(f.name)
    c = c.get_text_config()  # a VL or omni family: the experts are its language path's
    counts = [getattr(c, k) for k in arch.MOE_COUNT if getattr(c, k, None)]
    topk = [getattr(c, k) for k in arch.MOE_TOPK if getattr(c, k, None)]
    assert counts and min(counts) >= 2 and topk and 1 <= min(topk) < min(counts), arch.distinctive(c)


def test_classification_names_the_missing_module():
    # the Megatron-built-ViT VL families: TE spec builders localized on CPU (harness.models.vl.localize_te_spec_builders)
    assert {arch.classify(BY_NAME[n])[0] for n in ("exaone4_5", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl", "qwen3_5_moe_vl")} == {"vl-text"}
    assert arch.classify(BY_NAME["nemotron_h"])[0] == arch.classify(BY_NAME["falcon_h1"])[0] == "text"  # harness.models.cpu_mamba
    assert arch.classify(BY_NAME["kimi_k2"])[0] == "remote"  # harness.models.remote (tests/test_remote.py)
    assert arch.classify(BY_NAME["mimo_v2_flash"])[0] == "unbuilt" and "modeling_mimo_v2_flash.py:231" in arch.classify(BY_NAME["mimo_v2_flash"])[1]
    assert arch.classify(BY_NAME["gemma2"])[0] == "text"
    # audio and omni language paths (harness.models.vl's audio towers, an omni model's thinker)
    assert {arch.classify(BY_NAME[n])[0] for n in ("qwen2_audio", "qwen2_5_omni", "qwen3_omni")} == {"vl-text"}
    assert arch.classify(BY_NAME["qwen3_asr"])[0] == "vl"


# ---------------------------------------------------------------- a planted mapping defect


def _unmapped_keys(name: str, tmp_path: Path) -> list[str]:
    """The fixture keys of `name` that its Bridge's mapping registry cannot place (HF -> Megatron
    lookup): cheap, no world."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    from safetensors import safe_open

    from harness.models.hf import write_fixture

    spec = get_model(f"hf-{name}")
    d = write_fixture(spec, tmp_path / name)
    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    registry = get_model_bridge(spec.architecture or arch.tiny_config(spec).architectures[0]).mapping_registry()
    return sorted(k for k in keys if registry.hf_to_megatron_lookup(k) is None)


FAMILIES_CHECKED = ("gemma2", "qwen3", "gemma", "deepseek_v3")


@pytest.mark.parametrize("name", FAMILIES_CHECKED)
def test_fixture_keys_are_all_mapped(name, tmp_path):
    assert _unmapped_keys(name, tmp_path) == []


def test_planted_mapping_defect_turns_only_its_family_red(tmp_path, monkeypatch):
    """Gemma2's bridge loses its post-feedforward norm mapping: only gemma2 turns red, naming those keys."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    cls = type(get_model_bridge("Gemma2ForCausalLM"))
    original = cls.mapping_registry

    def planted(self):
        reg = original(self)
        return MegatronMappingRegistry(*[m for m in reg.mappings if "post_feedforward_layernorm" not in str(m.hf_param)])

    monkeypatch.setattr(cls, "mapping_registry", planted)
    red = {name: _unmapped_keys(name, tmp_path / "planted") for name in FAMILIES_CHECKED}
    assert red["gemma2"] and all("post_feedforward_layernorm" in k for k in red["gemma2"])
    assert {n: v for n, v in red.items() if v and n != "gemma2"} == {}


def test_provider_specs_localize_every_te_class(registry):
    """Gemma2's / EXAONE 4's own layer specs on CPU: every TE placeholder swapped for a stand-in that
    keeps TE's parameter names (linear_qkv.layer_norm_weight, linear_proj.post_layernorm)."""
    from unittest.mock import NonCallableMock

    from megatron.bridge.models.exaone.exaone4.exaone4_provider import exaone4_layer_spec
    from megatron.bridge.models.gemma.gemma2_provider import gemma2_layer_spec

    from harness.models import cpu_spec

    for build in (gemma2_layer_spec, exaone4_layer_spec):
        leaves: list = []
        spec = cpu_spec.localize(build(None))
        cpu_spec._walk(spec, lambda v, _p: leaves.append(v) or v, {})
        assert not [v for v in leaves if isinstance(v, NonCallableMock)], build.__name__
    attn = cpu_spec.localize(gemma2_layer_spec(None)).submodules.self_attention.submodules
    assert "LayerNormColumnParallelLinear" in attn.linear_qkv.__name__ and attn.linear_proj.__name__ == "RowParallelLinearPostLN"


def test_grouped_expert_names_and_module_swaps(registry):
    """SequentialMLP -> GroupedNamesMLP (TEGroupedMLP's names, for the Bridges that map only those);
    OLMoE's full-width QK-norm attention and MiniMax-M2's full-dim norms swapped into the generic spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from harness.models import cpu_experts, cpu_spec

    block = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True)])
    block = cpu_experts.grouped_expert_names(block)
    assert block.layer_specs[0].submodules.mlp.keywords["submodules"].experts.func.__name__ == "GroupedNamesMLP"
    block = cpu_spec.apply_swaps(block, cpu_spec.module_swaps("minimax_m2_layer_spec"))
    assert block.layer_specs[0].submodules.self_attention.submodules.q_layernorm.__name__ == "FullDimQNorm"
    block = cpu_spec.apply_swaps(block, cpu_spec.module_swaps("olmoe_layer_spec"))
    assert block.layer_specs[0].submodules.self_attention.module.__name__ == "OLMoESelfAttention"


def test_nested_override_is_carried_as_json():
    """A dict override (DeepSeek-V4's rope_parameters) keeps Family hashable: JSON text, decoded by tiny_config."""
    from harness.core.families import BY_NAME, Nested, _o

    o = dict(_o(rope_parameters={"factor": 4.0, "rope_type": "yarn"}))["rope_parameters"]
    assert isinstance(o, Nested) and o.value() == {"factor": 4.0, "rope_type": "yarn"}
    hash(BY_NAME["deepseek_v4"])


# ----------------------------------------------------------------------------- the smoke slice


def smoke_families(specs) -> set[str]:
    """The families (harness.core.families names) with a hf-roundtrip case expected to pass (no
    xfail) among `specs`: a zoo model counts for the family whose architecture it is."""
    from harness.gate import archs

    of = {m: f.name for f in FAMILIES for m in archs.zoo_models(f.architecture)}
    return {of[s.model] for s in specs if s.case == "hf-roundtrip" and s.xfail is None and s.model in of}


def test_smoke_holds_one_green_roundtrip_for_at_least_15_families():
    """The main job speaks for the families a Bridge user bumps for: >= 15 of them (issue: the
    smoke keeps one case per family; all of them are in matrices/architectures.yaml)."""
    from harness.orchestration.matrix import load_matrix

    specs = load_matrix(ROOT / "matrices" / "smoke.yaml").cases
    found = smoke_families(specs)
    assert len(found) >= 15, f"the smoke matrix has green hf-roundtrip cases for {len(found)} families: {sorted(found)}"
    # planted: the same matrix without its per-family entry, and an empty one, fall short
    assert len(smoke_families([s for s in specs if s.model in ("hf-llama", "hf-qwen2")])) < 15
    assert smoke_families([]) == set()


def test_the_docs_table_counts_only_what_ran_and_names_the_red(monkeypatch):
    """harness.models.arch_table: a family is "real results" only when every case of it passed or was
    its named xfail; a failure anywhere makes it red and named; an empty results.json is refused."""
    from harness.models import arch_table

    def rec(model, case, tgt, status, **kw):
        return {"id": f"{case}[x-{model}-tp1pp1dp1cp1->{tgt}pp1dp1cp1]".replace("pp2pp1", "tp1pp2"), "case": case,
                "model": model, "status": status, "phases": {"run": 1.0}, "checks": kw.pop("checks", []), **kw}

    fams = tuple(BY_NAME[n] for n in ("llama", "mistral", "olmoe", "minimax_m2"))
    results = [rec("hf-llama", k, t, "passed") for k in arch_table.KINDS for t in ("tp2", "pp2")]
    canon = rec("hf-llama", "peft-export", "pp2", "xfailed", xfail_reason="canonical x.py:2: why")
    results += [{**canon, "id": canon["id"].replace("]", "-canonical_lora]")}]  # its own column, not LoRA pp2's
    vpp = rec("hf-llama", "hf-roundtrip", "pp2", "xfailed", xfail_reason="vpp x.py:3: why")
    results += [{**vpp, "id": vpp["id"].replace("cp1]", "cp1vpp2]")}]  # its own column, not round trip pp2's
    uneven = rec("hf-llama", "hf-roundtrip", "pp2", "passed", phases={"run": 2.0})
    results += [{**uneven, "id": uneven["id"].replace("cp1]", "cp1-first_stage_layers=1]")}]  # its own column too
    results += [rec("hf-mistral", "hf-roundtrip", "tp2", "xfailed", xfail_reason="upstream x.py:1: why"),
                rec("hf-mistral", "peft-export", "tp2", "passed")]
    results += [rec("hf-olmoe", "peft-export", "tp2", "failed", checks=[{"name": "logits", "status": "failed", "detail": "off by 3"}])]
    ep2 = rec("hf-olmoe", "hf-roundtrip", "tp1", "passed")
    results += [{**ep2, "id": ep2["id"].replace("->tp1pp1dp1cp1", "->tp1pp1dp2cp1ep2")}]  # the EP column
    results += [rec("hf-minimax_m2", "hf-roundtrip", "tp2", "passed"), rec("hf-minimax_m2", "peft-export", "tp2", "not-run",
                    not_run_reason="needs cuda")]
    doc = {"results": results}
    assert arch_table.summary(doc, fams).startswith("2 architectures with real results on every case (0 of them")
    assert "1 with a red case (olmoe)" in arch_table.summary(doc, fams)
    assert "1 with real results and a not-run case (minimax_m2)" in arch_table.summary(doc, fams)
    rows = {r[0]: r for r in arch_table.rows(doc, fams)}
    col = {name: i for i, name in enumerate(arch_table.header())}

    def cell(arch_name, column):
        return rows[arch_name][col[column]]

    assert all(len(r) == len(col) for r in rows.values())
    assert cell("OlmoeForCausalLM", "LoRA tp1->tp2") == "FAIL 1.0" and "logits: off by 3" in rows["OlmoeForCausalLM"][-1]
    assert cell("LlamaForCausalLM", "LoRA tp1->pp2") == "pass 1.0" and cell("LlamaForCausalLM", "CanonicalLoRA") == "xfail 1.0 (pp2)"
    assert "canonical x.py" in rows["LlamaForCausalLM"][-1] and cell("OlmoeForCausalLM", "CanonicalLoRA") == "-"
    assert cell("LlamaForCausalLM", "round trip tp1->pp2") == "pass 1.0"
    assert cell("LlamaForCausalLM", "round trip tp1->pp2vpp2") == "xfail 1.0" and "vpp x.py" in rows["LlamaForCausalLM"][-1]
    assert cell("LlamaForCausalLM", "round trip tp1->pp2 1+3") == "pass 2.0"
    assert cell("OlmoeForCausalLM", "round trip tp1->ep2") == "pass 1.0" and cell("OlmoeForCausalLM", "round trip tp1->pp2") == "-"
    assert cell("MistralForCausalLM", "round trip tp1->tp2") == "xfail 1.0" and "upstream x.py" in rows["MistralForCausalLM"][-1]
    with pytest.raises(ValueError):
        arch_table.rows({"results": []}, fams)
    # a remote-code family: LoRA cells say why there is none (no transformers class for PEFT), counted as real
    kimi = (BY_NAME["kimi_k2"],)
    doc = {"results": [rec("hf-kimi_k2", "hf-roundtrip", "tp2", "passed")]}
    assert arch_table.summary(doc, kimi).startswith("1 architectures with real results on every case (1 of them every case "
                                                    "passed; 1 of them hub remote code")
    row = arch_table.rows(doc, kimi)[0]
    assert row[col["LoRA tp1->tp2"]] == arch_table.NO_HF_CLASS and row[col["LoRA tp1->pp2"]] == "-" and "remote code" in row[-1]
    # a family whose LoRA cases the harness does not generate is counted apart, never as "every case"
    monkeypatch.setattr(arch_table, "LORA_NOT_GENERATED", {"nemotron_h": "the harness's mapping lacks it"})
    nh = (BY_NAME["nemotron_h"],)
    doc = {"results": [rec("hf-nemotron_h", "hf-roundtrip", "tp2", "passed")]}
    assert arch_table.summary(doc, nh).startswith("0 architectures with real results on every case")
    assert "1 with real results on every round trip and no LoRA case generated yet (nemotron_h" in arch_table.summary(doc, nh)
    row = arch_table.rows(doc, nh)[0]
    assert row[col["LoRA tp1->tp2"]] == "not generated" and row[col["LoRA tp1->pp2"]] == "-" and "LoRA not generated" in row[-1]


def test_vpp_and_uneven_stages_for_every_text_family_whose_layers_allow_them():
    """tp1 -> pp2vpp2 and tp1 -> pp2 with an uneven first stage for each 4-layer text, remote and VL language-path
    family's round trip and LoRA (a remote family: no LoRA)."""
    import yaml

    entries = yaml.safe_load((ROOT / "matrices" / "architectures.yaml").read_text())["entries"]
    vpp = {(e["case"], e["models"][0]) for e in entries if any("vpp" in p for p in e["pairs"])}
    uneven = {(e["case"], e["models"][0]) for e in entries if (e.get("axes") or {}).get("first_stage_layers") == [1]}
    from harness.models.xfails_lora import LORA_NOT_GENERATED

    want = {(case, f.zoo_name) for f in FAMILIES if f.path in ("text", "remote", "vl-text") and f.num_layers % 4 == 0
            for case in ("hf-roundtrip", "peft-export")
            if case == "hf-roundtrip" or (f.name not in LORA_NOT_GENERATED and f.path != "remote")}
    assert want and vpp == want and uneven == want


def test_a_one_chunk_path_refuses_a_chunk_list():
    import torch

    from harness.models.bridge import BridgeModel, chunks, unwrapped

    one, two = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert unwrapped(BridgeModel(None, [one])) is one
    with pytest.raises(NotImplementedError, match="2 \\(vpp\\)"):
        unwrapped(BridgeModel(None, [one, two]))
    assert chunks(BridgeModel(None, [one, two])) == [one, two]


def test_first_stage_layers_is_refused_where_it_cannot_lay_out_the_stages():
    from harness.core.topology import Topology
    from harness.models.bridge import validate_first_stage_layers

    llama = get_model("hf-llama", "hf")  # 4 layers
    pp1, pp2, pp4 = Topology.parse("tp1"), Topology.parse("pp2"), Topology.parse("pp4")
    validate_first_stage_layers(llama, (pp1, pp2), 0)
    validate_first_stage_layers(llama, (pp1, pp2), 1)  # 1 + 3
    with pytest.raises(ValueError, match="first_stage_layers must be >= 0"):
        validate_first_stage_layers(llama, (pp1, pp2), -1)
    with pytest.raises(ValueError, match="no side .* has PP > 1"):
        validate_first_stage_layers(llama, (pp1, Topology.parse("tp2")), 1)
    with pytest.raises(ValueError, match="pp4.*cannot split the other 2"):
        validate_first_stage_layers(llama, (pp1, pp4), 2)
    with pytest.raises(ValueError, match="cannot split the other 0"):
        validate_first_stage_layers(llama, (pp1, pp2), 4)
    with pytest.raises(ValueError, match="vpp 2"):
        validate_first_stage_layers(llama, (pp1, Topology.parse("pp2vpp2")), 1)


def test_a_tiny_config_the_installed_transformers_refuses_fails_its_case_not_the_matrix(tmp_path, monkeypatch):
    """Bridge 0.4.2's sweep run (transformers 5.3.0) once died at load: NemotronH's config class refused the
    derived 'mlp' layer type while a LoRA entry validated its targets, and the whole release column was lost."""
    from harness.cases.shared import lora_layout as ll
    from harness.models import hf
    from harness.orchestration.matrix import MatrixError, load_matrix

    def refuse(model):
        raise ValueError("layers_block_type contains invalid types: {'mlp'}")

    monkeypatch.setattr(hf, "hf_config", refuse)
    monkeypatch.setattr(ll, "_MLA", {})
    with pytest.raises(ll.FixtureUnavailable, match=r"transformers .* refuses hf-deepseek_v3's tiny config: ValueError: layers_block"):
        ll.mla_targets(get_model("hf-deepseek_v3", "hf"))
    entry = ("name: t\nentries:\n  - case: peft-export\n    backends: [bridge_peft]\n    models: [hf-deepseek_v3]\n"
             "    pairs: [\"tp1 -> tp2\"]\n    axes: {{adapter: [lora], dim: [{dim}]}}\n")
    (tmp_path / "ok.yaml").write_text(entry.format(dim=4))
    assert len(load_matrix(tmp_path / "ok.yaml").cases) == 1
    (tmp_path / "bad.yaml").write_text(entry.format(dim=3))  # the model-independent checks still hold
    with pytest.raises(MatrixError, match="LoRA rank 3 is not divisible by e?tp=2"):
        load_matrix(tmp_path / "bad.yaml")


def test_nemotron_h_fixtures_are_spelled_as_the_hub_and_as_transformers_resaves_them(tmp_path):
    from safetensors import safe_open

    from harness.models.hf import write_fixture

    def embedding_keys(name):
        d = write_fixture(get_model(name, "hf"), tmp_path / name)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return sorted(k for k in f.keys() if "embed" in k)

    assert embedding_keys("hf-nemotron_h") == ["backbone.embeddings.weight"]  # the Hub's, the Bridge's mapping
    assert embedding_keys("hf-nemotron_h-resaved") == ["backbone.embedding.weight"]  # transformers 5.12.1's save_pretrained


def test_hybrid_lora_names_follow_their_checkpoints():
    """Nemotron-H's attention / MLP adapters under its layer's `mixer` (backbone.layers.N in its checkpoints,
    model.layers.N in transformers' memory), Falcon-H1's MLP as `feed_forward`: the derivation writes the
    checkpoint's names and the layout checks read both back as the text model's (a Mamba mixer stays apart)."""
    import torch

    from cases.shared.lora_layout import text_name
    from harness.models import peft_mapping

    t = torch.ones(4, 64)
    nh = peft_mapping.to_hf_peft({"decoder.layers.1.self_attention.linear_proj.adapter.linear_in.weight": t,
                                  "decoder.layers.3.mlp.linear_fc2.adapter.linear_in.weight": t},
                                 get_model("hf-nemotron_h"), peft_mapping.Layout("backbone.layers.", "lm_head"))
    assert set(nh) == {"base_model.model.backbone.layers.1.mixer.o_proj.lora_A.weight",
                       "base_model.model.backbone.layers.3.mixer.down_proj.lora_A.weight"}
    fh = peft_mapping.to_hf_peft({"decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": t}, get_model("hf-falcon_h1"))
    assert set(fh) == {"base_model.model.model.layers.0.feed_forward.down_proj.lora_A.weight"}
    assert peft_mapping.checkpoint_layout(["backbone.layers.0.mixer.in_proj.weight", "lm_head.weight"]).layers == "backbone.layers."
    assert text_name("backbone.layers.1.mixer.q_proj") == text_name("model.layers.1.mixer.q_proj") == "model.layers.1.self_attn.q_proj"
    assert text_name("model.layers.3.mixer.down_proj") == "model.layers.3.mlp.down_proj"
    assert text_name("model.layers.0.feed_forward.gate_proj") == "model.layers.0.mlp.gate_proj"
    assert text_name("model.layers.0.mixer.in_proj") == "model.layers.0.mixer.in_proj"  # Mamba: no target entry's
    # planted: a text family keeps its names
    assert set(peft_mapping.to_hf_peft({"decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": t}, get_model("hf-llama"))) == {
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"}


def test_the_mamba_projection_lora_cases_sit_beside_the_grid_and_count():
    """A Mamba projection LoRA case (tag mamba-*) never fills the grid's LoRA cell of its pair; the row's
    reasons name it with its status, and its failure makes the family red."""
    from harness.models import arch_table
    from harness.report.grid import arch_column

    nh = (BY_NAME["nemotron_h"],)
    base = "peft-export[bridge_peft-hf-nemotron_h-tp1pp1dp1cp1->tp2pp1dp1cp1-lora"
    lora = {"id": base + "]", "case": "peft-export", "model": "hf-nemotron_h", "status": "passed", "phases": {"run": 1.0}, "checks": []}
    mamba = {**lora, "id": base + "-mamba-in-proj]", "status": "failed", "phases": {"run": 2.0},
             "checks": [{"name": "resharded-export", "status": "failed", "detail": "2 mismatch(es)"}]}
    rt = {**lora, "id": base.replace("peft-export[bridge_peft", "hf-roundtrip[bridge_hf") + "]", "case": "hf-roundtrip"}
    doc = {"results": [rt, lora, mamba]}
    col = {name: i for i, name in enumerate(arch_table.header())}
    row = arch_table.rows(doc, nh)[0]
    assert row[col["LoRA tp1->tp2"]] == "pass 1.0"
    assert "Mamba in_proj/out_proj LoRA: in-proj tp1->tp2 FAIL 2.0" in row[-1] and "resharded-export: 2 mismatch" in row[-1]
    assert "1 with a red case (nemotron_h)" in arch_table.summary(doc, nh)
    assert arch_column(mamba) is None and arch_column(lora) == "LoRA tp2"
    back = {**mamba, "id": mamba["id"].replace("tp1pp1dp1cp1->tp2pp1dp1cp1", "tp2pp1dp1cp1->tp1pp1dp1cp1")}
    row = arch_table.rows({"results": [rt, lora, mamba, back]}, nh)[0]  # two cases of one finding: its reason once
    assert "in-proj tp2->tp1 FAIL 2.0" in row[-1] and row[-1].count("resharded-export: 2 mismatch") == 1
