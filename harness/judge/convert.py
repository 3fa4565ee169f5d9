"""Judging a checkpoint format conversion without a model: read both checkpoints' full tensors
(torch DCP metadata carries each tensor's global shape, so TP/PP/DP/FSDP slicing is a layout
detail of the reader), map the source's keys the documented way, compare key by key, bitwise.

torch_dist -> fsdp_dtensor (Megatron-LM checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor
and Megatron-FSDP's own key names, megatron/core/transformer/fsdp_dtensor_checkpoint.py):
  model weight   `K`                      -> `model.module.K`
  optimizer      `optimizer.state.S.K`    -> `optimizer.state.module.module.module.K.S` (S: exp_avg,
                                             exp_avg_sq, param: the main params, fp32 in bf16)
  layers         `decoder.layers.X` [L, ...] (torch_dist stacks the layers) -> `decoder.layers.<i>.X`
  experts        `...mlp.experts.experts.X` [E, ...] (SequentialMLP, global expert axis)
                                          -> `...mlp.experts.local_experts.<e>.X`
  SwiGLU         `...linear_fc1.weight|bias` of an MLP -> `weight_w` / `weight_v`: the two halves of
                                             dim 0 (gate, then up: torch_dist stores them so at every TP)
  step           the optimizer's `param_groups[*]['step']` -> bytes entries `optimizer.param_groups.<g>.step`
`_extra_state` entries and the common state's own blob are not compared.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from harness.core.frames import raising_frame
from harness.core.parity import BITWISE, EXACT, NOT_COMPARED, Mismatch, compare_state
from harness.core.result import Check
from harness.judge.checks import empty_check
from harness.judge.ckpt_content import poison, uncovered

MODEL_PREFIX = "model.module."
OPTIMIZER_PREFIX = "optimizer.state.module.module.module."
SOURCE_OPTIMIZER = "optimizer.state."
FLAT_OPTIMIZER = "optimizer.distributed."  # dp_reshardable: one flat buffer per DDP bucket
#: a group's step in the converted checkpoint: `optimizer.param_groups.<g>.step`, or for a chained
#: optimizer (dense + expert parameters) `optimizer.<i>.optimizer.param_groups.<g>.step`
STEP_KEY = re.compile(r"^optimizer\.(?:(\d+)\.optimizer\.)?param_groups\.(\d+)\.step$")
_LAYER_INDEX = re.compile(r"\.layers\.\d+\.")
_SWIGLU = re.compile(r"\.mlp\.(?:experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\.(weight|bias)$")
SHOWN = 4  # mismatches named in a check's detail (all of them are in `mismatches`)

CHECKS = ("to-fsdp-dtensor", "fsdp-weights", "fsdp-optimizer", "fsdp-step")


@dataclass
class Contents:
    """What a DCP checkpoint holds, read model-free: full tensors and the objects asked for."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any] = field(default_factory=dict)


