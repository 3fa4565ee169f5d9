"""Every architecture the installed Megatron-Bridge registers: enumerate, classify, derive a tiny
config, generate the matrix.

- `registered()`: the HF architecture names of the installed Bridge's registry
  (`AutoBridge.list_supported_models()`, i.e. `get_model_bridge`'s dispatch table that every
  `@MegatronModelBridge.register_bridge(source=...)` fills), each with its bridge class, the
  model_type it declares and its provider class.
- `classify(family)`: against the installed transformers: "text" (config class in
  CONFIG_MAPPING and a causal-LM class in MODEL_FOR_CAUSAL_LM_MAPPING: runnable here unless it
  `needs` a module this machine lacks), "vl-text" (a VL model whose language path runs on a
  whole-model fixture: harness.models.vl), "vl" (no language-path case) or "missing" (the
  modeling code is hub remote code, or a CUDA-only kernel: the module named).
- `tiny_config(spec)`: the family's config class's defaults, shrunk generically (`SHRINK`, the
  MoE and MLA knobs below, `layer_types` recomputed for the layer count) plus the family's
  `overrides` (harness.core.families): one table, no per-architecture function.
- `matrix_yaml()`: matrices/architectures.yaml (`python -m harness.models.architectures --write`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.families import BY_ARCHITECTURE, FAMILIES, Family
from harness.core.zoo import HFModelSpec

#: The generic shrink: every key the config class has is set so (a model of ~100k parameters).
SHRINK: dict[str, Any] = dict(vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              initializer_range=0.02)
#: MoE knobs by their names across families: routed expert count, top-k, expert ffn widths.
MOE_COUNT = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
MOE_TOPK = ("num_experts_per_tok", "moe_k", "top_k_experts")
MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")
#: Per-layer pattern lists transformers derives from the layer count when absent.
LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")
#: The hand-written fixtures of harness.models.hf (bytes pinned by goldens: never through this path).
HAND_WRITTEN = ("llama", "qwen2", "nemotron", "qwen3_moe")
#: The MoE families whose shrink keeps their dense first layer (first_k_dense_replace 1).
_DENSE_FIRST = ("first_k_dense_replace", "moe_layer_start_index")


@dataclass(frozen=True)
class Registered:
    architecture: str
    bridge: str  # module.Class of the bridge
    model_type: str | None  # what the bridge declares (MODEL_TYPE), None when it declares none
    provider: str | None


def registered() -> list[Registered]:
    """The installed Bridge's registry, sorted by architecture; raises when it is empty (an
    import that silently registered nothing would otherwise read as "no architectures")."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion import model_bridge as mbm

    names = AutoBridge.list_supported_models()
    out = []
    for key, impl in mbm.get_model_bridge._exact_types.items():
        name = key if isinstance(key, str) else key.__name__
        cls = next((c.cell_contents for c in (impl.__closure__ or ()) if isinstance(c.cell_contents, type)
                    and issubclass(c.cell_contents, mbm.MegatronModelBridge)), None)
        prov = getattr(cls, "PROVIDER_CLASS", None)
        out.append(Registered(name, f"{cls.__module__}.{cls.__name__}" if cls else "?", getattr(cls, "MODEL_TYPE", None),
                              prov.__name__ if prov else None))
    if not names or not out:
        raise RuntimeError("the installed Megatron-Bridge registers no architecture (AutoBridge.list_supported_models() is empty)")
    return sorted(out, key=lambda r: r.architecture)


def family_of(architecture: str) -> Family | None:
    return BY_ARCHITECTURE.get(architecture)


def unknown_architectures(names: list[str]) -> list[str]:
    """Registered architectures harness.core.families has no row for (a Bridge bump added them)."""
    return sorted(n for n in names if n not in BY_ARCHITECTURE)


