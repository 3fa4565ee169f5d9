"""The checks of case pruned-export (cases/pruned_export.py): an HF export of a student model whose
config the Bridge synthesized from its training checkpoint (AutoBridge.from_auto_config with the
teacher's HF directory as the reference), judged against the student, the teacher and the
checkpoint's own tensors.

The expected HF tensors come from the checkpoint's Megatron tensors through the Llama layout
written out here (not the Bridge's mapping code: a check must not compare the code under test with
itself): fused QKV split per query group into q/k/v, fc1 into gate/up, the norms renamed, and with
tied embeddings the output head the embedding itself.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from harness.core.parity import EXACT
from harness.core.result import Check

#: the student's architecture: config.json key -> HFModelSpec field (what a pruning changes)
STUDENT_FIELDS = (("num_hidden_layers", "num_layers"), ("intermediate_size", "intermediate_size"), ("hidden_size", "hidden_size"),
                  ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                  ("vocab_size", "vocab_size"), ("tie_word_embeddings", "tied"))
#: config.json keys no student/teacher comparison judges: the dtype (export-dtype's) and the writer's version
NOT_SHARED = frozenset({"dtype", "torch_dtype", "transformers_version"})
HF_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_RENAME = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight", "mlp.linear_fc2.weight": "mlp.down_proj.weight",
           "input_layernorm.weight": "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
           "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
           "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight"}


def per_layer(megatron: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors (no `optimizer.` entries) with megatron-core's stacked layer tensors
    (`decoder.layers.<name>`, [L, ...], as a dist checkpoint stores them) split into
    `decoder.layers.<i>.<name>`."""
    out: dict[str, torch.Tensor] = {}
    for key, t in megatron.items():
        if key.startswith("optimizer.") or "_extra_state" in key:
            continue
        if key.startswith("decoder.layers.") and not _LAYER.fullmatch(key):
            rest = key.removeprefix("decoder.layers.")
            out.update({f"decoder.layers.{i}.{rest}": t[i] for i in range(t.shape[0])})
        else:
            out[key] = t
    return out


def expected_hf(megatron: Mapping[str, torch.Tensor], heads: int, kv_heads: int, tied: bool) -> dict[str, torch.Tensor]:
    """The HF Llama tensors a faithful export of these Megatron model tensors writes (per_layer's
    reading of a checkpoint's tensors). A Megatron key the layout does not know is kept under its
    own name, so the comparison names it."""
    out: dict[str, torch.Tensor] = {}
    for key, t in per_layer(megatron).items():
        m = _LAYER.fullmatch(key)
        if key == "embedding.word_embeddings.weight":
            out[EMBED] = t
            if tied:
                out[LM_HEAD] = t
        elif key == "output_layer.weight":
            out[LM_HEAD] = t
        elif key == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif m and m.group(2) == "self_attention.linear_qkv.weight":
            per_group = heads // kv_heads + 2
            d = t.shape[0] // (kv_heads * per_group)
            g = t.reshape(kv_heads, per_group * d, -1)
            q_rows = (per_group - 2) * d
            base = f"model.layers.{m.group(1)}.self_attn."
            out[base + "q_proj.weight"] = g[:, :q_rows].reshape(-1, t.shape[1])
            out[base + "k_proj.weight"] = g[:, q_rows:q_rows + d].reshape(-1, t.shape[1])
            out[base + "v_proj.weight"] = g[:, q_rows + d:].reshape(-1, t.shape[1])
        elif m and m.group(2) == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[f"model.layers.{m.group(1)}.mlp.gate_proj.weight"] = gate
            out[f"model.layers.{m.group(1)}.mlp.up_proj.weight"] = up
        elif m and m.group(2) in _RENAME:
            out[f"model.layers.{m.group(1)}.{_RENAME[m.group(2)]}"] = t
        else:
            out[key] = t
    return {k: v.contiguous() for k, v in out.items()}


