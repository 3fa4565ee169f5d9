"""LoRA layouts for the explorer (`ckpt-harness explore --kind lora`, issue 21 item 5): hypothesis
draws (HF model, S, D, layout) and runs case peft-export on it, as a matrix entry would.

A layout is the PEFT cases' own options (cases.shared.peft.PeftOptions): adapter kind, a rank `dim` that
need not divide hidden or ffn, `alpha`, `targets` (a subset of the kind's base linears, the output
layer included) and `layers` (a layer filter: the Bridge's wildcard entries `*.layers.N.*.<target>`).
Models: Llama, Qwen2, Nemotron (non-gated MLP) and Qwen3-MoE (experts a multiple of EP, 1..3 local
experts, at least 2, top-2, expert ffn a multiple of ETP), tied or not, with hf_models' odd sizes (ffn is not 2 x hidden),
up to 12 layers. Every draw is valid: Topology.validate for both topologies and the layout's own
validation (`PeftOptions.validate_layout`: rank divisible by the TP group that splits it, targets of
the kind, layers in range), the same rules the matrix loader applies to an entry.

KNOWN lists the upstream defects the matrices already name (strict xfails in matrices/*.yaml). By
default a draw that one of them explains is either not drawn (`xfail` None: the defect breaks the
whole run) or excused when exactly its checks fail (the example counts as `xfailed`), so a search
looks past them; `known_defects=True` (`--lora-known-defects`) draws and counts them all.
A failing example prints the zoo line and a matrix entry whose `options` carry the layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml
from hypothesis import strategies as st

from harness.core.spec import CaseSpec, XFail
from harness.core.topology import Topology, TopologyError
from harness.core.zoo import HFModelSpec

#: (model, S, D, layout): the layout is cases.shared.peft.PeftOptions
Draw = tuple[HFModelSpec, Topology, Topology, Any]
CASE, BACKEND = "peft-export", "bridge_peft"


def topologies(max_world: int, moe: bool) -> list[Topology]:
    """Every tp/pp/dp (and for MoE ep, etp in {1, tp}) topology of <= max_world ranks, no CP
    (peft-export's Megatron forward has no CP path), smallest world first (hypothesis shrinks to it)."""
    sizes = range(1, max_world + 1)
    out = set()
    for t in sizes:
        for p in sizes:
            for d in sizes:
                if t * p * d > max_world:
                    continue
                for e in (sizes if moe else [1]):
                    for et in ({1, t} if moe else {t}):
                        try:
                            out.add(Topology(tp=t, pp=p, dp=d, ep=e, etp=et))
                        except TopologyError:
                            pass
    return sorted(out, key=lambda x: (x.world_size, x.ep, x.dp, x.pp, x.tp, x.etp))


def model_name(values: dict[str, Any]) -> str:
    """A stable name for a drawn shape (its fields' hash), so a printed zoo entry names itself
    (harness.orchestration.explore's draws too)."""
    return "explore-" + hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:8]


