"""The harness's own Megatron -> HF PEFT adapter mapping, written from the layouts, not from the
Bridge: TP shards are gathered here, Megatron's fused QKV (interleaved per query group) and fused
SwiGLU fc1 ([gate; up] per TP rank) are split here; a non-gated fc1 (Nemotron's squared ReLU) is
HF's up_proj as it is; the output layer's adapter (vocab-parallel, like linear_qkv) is HF's lm_head.
Multi-latent attention's linears (linear_q_down_proj / linear_q_up_proj / linear_q_proj / linear_kv_down_proj /
linear_kv_up_proj) are one HF module each (q_a_proj / q_b_proj / q_proj / kv_a_proj_with_mqa / kv_b_proj), column-parallel.
MoE: a local expert's adapter (`experts.local_experts.E.`) is HF's expert E; a grouped expert
linear's (`experts.linear_fc1`, TEGroupedMLP: one adapter shared by the experts of its EP rank) is
every expert's; a shared expert's (`shared_experts.`) is the HF shared MLP, named per family from
transformers' modeling code (`SHARED_MLP`, `EXPERT_NAMES`).
Exported adapters are judged against this.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch

from harness.core.zoo import HFModelSpec

# Megatron base module -> is it column-parallel (output split across TP)?
# (MLA: q_up/kv_up and q_proj are column-parallel; the local spec builds q_down/kv_down ColumnParallelLinear
# (gather_output=False) too, megatron/core/transformer/multi_latent_attention.py:524-533, :570-580)
_COLUMN = {"linear_qkv": True, "linear_fc1": True, "linear_proj": False, "linear_fc2": False, "output_layer": True,
           "linear_q_proj": True, "linear_q_down_proj": True, "linear_q_up_proj": True, "linear_kv_down_proj": True,
           "linear_kv_up_proj": True, "in_proj": True, "out_proj": False}
# groups: layer, self_attention|mlp, an expert pool (ERNIE-4.5-VL's text_moe_layer | vision_moe_layer), the MoE part
# (experts.local_experts.E | experts | shared_experts), E,
# base, CanonicalLoRA sub-adapter, linear_in|linear_out
_NAME = re.compile(
    r"^(?:(?:thinker\.)?language_model\.)?(?:decoder\.layers\.(\d+)\.(self_attention|mlp|mixer|mamba_mixer)\.(?:(text_moe_layer|vision_moe_layer)\.)?"
    r"(?:(experts\.local_experts\.(\d+)|experts|shared_experts)\.)?)?"
    r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer|linear_q_proj|linear_q_down_proj|linear_q_up_proj|"
    r"linear_kv_down_proj|linear_kv_up_proj|in_proj|out_proj)\.adapter\.(?:adapter_(\w+)\.)?(linear_in|linear_out|weight_magnitude)"
    r"(?:(?<=magnitude)|(?<!magnitude)\.weight)$"  # DoRA's weight_magnitude is a bare parameter (dora_layers.py)
)
_HF_MODULE = {"linear_proj": "self_attn.o_proj", "linear_fc2": "mlp.down_proj",
              # multi-latent attention (megatron/bridge/models/deepseek/common.py:38-61): one HF module each
              "linear_q_proj": "self_attn.q_proj", "linear_q_down_proj": "self_attn.q_a_proj", "linear_q_up_proj": "self_attn.q_b_proj",
              "linear_kv_down_proj": "self_attn.kv_a_proj_with_mqa", "linear_kv_up_proj": "self_attn.kv_b_proj",
              # a Mamba-2 mixer's projections (Nemotron-H: transformers' NemotronHMamba2Mixer in_proj / out_proj)
              "in_proj": "mixer.in_proj", "out_proj": "mixer.out_proj"}
_CANONICAL = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj"}


@dataclass(frozen=True)
class Layout:
    """Where the HF checkpoint keeps the decoder layers and the LM head: a text model's `model.layers.`
    and `lm_head`; a VL model's language path where its checkpoint has it (transformers 5 writes each
    family's own layout back: Qwen2.5-VL `model.layers.`, Gemma 3 / Mistral 3 `language_model.model.layers.`,
    GLM-4.5V / Gemma 4 `model.language_model.layers.`). An adapter's keys follow the checkpoint's names,
    as the Bridge's export writes them (the names transformers loads a checkpoint from)."""

    layers: str = "model.layers."
    lm_head: str = "lm_head"


