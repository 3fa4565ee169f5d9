"""LoRA layouts beyond the default adapter (issue 21 item 5): which Megatron target entries a
layout asks for, what each entry should select, and whether the Megatron LoRA and the HF PEFT model
loaded from its export wrap the same modules per entry.

A layout is the PEFT cases' options (cases.shared.peft.PeftOptions): `targets` (a subset of the adapter
kind's base linears), `layers` (global decoder layers: each target becomes the Bridge's documented
wildcard entry `*.layers.N.*.<target>`, megatron/bridge/peft/lora.py's LoRA docstring) and any `dim`.
Everything is counted in HF module units (`model.layers.L.self_attn.q_proj`, an expert's
`model.layers.L.mlp.experts.E.gate_proj`, a shared expert's `model.layers.L.mlp.shared_experts.gate_proj`),
under transformers' in-memory module names, the unit a PEFT adapter wraps:
  asked     what the entry selects in the model's global layer numbering (the harness's own table; an
            MLP target per layer what transformers' model of the fixture config holds there: `mlp_units`)
  megatron  what the Megatron LoRA wrapped (the adapter parameters every rank holds, mapped to HF
            modules by harness.models.peft_mapping, independent of the Bridge's export)
  peft      what PeftModel.from_pretrained wrapped over the HF base (its LoraLayer modules; a
            ParamWrapper over transformers 5's fused experts counts one unit per expert)
Each unit is attributed to the entry whose layer and target select it, or to NO_ENTRY.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harness.core.parity import EXACT
from harness.core.result import Check
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec

#: A Megatron target (LoRA's fused or CanonicalLoRA's split names) -> the HF modules of one decoder
#: layer it adapts; an MLP module of an MoE layer is one module per expert under mlp.experts.E.
HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_q": ("self_attn.q_proj",),
    "linear_k": ("self_attn.k_proj",),
    "linear_v": ("self_attn.v_proj",),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc1_gate": ("mlp.gate_proj",),
    "linear_fc1_up": ("mlp.up_proj",),
    "linear_fc2": ("mlp.down_proj",),
    # a Mamba-2 mixer's projections (Nemotron-H, Falcon-H1), in the Mamba layers only
    "in_proj": ("mixer.in_proj",),
    "out_proj": ("mixer.out_proj",),
    "output_layer": ("lm_head",),  # not in a decoder layer: a layer filter leaves it one entry
    # multi-latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite: megatron/bridge/models/deepseek/common.py's mappings)
    "linear_q_down_proj": ("self_attn.q_a_proj",),
    "linear_q_up_proj": ("self_attn.q_b_proj",),
    "linear_q_proj": ("self_attn.q_proj",),  # MLA without a q LoRA rank (q_lora_rank None)
    "linear_kv_down_proj": ("self_attn.kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("self_attn.kv_b_proj",),
}
#: the MLA linears that stand for the adapter kinds' q/k/v targets on a multi-latent-attention model
MLA_Q_LORA = ("linear_q_down_proj", "linear_q_up_proj")
MLA_Q = ("linear_q_proj",)
MLA_KV = ("linear_kv_down_proj", "linear_kv_up_proj")
_QKV = ("linear_qkv", "linear_q", "linear_k", "linear_v")
#: targets beyond the adapter kinds' defaults (both kinds wrap it with a plain LoRALinear)
EXTRA_TARGETS = ("output_layer",)
#: targets a model with Mamba-2 layers has besides (no adapter kind's default: named in `targets`)
MAMBA_TARGETS = ("in_proj", "out_proj")
_OUTSIDE_LAYERS = {"output_layer"}
NO_ENTRY = "(no entry)"
#: targets on a column-parallel base (their adapter's linear_in splits the rank over TP)
#: (MLA's down projections too: Megatron's local spec builds them ColumnParallelLinear(gather_output=False),
#: megatron/core/transformer/multi_latent_attention.py:524-533; under TE they are TELinear 'duplicated')
COLUMN = frozenset({"linear_qkv", "linear_q", "linear_k", "linear_v", "linear_fc1", "linear_fc1_gate", "linear_fc1_up", "output_layer",
                    "in_proj", *MLA_Q_LORA, *MLA_Q, *MLA_KV})
# an expert may sit in a pool (ERNIE-4.5-VL in memory: mlp.text_moe.experts.E / mlp.vision_moe.experts.E)
_UNIT = re.compile(r"^(?:model\.layers\.(\d+)\.(self_attn\.\w+|mixer\.(?:in|out)_proj|"
                   r"mlp\.(?:(?:shared_experts?|(?:\w+_moe\.)?experts\.\d+)\.)?\w+)|(lm_head))$")
_MOE_PART = re.compile(r"(?:shared_experts?|(?:\w+_moe\.)?experts\.\d+)\.")
#: transformers 5 fused expert parameters (Qwen3-MoE) -> the per-expert HF modules they hold
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")
#: mlp_units' marker of a decoder layer whose token mixer is linear attention (no self_attn modules)
LINEAR_ATTENTION = "linear_attn"
#: mlp_units' marker of a decoder layer that is a Mamba-2 mixer (its in_proj / out_proj)
MAMBA = "mamba"
_MLP_UNITS: dict[str, dict[int, dict[str, list[str]]]] = {}


_MLA: dict[str, tuple[str, ...] | None] = {}


class FixtureUnavailable(Exception):
    """The installed transformers refuses the model's derived tiny config (an older release's config
    class validates a field the derivation sets, e.g. NemotronH's 'mlp' layer type under transformers
    5.3.0): what needs the fixture's structure cannot be known in this environment. Not a ValueError,
    so a matrix load does not read it as a bad option: the case runs, and fails naming it, or is
    not-run through a requirement first."""


def _from_fixture(model: HFModelSpec, build: Any, what: str) -> Any:
    """`build()` (the fixture's transformers config or model); None where the installed transformers has no such
    model_type (remote code only, or a release older than the family: its case is not-run through `requires`, or
    fails naming it); FixtureUnavailable, saying `what` it did ("refuses hf-x's tiny config"), where it raises."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model.arch not in CONFIG_MAPPING_NAMES:
        return None
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - whatever the config class raises, named
        import transformers

        raise FixtureUnavailable(f"transformers {transformers.__version__} {what}: {type(exc).__name__}: {exc}") from exc


def mla_targets(model: HFModelSpec) -> tuple[str, ...] | None:
    """The Megatron MLA linears of the model's attention (None: not multi-latent attention), from its
    HF config: kv_lora_rank set means MLA; q_lora_rank set: q through linear_q_down_proj / linear_q_up_proj
    (HF q_a_proj / q_b_proj), None (DeepSeek-V2-Lite): linear_q_proj (HF q_proj)."""
    key = repr(model)
    if key not in _MLA:
        from harness.models.hf import hf_config

        cfg = _from_fixture(model, lambda: hf_config(model), f"refuses {model.name}'s tiny config")
        if cfg is None:
            _MLA[key] = None
            return None
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if getattr(cfg, "kv_lora_rank", None) is None:
            _MLA[key] = None
        else:
            _MLA[key] = (MLA_Q_LORA if getattr(cfg, "q_lora_rank", None) else MLA_Q) + MLA_KV
    return _MLA[key]


def model_targets(model: HFModelSpec, targets: Iterable[str]) -> tuple[str, ...]:
    """An adapter kind's default targets as `model` has them: a non-gated MLP has no fc1 gate; a
    multi-latent-attention model's q/k/v targets (linear_qkv, CanonicalLoRA's linear_q/k/v) are its MLA
    linears (mla_targets), in their place."""
    out: list[str] = []
    mla = mla_targets(model)
    for t in targets:
        if t == "linear_fc1_gate" and not model.gated:
            continue
        if t in _QKV and mla is not None:
            out += [m for m in mla if m not in out]
        else:
            out.append(t)
    return tuple(out)


_VL_PREFIX = re.compile(r"^(?:model\.language_model\.|language_model\.model\.|thinker\.model\.)")  # an omni model: its thinker
#: hybrid families' decoder modules -> the text model's (Nemotron-H: each layer one `mixer`, attention or MLP, under
#: `backbone.` in its checkpoints and `model.` in transformers 5's memory;
#: Falcon-H1: its MLP as `feed_forward`); a Mamba mixer's in_proj / out_proj as `mixer.` (Falcon-H1's `mamba.` too)
_HYBRID_NAMES = ((re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.([qkvo]_proj)$"), r"model.layers.\1.self_attn.\2"),
                 (re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(?:mixer|mamba)\.((?:in|out)_proj)$"), r"model.layers.\1.mixer.\2"),
                 (re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.((?:up|down|gate)_proj)$"), r"model.layers.\1.mlp.\2"),
                 (re.compile(r"^model\.layers\.(\d+)\.feed_forward\.((?:up|down|gate)_proj)$"), r"model.layers.\1.mlp.\2"))


def text_name(unit: str) -> str:
    """A VL model's language-path module (in memory `model.language_model.layers.N...`, in a
    checkpoint also `language_model.model.layers.N...`, its head `language_model.lm_head`; an omni model's
    `thinker.model.layers.N...`, `thinker.lm_head`), or a hybrid
    model's attention / MLP module (_HYBRID_NAMES), under the text model's name (`model.layers.N...`,
    `lm_head`): the layout checks count decoder units the same way for all; any other module (a vision
    tower, a projector) keeps its name and so belongs to no target entry."""
    if unit in ("language_model.lm_head", "thinker.lm_head"):
        return "lm_head"
    for pat, repl in _HYBRID_NAMES:
        if pat.match(unit):
            return pat.sub(repl, unit)
    return _VL_PREFIX.sub("model.", unit)


def mlp_units(model: HFModelSpec) -> dict[int, dict[str, list[str]]]:
    """Per decoder layer, HF MLP module ("mlp.gate_proj" / "mlp.up_proj" / "mlp.down_proj") -> the
    units that hold it: a dense MLP's own, each routed expert's (a fused [E, ...] parameter counts E),
    the shared expert's. Read from transformers' model of the fixture's config, built on the meta
    device: which layers are dense (first_k_dense_replace, mlp_layer_types) and whether a layer
    has shared experts is the model's, not the Megatron side's."""
    key = repr(model)
    if key not in _MLP_UNITS:
        import torch

        from harness.models.hf import hf_config, quiet_hf
        from harness.models.vl import model_class

        quiet_hf()
        config = hf_config(model)
        with torch.device("meta"):
            hf = model_class(config).from_config(config)
        out: dict[int, dict[str, list[str]]] = {i: {f"mlp.{m}": [] for m in _MLP_LEAVES} for i in range(model.num_layers)}
        pat = re.compile(r"^model\.layers\.(\d+)\.(mlp\..+)$")
        attention = re.compile(r"^model\.layers\.(\d+)\.self_attn\.[qkvo]_proj$")
        mamba = re.compile(r"^model\.layers\.(\d+)\.mixer\.in_proj$")
        with_attention: set[int] = set()
        for name, mod in hf.named_modules():
            if (at := attention.match(text_name(name))) and int(at[1]) in out:
                with_attention.add(int(at[1]))
            if (mb := mamba.match(text_name(name))) and int(mb[1]) in out:
                out[int(mb[1])][MAMBA] = []
            if not (m := pat.match(name := text_name(name))) or int(m[1]) not in out:
                continue
            layer, leaf = out[int(m[1])], m[2].rsplit(".", 1)[-1]
            if isinstance(mod, torch.nn.Linear) and leaf in _MLP_LEAVES:
                layer[f"mlp.{leaf}"].append(name)
            elif isinstance(mod, torch.nn.Linear) and leaf == "gate_up_proj":
                # transformers 5 fuses a dense / shared expert MLP's gate and up on load (MiniMax-M3's shared
                # expert); the checkpoint, and the adapter the Bridge exports, keep gate_proj and up_proj apart
                for hf_name in ("gate_proj", "up_proj"):
                    layer[f"mlp.{hf_name}"].append(f"{name.rsplit('.', 1)[0]}.{hf_name}")
            for pname, p in mod.named_parameters(recurse=False):
                if pname in _FUSED and p.dim() == 3:
                    for e in range(p.shape[0]):
                        for hf_name in _FUSED[pname]:
                            layer[f"mlp.{hf_name}"].append(f"{name}.{e}.{hf_name}")
        for i in set(out) - with_attention:  # a hybrid model's linear-attention (Qwen3-Next), Mamba or MLP-only layer
            out[i][LINEAR_ATTENTION] = []
        _MLP_UNITS[key] = out
    return _MLP_UNITS[key]


@dataclass(frozen=True)
class Entry:
    """One Megatron target_modules entry: `target` on every layer, or on global layer `layer`."""

    pattern: str
    target: str
    layer: int | None = None


def entries(targets: Iterable[str], layers: Iterable[int] = (), within: str = "") -> list[Entry]:
    """The Megatron target_modules entries of a layout, in the order the Bridge gets them. `within`: a submodule
    the entries are confined to ("language_model": a VL model's language path, not its Megatron-built ViT),
    as the Bridge's wildcard patterns name it (`*language_model.*.linear_qkv`)."""
    layers = list(layers)
    inner = f"*{within}.*." if within else ""
    outer = f"*{within}." if within else ""
    if not layers:
        return [Entry(f"{outer if t in _OUTSIDE_LAYERS else inner}{t}", t) for t in targets]
    return ([Entry(f"{inner or '*.'}layers.{i}.*.{t}", t, i) for i in layers for t in targets if t not in _OUTSIDE_LAYERS]
            + [Entry(f"{outer}{t}", t) for t in targets if t in _OUTSIDE_LAYERS])


def hf_modules(model: HFModelSpec, target: str) -> tuple[str, ...]:
    """The HF modules of one decoder layer `target` adapts on `model` (a non-gated MLP has no gate_proj)."""
    return tuple(m for m in HF_MODULES[target] if model.gated or m != "mlp.gate_proj")


def checkpoint_leaves(model: HFModelSpec, module: str) -> set[str]:
    """The leaf names the HF checkpoint gives `module` ("self_attn.q_proj", "mlp.gate_proj") over
    the model's layers: a routed expert's projection as harness.models.peft_mapping.EXPERT_NAMES
    names it for the family (MiniMax-M2: w1 / w3 / w2), every other module its own leaf."""
    from harness.models.peft_mapping import expert_leaf

    leaf = module.rsplit(".", 1)[-1]
    if not module.startswith("mlp.") or not model.num_experts:
        return {leaf}
    units = [u for layer in mlp_units(model).values() for u in layer[module]]
    return {expert_leaf(leaf, model.arch) if re.search(r"\.experts\.\d+\.", u) else leaf for u in units} or {leaf}


def _units(model: HFModelSpec, target: str, layer: int) -> list[str]:
    out = []
    for m in hf_modules(model, target):
        if target in _OUTSIDE_LAYERS:
            out.append(m)
        elif m.startswith("mlp."):
            out += mlp_units(model)[layer][m]
        elif m.startswith("mixer."):  # a Mamba-2 layer's projections
            out += [f"model.layers.{layer}.{m}"] if MAMBA in mlp_units(model)[layer] else []
        elif not (m.startswith("self_attn.") and LINEAR_ATTENTION in mlp_units(model)[layer]):
            out.append(f"model.layers.{layer}.{m}")  # a layer without attention (Qwen3-Next's linear attention, Mamba) has none
    return out


def asked(model: HFModelSpec, ents: list[Entry]) -> dict[str, set[str]]:
    """Entry pattern -> the HF modules it selects in the model's global layer numbering."""
    return {e.pattern: {u for layer in ([e.layer] if e.layer is not None else range(model.num_layers))
                        for u in _units(model, e.target, layer)} for e in ents}


def attribute(units: Iterable[str], model: HFModelSpec, ents: list[Entry]) -> dict[str, set[str]]:
    """Each unit under the first entry that selects it (NO_ENTRY when none does)."""
    out: dict[str, set[str]] = {e.pattern: set() for e in ents}
    for unit in units:
        m = _UNIT.match(unit)
        owner = NO_ENTRY
        if m and m.group(3):  # lm_head
            owner = next((e.pattern for e in ents if e.target in _OUTSIDE_LAYERS), NO_ENTRY)
        elif m:
            layer, module = int(m.group(1)), _MOE_PART.sub("", m.group(2))
            owner = next((e.pattern for e in ents if e.target not in _OUTSIDE_LAYERS and e.layer in (None, layer)
                          and module in hf_modules(model, e.target)), NO_ENTRY)
        out.setdefault(owner, set()).add(unit)
    return out


def megatron_units(derived: dict[str, Any], model: HFModelSpec | None = None) -> set[str]:
    """The HF modules of an HF PEFT state dict (the harness's derivation from the Megatron adapter),
    under transformers' in-memory names (`model`: its checkpoint names renamed as transformers
    renames them on load, harness.models.peft_mapping.memory_name)."""
    from harness.models.peft_mapping import memory_name

    return {text_name(memory_name(_ADAPTER_PART.sub("", k).removeprefix("base_model.model."), model.arch if model else "",
                                     (model.num_experts or 0) if model else 0))
            for k in derived}


#: an HF PEFT key's adapter part after its module: a LoRA factor, or DoRA's magnitude vector
_ADAPTER_PART = re.compile(r"\.(?:lora_[AB]\.weight|lora_magnitude_vector)$")


def peft_units(peft_model: Any) -> set[str]:
    """The HF modules a loaded PeftModel wraps with LoRA (a ParamWrapper over a fused expert
    parameter [E, ...] counts as its E experts' modules)."""
    from peft.tuners.lora import LoraLayer

    out = set()
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        path = text_name(name.replace(".base_layer", "").removeprefix("base_model.model."))
        param = getattr(mod, "parameter_name", None)
        if param is None:
            out.add(path)
            continue
        experts = getattr(mod.get_base_layer(), param).shape[0]
        out |= {f"{path}.{e}.{m}" for e in range(experts) for m in _FUSED.get(param, (param,))}
    return out


def _sample(units: set[str], n: int = 4) -> str:
    s = sorted(units)
    return ", ".join(s[:n]) + (f" (+{len(s) - n} more)" if len(s) > n else "")


def _compare(name: str, left: dict[str, set[str]], right: dict[str, set[str]], lname: str, rname: str, what: str) -> Check:
    rows, bad = [], []
    for key in list(left) + [k for k in right if k not in left]:
        a, b = left.get(key, set()), right.get(key, set())
        if key == NO_ENTRY and not a and not b:
            continue
        rows.append(f"{key}: {lname} {len(a)}, {rname} {len(b)}")
        if a != b:
            diff = [f"only {lname}: {_sample(a - b)}" if a - b else "", f"only {rname}: {_sample(b - a)}" if b - a else ""]
            bad.append(f"{key}: {lname} {len(a)}, {rname} {len(b)} ({'; '.join(x for x in diff if x)})")
    if bad:
        return Check(name, "failed", "; ".join(bad), tolerance=EXACT)
    return Check(name, "passed", f"{what}: " + "; ".join(rows), tolerance=EXACT)


def targets_checks(model: HFModelSpec, ents: list[Entry], megatron: set[str], peft: set[str]) -> list[Check]:
    """lora-targets-matched: per target entry, the HF modules PEFT wraps equal (count and names)
    those the Megatron LoRA wrapped; lora-targets-asked: the Megatron LoRA wrapped what each
    entry selects in global layer numbering (asked)."""
    meg = attribute(megatron, model, ents)
    return [
        _compare("lora-targets-matched", meg, attribute(peft, model, ents), "megatron", "peft",
                 "HF modules per target entry, Megatron LoRA vs the PEFT model"),
        _compare("lora-targets-asked", asked(model, ents), meg, "asked", "megatron",
                 "HF modules per target entry, asked vs Megatron LoRA"),
    ]


def has_mamba(model: HFModelSpec) -> bool | None:
    """Whether transformers' model of the fixture has Mamba-2 layers (in_proj / out_proj targets); None where the
    installed transformers has no such model_type (a release older than the family), which cannot say."""
    units = _from_fixture(model, lambda: mlp_units(model), f"cannot build {model.name}'s tiny model")
    return None if units is None else any(MAMBA in layer for layer in units.values())


def validate(model: HFModelSpec, adapter: str, dim: int, targets: tuple[str, ...], layers: tuple[int, ...],
             topologies: Iterable[Topology], kinds: dict[str, tuple[str, ...]]) -> None:
    """A layout's options against the model and topologies: ValueError naming the option. Where the
    installed transformers cannot derive the model's config (FixtureUnavailable), the targets are not
    checked here: the run derives it again and fails naming the refusal."""
    try:
        allowed = model_targets(model, kinds[adapter]) + EXTRA_TARGETS
        if set(targets) & set(MAMBA_TARGETS):  # asked only where named: an older transformers may know no such model
            mamba = has_mamba(model)
            if mamba is None:
                allowed = None
            elif mamba:
                allowed += MAMBA_TARGETS
    except FixtureUnavailable:
        allowed = None
    bad = [t for t in targets if allowed is not None and t not in allowed]
    if bad:
        raise ValueError(f"option 'targets': {bad} not targets of adapter {adapter!r} on {model.name!r}; choose from {list(allowed)}")
    for opt, values in (("targets", targets), ("layers", layers)):
        if len(set(values)) != len(values):
            raise ValueError(f"option {opt!r}: {list(values)} names an entry twice")
    out = [i for i in layers if not 0 <= i < model.num_layers]
    if out:
        raise ValueError(f"option 'layers': {out} outside model {model.name!r}'s layers 0..{model.num_layers - 1}")
    if dim < 1:
        raise ValueError(f"option 'dim': the LoRA rank must be >= 1, got {dim}")
    # a column-parallel base's linear_in is ColumnParallelLinear(in, dim, gather_output=True): the rank is
    # split over its TP group (an expert's over expert-TP); a row-parallel base's linear_in splits its input
    column = {t for t in (targets or kinds[adapter]) if t in COLUMN}
    groups = [("tp", t) for t in column if not (t.startswith("linear_fc1") and model.num_experts)]
    groups += [("etp", t) for t in column if t.startswith("linear_fc1") and model.num_experts]
    for topo in topologies:
        for what, target in sorted(groups):
            size = getattr(topo, what)
            if dim % size:
                raise ValueError(f"option 'dim': LoRA rank {dim} is not divisible by {what}={size} of {topo.id} "
                                 f"(the {target} adapter's linear_in splits the rank over that group)")