def read_checkpoint(directory: Path | str, objects: re.Pattern | None = None) -> Contents:
    """Every tensor of a torch DCP checkpoint at its global shape, plus the byte entries whose key
    `objects` matches (unpickled). Raises ValueError naming the key where the distributed
    optimizer's nd-reformulated form would need undoing (not read model-free here). Elements no
    chunk holds are NaN (harness.judge.ckpt_content.uncovered)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    reformulated = [k for k, v in (getattr(metadata, "mcore_data", None) or {}).items()
                    if isinstance(v, dict) and "nd_reformulated_orig_global_shape" in v]
    if reformulated:
        raise ValueError(f"{directory}: {reformulated[0]} is stored nd-reformulated (mcore_data "
                         f"nd_reformulated_orig_global_shape); the model-free reader does not undo that")
    state: dict[str, Any] = {}
    asked_tensors, asked_objects = [], []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and "_extra_state" not in key:
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            asked_tensors.append(key)
        elif isinstance(md, BytesStorageMetadata) and objects is not None and objects.search(key):
            state[key] = io.BytesIO()
            asked_objects.append(key)
    dcp.load(state, storage_reader=reader, no_dist=True)
    tensors = {k: v for k, v in state.items() if k in asked_tensors}
    for key, mask in uncovered(metadata).items():
        if key in tensors:
            poison(tensors[key], mask, key, directory)
    objs = {}
    for k in asked_objects:  # DCP's default planner hands back the unpickled object, or the raw bytes
        v = state[k]
        if isinstance(v, io.BytesIO):
            v.seek(0)
            v = torch.load(v, weights_only=False)
        objs[k] = v
    return Contents(tensors, objs)


def source_steps(common: Mapping[str, Any]) -> list[Any]:
    """The optimizer's per-group steps in a torch_dist common state (one optimizer, or a chained
    one keyed by index, as the converter reads it)."""
    opt = common.get("optimizer") if isinstance(common, Mapping) else None
    if not isinstance(opt, Mapping):
        return []
    chain = [opt] if "param_groups" in opt or "optimizer" in opt else [v for _, v in sorted(opt.items()) if isinstance(v, Mapping)]
    groups = []
    for sub in chain:
        inner = sub.get("optimizer", sub) if isinstance(sub.get("optimizer"), Mapping) else sub
        groups += inner.get("param_groups", [])
    return [_plain(g.get("step")) for g in groups]


#: dp_reshardable keeps the param groups (with their steps) in one object per DP group
FLAT_GROUPS = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.optimizer/")


def flat_steps(objects: Mapping[str, Any]) -> list[Any]:
    """The per-group steps a dp_reshardable source keeps in its `optimizer.distributed.dp_group_idx_<i>.optimizer`
    objects (read with `objects=FLAT_GROUPS`)."""
    steps = []
    for key in sorted(k for k in objects if FLAT_GROUPS.match(k)):
        value = objects[key]
        for entry in value if isinstance(value, list) else [value]:
            steps += [_plain(g.get("step")) for g in (entry or {}).get("param_groups", [])]
    return steps


def converted_steps(objects: Mapping[str, Any]) -> list[Any]:
    found = sorted((int(m.group(1) or 0), int(m.group(2)), _plain(v)) for k, v in objects.items() if (m := STEP_KEY.match(k)))
    return [v for _, _, v in found]


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _fsdp_names(param: str, tensor: torch.Tensor, swiglu: bool) -> list[tuple[str, torch.Tensor]]:
    items = [(param, tensor)]
    if ".layers." in param and not _LAYER_INDEX.search(param):
        items = [(param.replace(".layers.", f".layers.{i}.", 1), t) for i, t in enumerate(tensor.unbind(0))]
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if ".experts.experts." in name:
            out += [(name.replace(".experts.experts.", f".experts.local_experts.{e}.", 1), x) for e, x in enumerate(t.unbind(0))]
        else:
            out.append((name, t))
    if swiglu:
        split = []
        for name, t in out:
            if _SWIGLU.search(name):
                w, v = torch.chunk(t, 2, dim=0)
                split += [(f"{name}_w", w), (f"{name}_v", v)]
            else:
                split.append((name, t))
        out = split
    return out


def expected_fsdp(source: Mapping[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """The fsdp_dtensor tensors a faithful conversion of `source` (torch_dist keys) holds."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        if "_extra_state" in key or key.startswith(FLAT_OPTIMIZER):
            continue
        if key.startswith(SOURCE_OPTIMIZER):
            kind, param = key[len(SOURCE_OPTIMIZER):].split(".", 1)
            for name, t in _fsdp_names(param, tensor, swiglu):
                out[f"{OPTIMIZER_PREFIX}{name}.{kind}"] = t
        else:
            for name, t in _fsdp_names(key, tensor, swiglu):
                out[f"{MODEL_PREFIX}{name}"] = t
    return out


def _named(name: str, mismatches: Sequence[Mismatch], ok: str, what: str, compared: int) -> Check:
    """`name` failed naming its first mismatches, or passed with `ok`. `compared` (how many expected
    tensors were looked at) of 0 fails: "0 ... equal" over nothing proves nothing."""
    if not mismatches and not compared:
        return empty_check(name, f"no {what} tensor expected from the torch_dist source, none compared", "", BITWISE)
    if not mismatches:
        return Check(name, "passed", ok, 0.0)
    worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
    shown = "; ".join(str(m) for m in mismatches[:SHOWN]) + (f"; ... {len(mismatches) - SHOWN} more" if len(mismatches) > SHOWN else "")
    return Check(name, "failed", f"{len(mismatches)} {what} mismatch(es): {shown}", worst, mismatches=list(mismatches))