TEXT = Layout()
#: Words naming an encoder tower's keys (a ViT's `visual.blocks.0.mlp`, Qwen2-Audio's `audio_tower.layers.0.self_attn`): the
#: language path's layers are the other ones
_TOWER_WORDS = ("vision", "visual", "audio")
_LAYER0 = re.compile(r"^(.*?layers\.)0\.(?:self_attn|mlp|input_layernorm|mixer|norm|feed_forward)\.")


def checkpoint_layout(keys: Iterable[str]) -> Layout:
    """The Layout of an HF checkpoint from its tensor names (headers only)."""
    keys = list(keys)
    layers = next((m[1] for k in keys if (m := _LAYER0.match(k)) and not any(t in k for t in _TOWER_WORDS)), TEXT.layers)
    head = next((k.removesuffix(".weight") for k in keys if k.endswith("lm_head.weight")), TEXT.lm_head)
    return Layout(layers, head)


#: model_type -> a hybrid family's HF names of a decoder layer's attention / MLP / Mamba modules (transformers' modeling):
#: Nemotron-H holds each in its layer's `mixer` (modeling_nemotron_h.py), Falcon-H1 its MLP as `feed_forward` and
#: its Mamba-2 mixer (beside attention in every layer) as `mamba`
MODULE_NAMES = {"nemotron_h": (("self_attn.", "mixer."), ("mlp.", "mixer.")),
                "falcon_h1": (("mlp.", "feed_forward."), ("mixer.", "mamba."))}