def classify(f: Family) -> tuple[str, str]:
    """(status, reason): "text" / "vl-text" runnable here, "vl" (no case), "missing" (the module named in reason)."""
    from harness.core.requires import module_missing

    if f.path == "vl":
        return "vl", f"{f.architecture}: VL/omni/audio, no language-path case here: {f.note}"
    if f.path == "unbuilt":
        return "unbuilt", f"{f.architecture}: no case here: {f.note}"
    if f.path == "vl-text":
        return _classify_vl_text(f)
    if f.path == "remote":  # its weights are `layout`'s: that class must ship
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from harness.models.remote import BRIDGE_VENDORED

        if f.layout not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and f.layout not in BRIDGE_VENDORED:
            return "missing", f"transformers has no causal-LM class for {f.architecture}'s layout {f.layout!r}"
        return "remote", f.note
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if f.model_type is None or f.model_type not in CONFIG_MAPPING_NAMES:
        return "missing", f"needs the module {f.needs}: transformers has no config for {f.architecture} ({f.note})"
    if f.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "missing", f"transformers has no causal-LM class for model_type {f.model_type}"
    if f.needs and (why := module_missing(f.needs)):
        return "missing", f"needs the module {f.needs}: {why} ({f.note})"
    return "text", f.note


def _classify_vl_text(f: Family) -> tuple[str, str]:
    """A "vl-text" family: its ConditionalGeneration class must ship in transformers (the whole
    model is the fixture); its language path runs on text tokens alone."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    from harness.core.requires import module_missing
    from harness.models.vl import is_vl

    if f.model_type not in CONFIG_MAPPING or not is_vl(CONFIG_MAPPING[f.model_type]):
        return "missing", f"transformers has no multimodal config (text + a vision or audio tower) for model_type {f.model_type}"
    if f.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES | MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return "missing", f"transformers has no image-text-to-text or multimodal-LM class for model_type {f.model_type}"
    if f.needs and (why := module_missing(f.needs)):
        return "missing", f"needs the module {f.needs}: {why} ({f.note})"
    return "vl-text", f.note


# --------------------------------------------------------------------------- the tiny config


def _shrink(spec: HFModelSpec, defaults: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {k: v for k, v in SHRINK.items() if k in defaults}
    kw.update(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
              num_key_value_heads=spec.num_key_value_heads, tie_word_embeddings=spec.tied, vocab_size=spec.vocab_size)
    if "intermediate_size" in defaults:
        kw["intermediate_size"] = spec.intermediate_size
    if "head_dim" in defaults:
        kw["head_dim"] = spec.head_dim
    for eps in ("rms_norm_eps", "norm_eps", "layer_norm_epsilon"):
        if eps in defaults:
            kw[eps] = 1e-6
    if spec.num_experts:
        kw.update({k: spec.num_experts for k in MOE_COUNT if k in defaults})
        kw.update({k: spec.num_experts_per_tok for k in MOE_TOPK if k in defaults})
        kw.update({k: spec.moe_intermediate_size for k in MOE_FFN if k in defaults})
    for k in ("n_group", "topk_group"):
        if defaults.get(k) is not None:
            kw[k] = 1
    return kw


def tiny_config(spec: HFModelSpec):
    """The family's config class at the spec's size, its distinctive options on (`spec.overrides`)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from harness.models.remote import layout_classes

    layout_classes(spec.arch)
    cls = CONFIG_MAPPING[spec.arch]
    from harness.models import vl

    if vl.is_vl(cls):  # a VL family: its text config shrunk so, its vision config by vl.VISION_SHRINK
        return vl.tiny_vl_config(spec, _shrink, LAYER_LISTS)
    defaults = cls().to_dict()
    kw = _shrink(spec, defaults)
    from harness.core.families import Nested

    kw.update({k: list(v) if isinstance(v, tuple) else v.value() if isinstance(v, Nested) else v for k, v in spec.overrides})
    config = AutoConfig.for_model(spec.arch, **kw)
    for name in LAYER_LISTS:  # a list the class did not derive for this layer count: the default's pattern, cut
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) != spec.num_layers:
            setattr(config, name, (list(defaults.get(name) or value) * spec.num_layers)[: spec.num_layers])
    if spec.architecture:
        config.architectures = [spec.architecture]
    return config


def distinctive(config) -> dict[str, Any]:
    """The options a tiny config keeps on, by name (what tests/test_architectures.py asserts)."""
    keys = ("q_lora_rank", "kv_lora_rank", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "attention_bias",
            "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "first_k_dense_replace", "tie_word_embeddings",
            *MOE_COUNT, *MOE_TOPK, "layer_types", "mlp_layer_types")
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