@st.composite
def lora_models(draw: st.DrawFn, tp: int, pp: int, ep: int, etp: int, moe: bool, ffn_unit: int = 1) -> HFModelSpec:
    """An HF fixture both topologies hold: heads tp x {1, 2, 3, 4, 6}, hidden heads x {8, 12, 16},
    ffn tp x 2..24 (any ratio to hidden), layers pp x 1..max(3, 12 / pp) (a layer filter meets
    10 and 11 only past 10 layers), vocab tp x 8..50, no vocab padding; MoE (Qwen3-MoE):
    experts ep x 1..3 (at least 2), expert ffn a multiple of lcm(etp, `ffn_unit`), top-2."""
    heads = tp * draw(st.sampled_from([1, 2, 3, 4, 6]))
    values: dict[str, Any] = dict(
        arch="qwen3_moe" if moe else draw(st.sampled_from(["llama", "qwen2", "nemotron"])),
        tied=draw(st.booleans()),
        num_layers=pp * draw(st.integers(1, max(3, 12 // pp))),
        hidden_size=heads * draw(st.sampled_from([8, 12, 16])),
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([g for g in range(tp, heads + 1, tp) if heads % g == 0])),
        intermediate_size=tp * draw(st.integers(2, 24)),
        vocab_size=tp * draw(st.integers(8, 50)),
    )
    if moe:  # top-2 always: top-1 with the fixture's norm_topk_prob is refused by megatron-core's own rule
        # (transformer_config.py:2329-2336, "Please use --moe-router-pre-softmax when topk is 1"), which
        # the Bridge maps from norm_topk_prob (qwen3_moe_bridge.py:66): such an HF model has no Megatron twin
        values["num_experts"] = ep * draw(st.integers(1 if ep > 1 else 2, 3))
        values["moe_intermediate_size"] = math.lcm(etp, ffn_unit) * draw(st.integers(1, 12 // ffn_unit))
    return HFModelSpec(model_name(values), "drawn by harness.orchestration.explore_lora", **values)


@st.composite
def layouts(draw: st.DrawFn, model: HFModelSpec, src: Topology, dst: Topology) -> Any:
    """A layout for `model`: kind, rank a multiple of every TP/ETP size of S and D times 1..6 (so
    often not dividing hidden or ffn), alpha the default or 1..32, all targets or a subset (output layer included),
    every layer or a filter of 1..3 layers."""
    from harness.cases.shared.lora_layout import EXTRA_TARGETS
    from harness.cases.shared.peft import ADAPTERS, PeftOptions

    adapter = draw(st.sampled_from(["lora", "canonical_lora"]))
    kind = [t for t in ADAPTERS[adapter] if model.gated or t != "linear_fc1_gate"] + list(EXTRA_TARGETS)
    unit = math.lcm(src.tp, dst.tp, src.etp, dst.etp)
    targets: tuple[str, ...] = ()
    if draw(st.booleans()):
        chosen = draw(st.sets(st.sampled_from(kind), min_size=1))
        targets = tuple(t for t in kind if t in chosen)
    layers: tuple[int, ...] = ()
    if draw(st.booleans()):
        layers = tuple(sorted(draw(st.sets(st.integers(0, model.num_layers - 1), min_size=1, max_size=3))))
    return PeftOptions(adapter=adapter, dim=unit * draw(st.integers(1, 6)), alpha=draw(st.one_of(st.just(PeftOptions.alpha), st.integers(1, 32))),
                       targets=targets, layers=layers)


# --------------------------------------------------------------------------- known upstream defects


@dataclass(frozen=True)
class Known:
    """An upstream defect a matrix entry already names: `applies` to a draw; `xfail` None means
    the draw is not drawn by default, else it is excused when `xfail` explains its result."""

    name: str
    entry: str  # the matrix entry naming it (matrices/*.yaml tag)
    applies: Callable[[HFModelSpec, Topology, Topology, Any], bool]
    xfail: XFail | None = None


def _targets(layout: Any, model: HFModelSpec) -> set[str]:
    return set(layout.base_targets(model))


def _canonical_partial(m: HFModelSpec, s: Topology, d: Topology, lo: Any) -> bool:
    """CanonicalLoRA on some but not all of q/k/v, or of a gated fc1's gate/up (any fc1 target of a non-gated one)."""
    t = _targets(lo, m)
    qkv, fc1 = t & {"linear_q", "linear_k", "linear_v"}, t & {"linear_fc1_up", "linear_fc1_gate"}
    return lo.adapter == "canonical_lora" and (0 < len(qkv) < 3 or (bool(fc1) and (len(fc1) < 2 or not m.gated)))


KNOWN: tuple[Known, ...] = (
    Known("canonical-partial", "extended.yaml lora-layouts defect-canonical-partial-qkv, smoke.yaml defect-canonical-nongated",
          _canonical_partial),
    Known("canonical-fc1-tp-change", "smoke.yaml canonical_lora tp2 -> pp2 (adapter_gate/adapter_up)",
          lambda m, s, d, lo: lo.adapter == "canonical_lora" and s.tp != d.tp and bool(_targets(lo, m) & {"linear_fc1_up", "linear_fc1_gate"})),
    Known("canonical-fc1-odd-ffn", "extended.yaml lora-layouts defect-canonical-fc1-odd-ffn",
          lambda m, s, d, lo: lo.adapter == "canonical_lora" and s != d and m.gated and m.intermediate_size % 2 == 1
          and bool(_targets(lo, m) & {"linear_fc1_up", "linear_fc1_gate"})),
    Known("canonical-qkv-tokens-per-tp", "extended.yaml lora-layouts defect-canonical-qkv-tp3",
          lambda m, s, d, lo: lo.adapter == "canonical_lora" and bool(_targets(lo, m) & {"linear_q", "linear_k", "linear_v"})
          and any((2 * m.seq_length) % t.tp for t in (s, d))),  # truth.hf_batch: 2 sequences
    Known("ep-export", "smoke.yaml defect-ep-adapter", lambda m, s, d, lo: bool(m.num_experts) and max(s.ep, d.ep) > 1),
    Known("etp-fc1-export", "smoke.yaml defect-etp-fc1", lambda m, s, d, lo: bool(m.num_experts) and max(s.etp, d.etp) > 1),
    Known("hf-moe-grouped-mm-stride", "extended.yaml lora-layouts defect-hf-grouped-mm-stride",
          lambda m, s, d, lo: bool(m.num_experts) and m.moe_intermediate_size % 4 != 0),
    Known("layers-dist-ckpt", "extended.yaml lora-layouts defect-layers-dist-ckpt", lambda m, s, d, lo: bool(lo.layers) and s != d),
    Known("layers-stage-local", "extended.yaml lora-layouts defect-layers-pp", lambda m, s, d, lo: bool(lo.layers) and s.pp > 1),
    Known("layers-regex-dot", "extended.yaml lora-layouts defect-layers-regex",
          lambda m, s, d, lo: any(0 < i and 10 * i < m.num_layers for i in lo.layers)),
    Known("layers-target-modules", "extended.yaml lora-layouts defect-layers-target-modules", lambda m, s, d, lo: bool(lo.layers),
          XFail("Megatron-Bridge 0.6.2 writes a layer-filtered adapter's target_modules as bare module names", checks=(
              "peft-load", "lora-targets-matched"))),
    Known("tied-output-merge", "extended.yaml lora-layouts defect-tied-output-merge",
          lambda m, s, d, lo: m.tied and "output_layer" in _targets(lo, m),
          XFail("merging an lm_head LoRA of a tied model: Bridge drops it, peft folds it into the input embedding",
                checks=("merge", "merged-logits"))),
    Known("moe-gate-up-without-down", "extended.yaml lora-layouts defect-peft-moe-gate-up-only",
          lambda m, s, d, lo: bool(m.num_experts) and bool(_targets(lo, m) & {"linear_fc1", "linear_fc1_up", "linear_fc1_gate"})
          and "linear_fc2" not in _targets(lo, m),
          XFail("peft renames a fused experts' gate_up LoRA to the inner wrapper's keys even without down_proj",
                checks=("peft-load", "merge", "logits", "merged-logits"))),
    Known("tied-output-pp", "extended.yaml lora-layouts defect-tied-output-pp",
          lambda m, s, d, lo: m.tied and "output_layer" in _targets(lo, m) and s.pp > 1,
          XFail("a tied model's lm_head LoRA at PP > 1: Megatron applies it twice", checks=("logits", "merged-logits"))),
)


def known_defects(model: HFModelSpec, src: Topology, dst: Topology, layout: Any) -> list[Known]:
    return [k for k in KNOWN if k.applies(model, src, dst, layout)]


def excused(draw_: Draw, result: Any) -> str:
    """The known defects that explain `result` together (their names, "" when they do not): a
    draw may meet several (a layer filter on a tied model's output layer)."""
    known = [k for k in known_defects(*draw_) if k.xfail is not None]
    if not known:
        return ""
    together = XFail(", ".join(k.name for k in known), checks=tuple(c for k in known for c in k.xfail.checks))
    return "" if together.explains(result) else together.reason


# --------------------------------------------------------------------------- drawing


def _valid(d: Draw, max_world: int, with_known: bool) -> bool:
    model, src, dst, layout = d
    try:
        for topo in (src, dst):
            topo.validate(model, available_ranks=max_world)
        layout.validate_layout(model, (src, dst))
    except (TopologyError, ValueError):
        return False
    return with_known or all(k.xfail is not None for k in known_defects(model, src, dst, layout))


@st.composite
def _raw(draw: st.DrawFn, max_world: int, with_known: bool) -> Draw:
    moe = draw(st.booleans())
    topos = topologies(max_world, moe)
    if moe and not with_known:  # EP > 1 and ETP > 1 exports are known defects: draw what can pass
        topos = [t for t in topos if t.ep == 1 and t.etp == 1]
    src = draw(st.sampled_from(topos))
    dst = draw(st.sampled_from(topos))  # S == D too: peft-export then exports at S only (no dist checkpoint)
    model = draw(lora_models(math.lcm(src.tp, dst.tp), math.lcm(src.pp, dst.pp), math.lcm(src.ep, dst.ep), math.lcm(src.etp, dst.etp), moe,
                             1 if with_known else 4))  # fp32 rows of 16 bytes: hf-moe-grouped-mm-stride otherwise
    return model, src, dst, draw(layouts(model, src, dst))


def draws(max_world: int = 4, with_known: bool = False) -> st.SearchStrategy[Draw]:
    """Valid (model, S, D, layout) draws (`with_known`: known defects drawn too)."""
    return _raw(max_world, with_known).filter(lambda d: _valid(d, max_world, with_known))


# --------------------------------------------------------------------------- running and reproducing


@contextmanager
def in_zoo(model: HFModelSpec) -> Iterator[None]:
    """The drawn model in the zoo while its case runs (the case and the matrix loader look models up by name)."""
    from harness.core import zoo

    held = zoo.ZOO.get(model.name)
    zoo.ZOO[model.name] = model
    try:
        yield
    finally:
        if held is None:
            zoo.ZOO.pop(model.name, None)
        else:
            zoo.ZOO[model.name] = held


def layout_options(layout: Any) -> dict[str, Any]:
    """The layout as matrix `options` (the adapter always, other fields when not their default)."""
    from harness.cases.shared.peft import PeftOptions

    base = PeftOptions()
    out = {"adapter": layout.adapter}
    for f in fields(layout):
        value = getattr(layout, f.name)
        if f.name != "adapter" and value != getattr(base, f.name):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def tag(model: HFModelSpec, layout: Any) -> str:
    return "layout-" + hashlib.sha256(json.dumps(layout_options(layout), sort_keys=True).encode()).hexdigest()[:8]


def spec_of(model: HFModelSpec, src: Topology, dst: Topology, layout: Any, timeout_s: float) -> CaseSpec:
    return CaseSpec(CASE, model.name, BACKEND, src, dst, options=tuple(sorted(asdict(layout).items())), tag=tag(model, layout),
                    markers=("peft",), timeout_s=timeout_s)


def run_draw(model: HFModelSpec, src: Topology, dst: Topology, layout: Any, workdir: Path, timeout_s: float) -> Any:
    """peft-export on the draw, as the runner runs a matrix entry (validation included)."""
    from harness.orchestration.runner import RunOptions, run_case

    with in_zoo(model):
        return run_case(spec_of(model, src, dst, layout, timeout_s), RunOptions(workdir=workdir, timeout_s=timeout_s))


def matrix_entry(model: HFModelSpec, src: Topology, dst: Topology, layout: Any) -> str:
    """The matrices/*.yaml entry that reproduces the draw once the zoo has `model`: the layout in its options."""
    markers = ["peft", "integrity"] + (["moe"] if model.num_experts else []) + (["tied"] if model.tied else [])
    opts = yaml.safe_dump(layout_options(layout), default_flow_style=True, sort_keys=False, width=10_000).strip()
    return (f"  - case: {CASE}\n    models: [{model.name}]\n    backends: [{BACKEND}]\n    markers: [{', '.join(markers)}]\n"
            f"    pairs: [\"{src.id} -> {dst.id}\"]\n    options: {opts}\n    tag: {tag(model, layout)}")