def judge_fsdp(source: Contents, converted: Contents, swiglu: bool, steps: Sequence[Any], optimizer: bool,
               sharding: str | None = None) -> list[Check]:
    """fsdp-weights, fsdp-optimizer and fsdp-step for a torch_dist `source` and its fsdp_dtensor
    `converted` form. `steps` is the source's optimizer step per param group (`source_steps`);
    `optimizer` whether the case saved one (its options, never what the source holds: a save that
    drops the optimizer must fail, not pass as weights-only); `sharding` the source's
    distrib_optim_sharding_type, said when the optimizer check fails."""
    expected = expected_fsdp(source.tensors, swiglu)
    label_s, label_c = "torch_dist", "fsdp_dtensor"

    def part(d: Mapping[str, torch.Tensor], model: bool) -> dict[str, torch.Tensor]:
        return {k: v for k, v in d.items() if k.startswith(OPTIMIZER_PREFIX) != model}

    weights = compare_state(part(expected, True), part(converted.tensors, True), label_s, label_c)
    n_weights = len(part(expected, True))
    checks = [_named("fsdp-weights", weights, f"{n_weights} model weights equal, bitwise, after the key mapping", "weight", n_weights)]
    flat = sorted(k for k in source.tensors if k.startswith(FLAT_OPTIMIZER))
    has_opt = bool(flat) or any(k.startswith(SOURCE_OPTIMIZER) for k in source.tensors)
    if has_opt != optimizer:
        what = ("the case saved an optimizer, but the source checkpoint holds no optimizer state" if optimizer
                else "the case saved weights only, but the source checkpoint holds optimizer state")
        checks.append(Check("fsdp-optimizer", "failed", what, tolerance=NOT_COMPARED))
    elif not optimizer:
        checks.append(Check("fsdp-optimizer", "not-run", "the case saved weights only (option optimizer: false)",
                            tolerance=NOT_COMPARED))
    else:
        problems, flat_expected = [], 0
        if flat:  # per-parameter state the flat buffers hold: every parameter's exp_avg, exp_avg_sq and param
            kinds = sorted({k.rsplit(".", 1)[1] for k in flat})
            for name in part(expected, True):
                for kind in kinds:
                    flat_expected += 1
                    key = f"{OPTIMIZER_PREFIX}{name[len(MODEL_PREFIX):]}.{kind}"
                    if key not in converted.tensors:
                        problems.append(Mismatch(key, "missing", label_s, label_c, None,
                                                 f"the source holds it inside a flat {sharding or 'dp_reshardable'} buffer ({flat[0]})"))
        opt = problems + compare_state(part(expected, False), part(converted.tensors, False), label_s, label_c)
        kinds = Counter(k.rsplit(".", 1)[1] for k in part(expected, False))
        per_kind = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        checks.append(_named("fsdp-optimizer", opt, f"{sum(kinds.values())} optimizer tensors equal, bitwise ({per_kind})", "optimizer",
                             flat_expected + sum(kinds.values())))
    if not optimizer:
        checks.append(Check("fsdp-step", "not-run", "the case saved weights only (option optimizer: false)", tolerance=NOT_COMPARED))
    elif not steps:
        checks.append(Check("fsdp-step", "failed", "the case saved an optimizer, but the source checkpoint records no optimizer step",
                            tolerance=EXACT))
    else:
        got = converted_steps(converted.objects)
        ok = list(steps) == got
        checks.append(Check("fsdp-step", "passed" if ok else "failed",
                            f"optimizer step per param group: torch_dist {list(steps)}, fsdp_dtensor {got}", tolerance=EXACT))
    return checks


def reverse_not_run(origin: str, looked_at: Sequence[str], found: Sequence[str]) -> list[Check]:
    """`to-torch-dist` and `roundtrip`: no shipped converter writes torch_dist from fsdp_dtensor.
    A command that names that direction (`found`) fails `to-torch-dist`: upstream ships one now,
    and the harness must drive it."""
    if found:
        return [Check("to-torch-dist", "failed", f"the converter at {origin} now has {list(found)}: an fsdp_dtensor -> "
                      "torch_dist direction this case does not drive yet (cases/convert.py)", tolerance=NOT_COMPARED),
                Check("roundtrip", "not-run", "no fsdp_dtensor -> torch_dist conversion ran", tolerance=NOT_COMPARED)]
    why = (f"no converter ships for fsdp_dtensor -> torch_dist at {origin}; looked at: " + "; ".join(looked_at)
           + ". The harness does not write one of its own")
    return [Check("to-torch-dist", "not-run", why, tolerance=NOT_COMPARED),
            Check("roundtrip", "not-run", "nothing to compare with the original: no fsdp_dtensor -> torch_dist "
                  "conversion ran (see to-torch-dist)", tolerance=NOT_COMPARED)]


def raise_site(traceback_text: str) -> str:
    """Where a conversion or an export broke: the raising frame as every verdict names it
    (core.frames.raising_frame: the path from its package root on, with its source line)."""
    frame = raising_frame(traceback_text)
    return str(frame) if frame else "no frame in the traceback"