# --------------------------------------------------------------------------- the CPU layer spec


#: Providers' own block specs run as they are on CPU once harness.models.vl swaps their TE-or-local class picker
#: (ERNIE-4.5-VL: a dense first layer, then text and vision expert pools, ernie_decoder_layer_spec.py:219)
OWN_BLOCK_SPECS = ("get_ernie45_vl_decoder_block_spec",)


def cpu_layer_spec(provider: Any, grouped_experts: bool = False):
    """A family's layer spec on CPU. The provider's own spec where harness.models.cpu_spec builds it
    (PROVIDER_SPECS: its TE classes localized, the block's final norm a CPU norm; MODULE_SWAPS: the
    generic spec plus the provider's swapped modules); else megatron-core's decoder block spec
    without Transformer-Engine (local modules) from the provider's own config (MoE layer frequency,
    MLA with harness.models.cpu_attention's core attention, QK norm, MTP). `grouped_experts`: the
    experts under TEGroupedMLP's parameter names (a Bridge that maps only those)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from harness.models import cpu_attention, cpu_experts, cpu_hybrid, cpu_spec

    own = provider.transformer_layer_spec
    name = getattr(getattr(own, "func", own), "__name__", "")

    def spec(config, vp_stage: int | None = None):
        if name == cpu_hybrid.HYBRID_BLOCK_SPEC:  # Qwen3-Next, Qwen3.5: gated DeltaNet and attention layers mixed
            return cpu_hybrid.hybrid_block(config, vp_stage)
        if name in OWN_BLOCK_SPECS:  # the provider's own block, its TE-or-local picks made on the CPU stand-ins
            import sys

            from harness.models.vl import localize_te_spec_builders

            localize_te_spec_builders(sys.modules[own.__module__])
            return own(config)
        if name == "heterogeneous_layer_spec":  # Llama-Nemotron (DeciLM): Core's heterogeneous spec, local modules
            # (the provider asks use_te=True whatever is installed: llama_nemotron_provider.py heterogeneous_layer_spec)
            from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

            return get_gpt_heterogeneous_layer_spec(config, use_te=False, vp_stage=vp_stage)
        if name in cpu_spec.PROVIDER_SPECS:
            from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

            layer = cpu_spec.localize(own(config))
            attn = layer.submodules.self_attention.submodules
            if getattr(config, "is_vision_language", False):  # Gemma 3 VL: per-layer additive biases, not a window
                from harness.models.vl import bias_as_mask

                attn.core_attention = bias_as_mask(attn.core_attention)
            if getattr(config, "qk_layernorm", False) and attn.q_layernorm is None:  # EXAONE 4: TE reads it from the config
                attn.q_layernorm = attn.k_layernorm = cpu_spec._norm
            return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                              layer_norm=cpu_spec._norm)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                           qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)), vp_stage=vp_stage)
        cpu_spec.apply_swaps(block, cpu_spec.module_swaps(name))
        if getattr(config, "multi_latent_attention", False):  # MLA's k/v head dims differ: a TE-like core attention
            cpu_attention.localize_mla(block)
        if grouped_experts:
            block = cpu_experts.grouped_expert_names(block)
        if getattr(config, "layernorm_zero_centered_gamma", False):
            cpu_spec.swap_norms(block, set())
        if wants_layer and len({id(s) for s in block.layer_specs}) == 1:
            return block.layer_specs[0]
        return block

    wants_layer = _provide_edits_a_layer_spec(provider)
    return spec


def _provide_edits_a_layer_spec(provider: Any) -> bool:
    """The provider's own provide() edits the layer spec it builds (NemotronLabsDiffusion swaps the layer's
    core attention, nemotron_labs_diffusion_provider.py provide): it needs one layer ModuleSpec, as its own spec
    function returns, not a block spec."""
    import inspect

    provide = type(provider).__dict__.get("provide")
    try:
        return provide is not None and "submodules.self_attention" in inspect.getsource(provide)
    except (OSError, TypeError):
        return False


# --------------------------------------------------------------------------- the matrix

_HEADER = """\
# Generated by `python -m harness.models.architectures --write` from the installed Megatron-Bridge's
# registry (AutoBridge.list_supported_models()) and harness/core/families.py; edit those, then
# regenerate (tests/test_architectures.py fails when the two disagree). docs/architectures.md: the table.
# Marker `arch`: opt-in (scripts/test excludes it): scripts/test -m arch, or
#   ckpt-harness run matrices/architectures.yaml -k hf-<family>
name: architectures
defaults: {backends: [bridge_hf], timeout_s: 600, max_world_size: 2, markers: [hf, arch]}
entries:
"""


def pairs_for(f: Family) -> list[str]:
    """tp1 -> tp2 (expert TP 1 for a family whose experts have biases: megatron-core asserts
    ETP 1 there, transformer_config.py:2279-2281), tp1 -> pp2 where the layers split over two stages,
    and tp1 -> dp2ep2 for an MoE family (its experts over two expert-parallel ranks)."""
    tp2 = "tp2etp1" if dict(f.overrides).get("attention_bias") and f.num_experts else "tp2"
    return ([f"tp1 -> {tp2}"] + (["tp1 -> pp2"] if f.num_layers % 2 == 0 and f.num_layers >= 2 else [])
            + (["tp1 -> dp2ep2"] if f.num_experts else []))


def pipeline_layouts(f: Family) -> list[tuple[str, int, str]]:
    """The pipeline layouts beyond pairs_for's even stages, as (pair, first-stage layers (0: even), the
    xfail key), for a text, remote or VL language-path family whose 4 layers allow them; each's xfails are its family's tp1 -> pp2
    ones unless it has its own (the same two stages, laid out otherwise). The source world is
    tp1 -> tp2's, shared:
      tp1 -> pp2vpp2: 2 stages x 2 virtual chunks (the checkpoint loaded into a chunk list, logits through
                      the interleaved schedule, the export from every chunk);
      tp1 -> pp2, first_stage_layers 1: uneven stages, 1 layer then 3 (megatron-core's
                      num_layers_in_first_pipeline_stage; Megatron-LM's --decoder-first-pipeline-num-layers)."""
    if f.path not in ("text", "remote", "vl-text") or f.num_layers % 4:
        return []
    return [("tp1 -> pp2vpp2", 0, "tp1 -> pp2vpp2"), ("tp1 -> pp2", 1, "tp1 -> pp2 uneven")]


def matrix_yaml(roundtrip: dict[str, dict[str, Any]] | None = None, lora: dict[str, dict[str, Any]] | None = None) -> str:
    """The matrix: per runnable family and pair, one hf-roundtrip entry (weights and logits through
    the Bridge, the dist checkpoint at S loaded at D) and one peft-export entry (LoRA on every
    target the family has, `save_hf_adapter` -> PeftModel, the adapter checkpoint at S loaded at
    D), and one CanonicalLoRA peft-export at one pair (xfails_lora.CANONICAL); not-run through `requires` where a module is missing; strict xfails from
    harness.models.xfails_roundtrip / xfails_lora, keyed "family" or "family pair". A "vl-text"
    family (harness.models.vl) gets its entries as a text one, LoRA on its language path included;
    VL/omni families without a language-path case ("vl") are listed as deferred in a comment."""
    from harness.models.xfails_lora import CANONICAL, LANGUAGE_ONLY_LORA, LORA, LORA_NOT_GENERATED, MAMBA_LORA, NEEDS_CUDA, canonical_pair
    from harness.models.remote import no_modeling
    from harness.models.xfails_roundtrip import ROUNDTRIP

    tables = {"hf-roundtrip": ROUNDTRIP if roundtrip is None else roundtrip, "peft-export": LORA if lora is None else lora}
    lines = [_HEADER]
    for f in FAMILIES:
        if not f.has_cases:
            continue
        for case, xfails in tables.items():
            if case == "peft-export" and (f.name in LORA_NOT_GENERATED or f.path == "remote"):
                continue  # listed below with what the harness lacks, or no HF class a PEFT model wraps
            for pair, first, key in [(p, 0, p) for p in pairs_for(f)] + pipeline_layouts(f):
                lines.append(f"  - case: {case}\n    models: [{f.zoo_name}]\n    pairs: [\"{pair}\"]\n")
                axes = (["adapter: [lora]"] if case == "peft-export" else []) + ([f"first_stage_layers: [{first}]"] if first else [])
                if case == "peft-export":
                    lines.append("    backends: [bridge_peft]\n    markers: [peft, arch]\n")
                    if f.name in LANGUAGE_ONLY_LORA:
                        lines.append("    options: {scope: language}   # the Megatron-built ViT without adapters (xfails_lora)\n")
                if axes:
                    lines.append("    axes: {" + ", ".join(axes) + "}\n")
                if f.needs:
                    lines.append(f"    requires: [\"{_requirement(f.needs)}\"]\n")
                elif case == "peft-export" and (why := NEEDS_CUDA.get(f"{f.name} {pair}")):
                    lines.append(f"    requires: [cuda]   # {why}\n")
                x = xfails.get(f"{f.name} {key}") or (key != pair or "vpp" in pair) and xfails.get(f"{f.name} tp1 -> pp2") \
                    or xfails.get(f.name)
                if x:
                    lines.append("    xfail:\n" + "".join(f"      {k}: {_q(v)}\n" for k, v in x.items()))
        if f.name not in LORA_NOT_GENERATED and f.path != "remote":  # CanonicalLoRA (q/k/v and fc1 gate/up adapters apart) at one pair
            lines.append(f"  - case: peft-export\n    models: [{f.zoo_name}]\n    pairs: [\"{canonical_pair(pairs_for(f))}\"]\n"
                         "    backends: [bridge_peft]\n    markers: [peft, arch]\n    axes: {adapter: [canonical_lora]}\n"
                         + ("    options: {scope: language}\n" if f.name in LANGUAGE_ONLY_LORA else ""))
            if f.needs:
                lines.append(f"    requires: [\"{_requirement(f.needs)}\"]\n")
            if x := CANONICAL.get(f.name):
                lines.append("    xfail:\n" + "".join(f"      {k}: {_q(v)}\n" for k, v in x.items()))
        for pair, targets, tag, x in MAMBA_LORA.get(f.name, ()):  # the Mamba-2 projections' LoRA (xfails_lora)
            lines.append(f"  - case: peft-export\n    models: [{f.zoo_name}]\n    pairs: [\"{pair}\"]\n"
                         f"    backends: [bridge_peft]\n    markers: [peft, arch]\n    axes: {{adapter: [lora]}}\n"
                         f"    options: {{targets: {_q(targets)}}}\n    tag: {tag}\n")
            if x:
                lines.append("    xfail:\n" + "".join(f"      {k}: {_q(v)}\n" for k, v in x.items()))
    deferred = [f for f in FAMILIES if f.path == "vl"]
    lines.append("# deferred: VL / omni / audio without a language-path case (why: docs/architectures.md): "
                 + ", ".join(f.architecture for f in deferred) + "\n")
    lines += [f"# not built: {f.architecture}: {f.note}\n" for f in FAMILIES if f.path == "unbuilt"]
    lines += [f"# not generated: peft-export of hf-{name}: {why}\n" for name, why in LORA_NOT_GENERATED.items()]
    lines += [f"# not generated: peft-export of {f.zoo_name}: {no_modeling(f.architecture, f.layout)}, "
              "which PEFT's model would wrap\n" for f in FAMILIES if f.path == "remote"]
    return "".join(lines)


def _requirement(needs: str) -> str:
    """A family's `needs` as a matrix requirement (harness.core.requires): a module, or a machine need as written."""
    return needs if needs.startswith("host-memory-gib>=") else f"module:{needs}"


def _q(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write matrices/architectures.yaml")
    ap.add_argument("--list", action="store_true", help="print the registry with each family's class")
    a = ap.parse_args(argv)
    if a.list:
        for r in registered():
            f = family_of(r.architecture)
            status, why = classify(f) if f else ("unknown", "no row in harness/core/families.py")
            print(f"{r.architecture:45s} {(f.zoo_name if f else '-'):28s} {status:8s} {why}")
    if a.write:
        Path("matrices/architectures.yaml").write_text(matrix_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
