"""LoRA layouts beyond the default adapter (issue 21 item 5): which Megatron target entries a
layout asks for, what each entry should select, and whether the Megatron LoRA and the HF PEFT model
loaded from its export wrap the same modules per entry.

A layout is the PEFT cases' options (cases._peft.PeftOptions): `targets` (a subset of the adapter
kind's base linears), `layers` (global decoder layers: each target becomes the Bridge's documented
wildcard entry `*.layers.N.*.<target>`, megatron/bridge/peft/lora.py's LoRA docstring) and any `dim`.
Everything is counted in HF module units (`model.layers.L.self_attn.q_proj`, an expert's
`model.layers.L.mlp.experts.E.gate_proj`), the unit a PEFT adapter wraps:
  asked     what the entry selects in the model's global layer numbering (the harness's own table)
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
    "output_layer": ("lm_head",),  # not in a decoder layer: a layer filter leaves it one entry
}
#: targets beyond the adapter kinds' defaults (both kinds wrap it with a plain LoRALinear)
EXTRA_TARGETS = ("output_layer",)
_OUTSIDE_LAYERS = {"output_layer"}
NO_ENTRY = "(no entry)"
#: targets on a column-parallel base (their adapter's linear_in splits the rank over TP)
COLUMN = frozenset({"linear_qkv", "linear_q", "linear_k", "linear_v", "linear_fc1", "linear_fc1_gate", "linear_fc1_up", "output_layer"})
_UNIT = re.compile(r"^(?:model\.layers\.(\d+)\.(self_attn\.\w+|mlp\.(?:experts\.\d+\.)?\w+)|(lm_head))$")
#: transformers 5 fused expert parameters (Qwen3-MoE) -> the per-expert HF modules they hold
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class Entry:
    """One Megatron target_modules entry: `target` on every layer, or on global layer `layer`."""

    pattern: str
    target: str
    layer: int | None = None


def entries(targets: Iterable[str], layers: Iterable[int] = ()) -> list[Entry]:
    """The Megatron target_modules entries of a layout, in the order the Bridge gets them."""
    layers = list(layers)
    if not layers:
        return [Entry(t, t) for t in targets]
    return ([Entry(f"*.layers.{i}.*.{t}", t, i) for i in layers for t in targets if t not in _OUTSIDE_LAYERS]
            + [Entry(t, t) for t in targets if t in _OUTSIDE_LAYERS])


def hf_modules(model: HFModelSpec, target: str) -> tuple[str, ...]:
    """The HF modules of one decoder layer `target` adapts on `model` (a non-gated MLP has no gate_proj)."""
    return tuple(m for m in HF_MODULES[target] if model.gated or m != "mlp.gate_proj")


def _units(model: HFModelSpec, target: str, layer: int) -> list[str]:
    out = []
    for m in hf_modules(model, target):
        if target in _OUTSIDE_LAYERS:
            out.append(m)
        elif m.startswith("mlp.") and model.num_experts:
            out += [f"model.layers.{layer}.mlp.experts.{e}.{m[4:]}" for e in range(model.num_experts)]
        else:
            out.append(f"model.layers.{layer}.{m}")
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
            layer, module = int(m.group(1)), re.sub(r"experts\.\d+\.", "", m.group(2))
            owner = next((e.pattern for e in ents if e.target not in _OUTSIDE_LAYERS and e.layer in (None, layer)
                          and module in hf_modules(model, e.target)), NO_ENTRY)
        out.setdefault(owner, set()).add(unit)
    return out


def megatron_units(derived: dict[str, Any]) -> set[str]:
    """The HF modules of an HF PEFT state dict (the harness's derivation from the Megatron adapter)."""
    return {re.sub(r"\.lora_[AB]\.weight$", "", k).removeprefix("base_model.model.") for k in derived}


def peft_units(peft_model: Any) -> set[str]:
    """The HF modules a loaded PeftModel wraps with LoRA (a ParamWrapper over a fused expert
    parameter [E, ...] counts as its E experts' modules)."""
    from peft.tuners.lora import LoraLayer

    out = set()
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        path = name.replace(".base_layer", "").removeprefix("base_model.model.")
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


def validate(model: HFModelSpec, adapter: str, dim: int, targets: tuple[str, ...], layers: tuple[int, ...],
             topologies: Iterable[Topology], kinds: dict[str, tuple[str, ...]]) -> None:
    """A layout's options against the model and topologies: ValueError naming the option."""
    allowed = tuple(t for t in kinds[adapter] if model.gated or t != "linear_fc1_gate") + EXTRA_TARGETS
    bad = [t for t in targets if t not in allowed]
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