def config_check(exported: Mapping[str, Any], teacher: Mapping[str, Any], student: Mapping[str, Any]) -> Check:
    """export-config: the exported config.json has the student's architecture (`student`: config
    key -> the student's value) and every other field of the teacher's config.json with the
    teacher's value; the student must differ from the teacher somewhere, or the check would not
    tell a synthesized config from the teacher's copied."""
    problems = []
    if not exported:
        problems.append("the export has no config.json (or an empty one)")
    if not any(teacher.get(k) != v for k, v in student.items()):
        problems.append(f"the student ({dict(student)}) does not differ from the teacher: nothing tells the configs apart")
    for k, v in student.items():
        if exported and exported.get(k) != v:
            problems.append(f"{k} {exported.get(k, '<absent>')!r}, the student's is {v!r} (the teacher's {teacher.get(k, '<absent>')!r})")
    shared = [k for k in teacher if k not in student and k not in NOT_SHARED]
    for k in shared:
        if exported and exported.get(k, "<absent>") != teacher[k]:
            problems.append(f"{k} {exported.get(k, '<absent>')!r}, the teacher's {teacher[k]!r}")
    extra = sorted(set(exported) - set(teacher) - set(student) - NOT_SHARED)
    if extra:
        problems.append(f"fields neither config has: {extra}")
    if problems:
        return Check("export-config", "failed", "; ".join(problems), tolerance=EXACT)
    return Check("export-config", "passed", f"the student's {', '.join(f'{k}={v}' for k, v in student.items())} and the teacher's "
                 f"other {len(shared)} field(s)", tolerance=EXACT)


def dtype_check(config_dtype: str | None, tensors: Mapping[str, torch.Tensor], dtype: str) -> Check:
    """export-dtype: config.json declares the run's dtype (`dtype`, transformers 4's `torch_dtype`)
    and every floating tensor of the export has it."""
    want = HF_DTYPE[dtype]
    problems = [] if config_dtype == want else [f"config.json declares dtype {config_dtype!r}, the run was {want}"]
    wrong = sorted(k for k, t in tensors.items() if t.is_floating_point() and str(t.dtype).removeprefix("torch.") != want)
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) not {want}, e.g. {wrong[0]} ({tensors[wrong[0]].dtype})")
    if not tensors:
        problems.append("the export holds no tensor")
    if problems:
        return Check("export-dtype", "failed", "; ".join(problems), tolerance=EXACT)
    return Check("export-dtype", "passed", f"config.json and {len(tensors)} tensors {want}, as the run", tolerance=EXACT)


def tied_check(tensors: Mapping[str, torch.Tensor], tie_word_embeddings: Any, tied: bool) -> Check:
    """tied-output: a tied student's export says tie_word_embeddings true and writes lm_head.weight
    equal to the embedding bitwise (a config-only bridge has no source key list, so the Bridge emits
    the tied head); an untied one says false and writes its own head (export-weights compares it)."""
    problems = []
    if tie_word_embeddings is not tied:
        problems.append(f"config.json tie_word_embeddings {tie_word_embeddings!r}, the student's {tied}")
    if EMBED not in tensors:
        problems.append(f"no {EMBED}")
    if LM_HEAD not in tensors:
        problems.append(f"no {LM_HEAD}")
    elif tied and EMBED in tensors:
        head, embed = tensors[LM_HEAD], tensors[EMBED]
        if head.dtype != embed.dtype or head.shape != embed.shape or not torch.equal(head, embed):
            problems.append(f"{LM_HEAD} ({head.dtype}{list(head.shape)}) is not {EMBED} ({embed.dtype}{list(embed.shape)}) bitwise")
    if problems:
        return Check("tied-output", "failed", "; ".join(problems), tolerance=EXACT)
    what = f"{LM_HEAD} written, equal to {EMBED} bitwise" if tied else f"untied: {LM_HEAD} written on its own"
    return Check("tied-output", "passed", what, tolerance=EXACT)