#: model_type -> the HF module of a layer's shared expert(s) (transformers' modeling code), "mlp.shared_experts" else
SHARED_MLP = {"hy_v3": "mlp.shared_mlp", "minimax_m3_vl": "block_sparse_moe.shared_experts",
              **{m: "mlp.shared_expert" for m in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")}}
#: model_type -> (the HF routed experts' module, their gate / up / down projections), ("mlp.experts", gate/up/down_proj) else
EXPERT_NAMES = {m: ("block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}) for m in ("minimax_m2", "minimax_m3_vl")}
_EXPERT_DEFAULT = ("mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
#: model_type -> the checkpoint -> in-memory module renames transformers applies on load
#: (transformers/conversion_mapping.py: "mixtral" :796-807 for MiniMax-M2, "hy_v3" :1446-1450)
MEMORY_RENAMES = {
    **{m: ((r"\.block_sparse_moe\.", ".mlp."), (r"\.w1$", ".gate_proj"), (r"\.w3$", ".up_proj"), (r"\.w2$", ".down_proj"))
       for m in ("minimax_m2", "minimax_m3_vl")},
    "hy_v3": ((r"\.mlp\.shared_mlp\.", ".mlp.shared_experts."),),
}


def expert_leaf(leaf: str, arch: str) -> str:
    """A routed expert's HF projection "gate_proj" / "up_proj" / "down_proj" as the family's
    checkpoint names it (MiniMax-M2: w1 / w3 / w2)."""
    return EXPERT_NAMES.get(arch, _EXPERT_DEFAULT)[1][leaf.removesuffix("_proj")]


#: model_type -> (text pool, vision pool): ERNIE-4.5-VL's checkpoint numbers its experts as one list (the text pool's
#: 0..N-1, the vision pool's N..2N-1: ernie45_vl_bridge.py:42-44), transformers holds two pools (mlp.text_moe.experts,
#: mlp.vision_moe.experts, each numbered from 0: conversion_mapping.py's ernie4_5_vl_moe split)
POOLED_EXPERTS = {"ernie4_5_vl_moe": ("text_moe", "vision_moe")}
_EXPERT_UNIT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def memory_name(unit: str, arch: str, experts: int = 0) -> str:
    """An HF module name as the checkpoint (and the adapter file) spells it -> as transformers'
    model names it in memory (what PEFT wraps); `experts`: the experts per pool, for POOLED_EXPERTS."""
    for pat, repl in MEMORY_RENAMES.get(arch, ()):
        unit = re.sub(pat, repl, unit)
    if arch in POOLED_EXPERTS and experts and (m := _EXPERT_UNIT.search(unit)):
        j = int(m[1])
        unit = f"{unit[: m.start()]}.mlp.{POOLED_EXPERTS[arch][j >= experts]}.experts.{j % experts}.{unit[m.end():]}"
    return unit


def mamba_in_proj_parts(spec: HFModelSpec) -> tuple[int, ...] | None:
    """The sizes of a Mamba-2 in_proj's output parts (z, x, B, C, dt), from the model's HF config
    (transformers' NemotronH in_proj: intermediate + conv_dim + num_heads, conv_dim = x, B, C);
    None for a model without Mamba-2 heads."""
    from harness.models.hf import hf_config

    cfg = hf_config(spec)
    if getattr(cfg, "mamba_num_heads", None) is not None:  # Nemotron-H's spelling
        heads, inner, bc = cfg.mamba_num_heads, cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size
    elif getattr(cfg, "mamba_n_heads", None) is not None:  # Falcon-H1's (modeling_falcon_h1.py: intermediate = mamba_d_ssm)
        heads, bc = cfg.mamba_n_heads, cfg.mamba_n_groups * cfg.mamba_d_state
        inner = cfg.mamba_d_ssm or cfg.mamba_n_heads * cfg.mamba_d_head
    else:
        return None
    return (inner, inner, bc, bc, heads)


def gather(pieces: list[dict], gated: bool = True) -> dict[str, torch.Tensor]:
    """Full adapter tensors from every rank's pieces.

    linear_in of a column-parallel base is split on its rank dim (0), of a row-parallel base on
    its input dim (1); linear_out is split on its output dim (0), and so is a column-parallel base's
    DoRA weight_magnitude (one per output row; a row-parallel base's is replicated, its output whole).
    A fused SwiGLU fc1 (`gated`) keeps [gate_r; up_r] on each TP rank, so its linear_out and magnitude
    are de-interleaved into [gate; up]; a
    non-gated fc1's linear_out is a plain column-parallel split. A Mamba in_proj keeps
    [z_r; x_r; B_r; C_r; dt_r] on each TP rank (megatron-core's MambaMixer splits each part over TP):
    its linear_out's pieces carry their part sizes (`parts`) and are de-interleaved part by part.
    Pipeline stages hold disjoint layers; DP/CP replicas must agree bitwise.
    """
    by_name: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    parts_of: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        if p.get("parts"):
            parts_of[p["name"]] = tuple(p["parts"])
        held = by_name[p["name"]].get(p["tp_rank"])
        if held is not None and not torch.equal(held, p["data"]):
            raise ValueError(f"{p['name']}: data-parallel replicas of TP rank {p['tp_rank']} differ")
        by_name[p["name"]][p["tp_rank"]] = p["data"]
    full = {}
    for name, shards in by_name.items():
        m = _NAME.match(name)
        if not m:
            raise ValueError(f"unrecognised adapter parameter {name}")
        base, sub, which = m.group(6), m.group(7), m.group(8)
        parts = [shards[r] for r in sorted(shards)]
        if len(parts) == 1:
            full[name] = parts[0]
        elif which == "weight_magnitude" and not _COLUMN[base]:  # a row-parallel base's output is whole: replicated over TP
            if any(not torch.equal(parts[0], q) for q in parts[1:]):
                raise ValueError(f"{name}: a row-parallel DoRA magnitude differs across TP ranks (it is replicated)")
            full[name] = parts[0]
        elif which == "linear_in":
            full[name] = torch.cat(parts, dim=0 if _COLUMN[base] else 1)
        elif base == "linear_fc1" and sub is None and gated:
            halves = [p.chunk(2, dim=0) for p in parts]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif base == "in_proj":
            if name not in parts_of:
                raise ValueError(f"{name}: a Mamba in_proj adapter split over TP without its part sizes")
            split = [p.split(list(parts_of[name]), dim=0) for p in parts]
            full[name] = torch.cat([s[i] for i in range(len(parts_of[name])) for s in split], dim=0)
        else:
            full[name] = torch.cat(parts, dim=0)
    return full


def to_hf_peft(megatron: dict[str, torch.Tensor], spec: HFModelSpec, layout: Layout = TEXT) -> dict[str, torch.Tensor]:
    """HF PEFT keys (base_model.model.<layout.layers>N.<module>.lora_{A,B}.weight) -> tensors; a VL
    model's adapter (Megatron `language_model.decoder...`) under its checkpoint's `layout`. A DoRA
    weight_magnitude is PEFT's <module>.lora_magnitude_vector (1-D, no `.weight`: what peft's own
    save_pretrained writes), its rows split onto the HF modules exactly as lora_B's."""
    hd, ng = spec.head_dim, spec.num_key_value_heads
    q_per_group = spec.num_attention_heads // ng
    out: dict[str, torch.Tensor] = {}

    def put(layer: str, module: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        for old, new in MODULE_NAMES.get(spec.arch, ()):
            module = new + module.removeprefix(old) if module.startswith(old) else module
        prefix = f"base_model.model.{layout.layers}{layer}.{module}"
        if a is not None:
            out[f"{prefix}.lora_A.weight"] = a
        if b is not None and magnitude:
            out[f"{prefix}.lora_magnitude_vector"] = b[:, 0].contiguous()
        elif b is not None:
            out[f"{prefix}.lora_B.weight"] = b

    experts_module, proj = EXPERT_NAMES.get(spec.arch, _EXPERT_DEFAULT)

    def mlp(layer: str, prefix: str, names: dict[str, str], base: str, sub: str | None, is_a: bool, t: torch.Tensor) -> None:
        """An MLP's fc1 ([gate; up]) / fc2 (down) adapter onto the HF modules `prefix`.<names>."""
        if base == "linear_fc2":
            put(layer, f"{prefix}.{names['down']}", t if is_a else None, None if is_a else t)
        elif sub is not None:  # CanonicalLoRA: adapter_up / adapter_gate
            put(layer, f"{prefix}.{names[sub]}", t if is_a else None, None if is_a else t)
        elif is_a:
            put(layer, f"{prefix}.{names['gate']}", t, None)
            put(layer, f"{prefix}.{names['up']}", t, None)
        else:
            gate, up = t.chunk(2, dim=0)
            put(layer, f"{prefix}.{names['gate']}", None, gate.contiguous())
            put(layer, f"{prefix}.{names['up']}", None, up.contiguous())

    for name, t in megatron.items():
        layer, _, pool, moe, expert, base, sub, which = _NAME.match(name).groups()
        if expert is not None and pool == "vision_moe_layer":  # ERNIE-4.5-VL: HF numbers the vision pool after the text one
            expert = str(int(expert) + (spec.num_experts or 0))
        is_a, magnitude = which == "linear_in", which == "weight_magnitude"
        t = t[:, None] if magnitude else t  # a column of lora_B's rows: every split below cuts it as it cuts lora_B
        if base == "output_layer":  # lm_head; a padded vocab's extra rows carry no token
            key = "lora_magnitude_vector" if magnitude else f"lora_{'A' if is_a else 'B'}.weight"
            rows = t[: spec.vocab_size]
            out[f"base_model.model.{layout.lm_head}.{key}"] = t if is_a else (rows[:, 0] if magnitude else rows).contiguous()
        elif expert is not None:  # a routed expert (global index): HF's per-expert modules
            mlp(layer, f"{experts_module}.{expert}", proj, base, sub, is_a, t)
        elif moe == "experts":  # a grouped expert linear: one adapter, every expert's
            for e in range(spec.num_experts or 0):
                mlp(layer, f"{experts_module}.{e}", proj, base, sub, is_a, t)
        elif moe == "shared_experts":
            mlp(layer, SHARED_MLP.get(spec.arch, "mlp.shared_experts"), _EXPERT_DEFAULT[1], base, sub, is_a, t)
        elif sub is not None:  # CanonicalLoRA: one adapter per q/k/v/gate/up
            put(layer, _CANONICAL[sub], t if is_a else None, None if is_a else t)
        elif base in _HF_MODULE:
            put(layer, _HF_MODULE[base], t if is_a else None, None if is_a else t)
        elif base == "linear_qkv":
            if is_a:
                for mod in ("q_proj", "k_proj", "v_proj"):
                    put(layer, f"self_attn.{mod}", t, None)
            else:
                # attention_output_gate (Qwen3-Next, Qwen3.5): Megatron per group [q, gate, k, v] (attention.py
                # get_query_key_value_tensors), HF's q_proj per head [q_h, gate_h] (modeling_qwen3_next.py:
                # q_proj(x).view(..., head_dim * 2).chunk(2))
                gated = t.shape[0] == ng * (2 * q_per_group + 2) * hd
                qw = q_per_group * hd * (2 if gated else 1)
                grouped = t.reshape(ng, qw + 2 * hd, -1)
                q = grouped[:, :qw]
                if gated:
                    q = q.reshape(ng, 2, q_per_group, hd, -1).transpose(1, 2)
                q = q.reshape(ng * qw, -1)
                k = grouped[:, qw : qw + hd].reshape(ng * hd, -1)
                v = grouped[:, qw + hd :].reshape(ng * hd, -1)
                for mod, b in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    put(layer, f"self_attn.{mod}", None, b.contiguous())
        elif base == "linear_fc1" and not spec.gated:  # squared ReLU: fc1 is up_proj alone
            put(layer, "mlp.up_proj", t if is_a else None, None if is_a else t)
        elif base == "linear_fc1":
            if is_a:
                put(layer, "mlp.gate_proj", t, None)
                put(layer, "mlp.up_proj", t, None)
            else:
                gate, up = t.chunk(2, dim=0)
                put(layer, "mlp.gate_proj", None, gate.contiguous())
                put(layer, "mlp.up_proj", None, up.contiguous())
    return out
