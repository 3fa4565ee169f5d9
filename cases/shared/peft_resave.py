"""peft-resave (peft-export): what users do with an adapter the Bridge exported once they have loaded it
(keep training or merge, then save it again; verl saves its LoRA adapters through peft). The adapter loaded
with PeftModel.from_pretrained (cases.shared.peft.peft_views, the load the other checks judge) is saved back
with its own save_pretrained, default arguments (peft.utils.save_and_load.get_peft_model_state_dict picks
what is written), and the re-save must give back the export:

  tensors  every tensor name of the export is in the re-save with the same values (read with safetensors
           on both sides); bitwise, except that a tensor peft upcast on load (from_pretrained's
           autocast_adapter_dtype: a bf16 adapter is held and so re-saved in fp32) must hold exactly the
           same values in the wider dtype (said in the detail). A name the re-save drops, or a value that
           differs, fails and is named.
  config   adapter_config.json's fields that decide behaviour (CONFIG_FIELDS; target_modules as a set)
           equal the export's, a field the export leaves out read as peft's LoraConfig default
  logits   the re-saved adapter loaded with PeftModel.from_pretrained into a fresh base model gives the
           first load's logits on the case's inputs, torch.equal

A tensor the re-save holds under another name with exactly the export's values (transformers 5 renames some
VL models' modules on load, `language_model.model.` -> `model.language_model.`, and peft saves the loaded
names) passes, the renaming said in the detail. What peft writes on purpose in its own layout is said in the
detail, and judged by the logits only:
  - names the re-save adds: the base embedding/lm_head weights peft saves when an embedding layer is a
    target (save_embedding_layers="auto"), or LoRA weights peft created for modules the export had none for;
  - an MoE adapter peft 0.21 moved on load into transformers' merged experts (`target_parameters` in the
    re-saved config): its per-expert tensors (`.experts.<n>.` names only) come back as peft's merged-expert
    tensors, and its target_modules lose the expert projections (one way: peft renames on load, not on save).

Zero tensors compared (no adapter tensor in either file) fails: an empty re-save of an empty export proves nothing.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from harness.core.parity import BITWISE, Mismatch, compare_state, max_abs_diff
from harness.core.result import Check
from harness.judge.hf_integrity import ADAPTER_WEIGHTS
from harness.models.hf import quiet_hf
from harness.models.vl import forward_model

NAME = "peft-resave"
CONFIG_NAME = "adapter_config.json"
#: adapter_config.json fields that decide how peft applies the adapter, with peft's LoraConfig default for a
#: field the file leaves out (modules_to_save: None and [] both save no extra module)
CONFIG_FIELDS: dict[str, Any] = {"r": 8, "lora_alpha": 8, "target_modules": None, "use_rslora": False, "modules_to_save": None}
EXPORTED, RESAVED = "bridge-export", "peft-resave"
SHOWN = 8  # mismatches named in the detail; the check's mismatches list holds all of them


def resave_dir(case_dir: Path) -> Path:
    """Where peft-export has peft save the loaded adapter again: inside the case's own directory."""
    return case_dir / "peft-resave"


@torch.no_grad()
def resaved_logits(base_dir: Path, resaved: Path, input_ids: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """The re-saved adapter `resaved` loaded as users do (PeftModel.from_pretrained over a fresh HF base,
    cases.shared.peft.load_peft), in eval mode: its logits of `input_ids`, as peft_views computes the first load's."""
    from .peft import load_peft

    quiet_hf()
    model = load_peft(base_dir, resaved, dtype)
    model.eval()
    return forward_model(model)(input_ids=input_ids).logits.float()


def _tensors(directory: Path, problems: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = Path(directory) / ADAPTER_WEIGHTS
    if not f.is_file():
        problems.append(f"no {ADAPTER_WEIGHTS} in {directory}")
        return {}
    return load_file(str(f))


def _config(directory: Path, problems: list[str]) -> dict[str, Any] | None:
    f = Path(directory) / CONFIG_NAME
    if not f.is_file():
        problems.append(f"no {CONFIG_NAME} in {directory}")
        return None
    return json.loads(f.read_text())


def _behaviour(cfg: dict[str, Any], field: str) -> Any:
    value = cfg.get(field, CONFIG_FIELDS[field])
    if field == "target_modules":  # a list is a set of names; a string is peft's regex over module names
        return value if isinstance(value, str) or value is None else sorted(set(value))
    if field == "modules_to_save":
        return sorted(value) if value else None
    if field == "use_rslora":
        return bool(value)
    return value


def config_mismatches(exported: dict[str, Any], resaved: dict[str, Any], moved: bool = False) -> list[Mismatch]:
    """CONFIG_FIELDS whose value (read as peft reads it) differs between the two adapter_config.json files
    (target_modules not when `moved`: peft moved expert projections to target_parameters, the module docstring)."""
    out = []
    for field in CONFIG_FIELDS:
        if field == "target_modules" and moved:
            continue
        a, b = _behaviour(exported, field), _behaviour(resaved, field)
        if a != b:
            out.append(Mismatch(f"{CONFIG_NAME} {field}", "value", EXPORTED, RESAVED, None, f"exported {a!r}, re-saved {b!r}"))
    return out


def moved_experts(cfg: dict[str, Any] | None) -> bool:
    """peft moved an MoE adapter into transformers' merged experts on load: its re-saved config names
    target_parameters."""
    return bool((cfg or {}).get("target_parameters"))


def logits_mismatch(first: torch.Tensor, again: torch.Tensor) -> Mismatch | None:
    """None when the re-saved adapter's logits torch.equal the first load's."""
    if first.shape != again.shape or first.dtype != again.dtype:
        return Mismatch("logits", "shape" if first.shape != again.shape else "dtype", "first load", "re-saved load", None,
                        f"{first.dtype}{tuple(first.shape)} vs {again.dtype}{tuple(again.shape)}")
    if torch.equal(first, again):
        return None
    return Mismatch("logits", "value", "first load", "re-saved load", max_abs_diff(first, again), "not torch.equal")


def _upcast(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`b` is `a` upcast: a wider floating dtype of the same shape holding exactly `a`'s values."""
    return (a.shape == b.shape and a.is_floating_point() and b.is_floating_point()
            and torch.finfo(b.dtype).bits > torch.finfo(a.dtype).bits and torch.equal(a.to(b.dtype), b))


#: a routed expert's own tensor (`...experts.<n>....`): what peft merges when it moves an MoE adapter
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _renamed(missing: list[str], extra: list[str], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, str]:
    """{export name: re-saved name} for each export tensor the re-save holds under another name: one to one,
    the same shape and exactly the same values (an upcast's too)."""
    def key(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.detach().double().contiguous().numpy().tobytes()

    pool: dict[tuple, list[str]] = {}
    for name in extra:
        if b[name].is_floating_point():
            pool.setdefault(key(b[name]), []).append(name)
    out = {}
    for name in missing:
        found = pool.get(key(a[name])) if a[name].is_floating_point() else None
        if found:
            out[name] = found.pop(0)
    return out


def _tensor_mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], moved: bool) -> tuple[list[Mismatch], list[str], int]:
    """compare_state's bitwise mismatches less what peft does on purpose (the module docstring), and notes
    saying what was let through, and how many export tensors were found under another name; a dtype mismatch that
    is no exact upcast gets its max abs diff in float64."""
    out, notes, upcast, extra, converted, missing = [], [], [], [], [], []
    for m in compare_state(a, b, EXPORTED, RESAVED):
        if m.kind == "dtype" and _upcast(a[m.key], b[m.key]):
            upcast.append(m.key)
        elif m.kind == "extra":
            extra.append(m.key)
        elif m.kind == "missing" and moved and _EXPERT.search(m.key):
            converted.append(m.key)
        elif m.kind == "missing":
            missing.append(m)
        else:
            if m.kind == "dtype" and a[m.key].shape == b[m.key].shape:
                m.max_abs_diff = max_abs_diff(a[m.key], b[m.key])
            out.append(m)
    renamed = _renamed([m.key for m in missing], extra, a, b)
    out += [m for m in missing if m.key not in renamed]
    extra = [k for k in extra if k not in renamed.values()]
    if renamed:
        first = next(iter(renamed.items()))
        notes.append(f"{len(renamed)} tensor(s) re-saved under another name with the same values (the module names "
                     f"transformers gives the loaded model), e.g. {first[0]} -> {first[1]}")
    if upcast:
        dt = sorted({f"{a[k].dtype} -> {b[k].dtype}" for k in upcast})
        notes.append(f"{len(upcast)} tensor(s) re-saved upcast ({', '.join(dt)}: peft's from_pretrained autocast_adapter_dtype), "
                     "values exact")
    if converted:
        notes.append(f"{len(converted)} per-expert tensor(s) re-saved in peft's merged-expert layout (target_parameters), "
                     f"not by name, e.g. {converted[0]}: judged by the logits")
    if extra:
        notes.append(f"{len(extra)} tensor(s) only in the re-save, e.g. {extra[0]}: judged by the logits")
    return out, notes, len(renamed)


def resave_check(exported: Path, resaved: Path, first: torch.Tensor | None, again: torch.Tensor | None) -> Check:
    """peft-resave over the Bridge's export `exported` and peft's re-save `resaved` of it (directories), with
    the first load's logits `first` and those of a fresh load of the re-save `again`."""
    problems: list[str] = []
    a, b = _tensors(exported, problems), _tensors(resaved, problems)
    ca, cb = _config(exported, problems), _config(resaved, problems)
    if not a and not b:
        problems.append(f"nothing to judge: no adapter tensor in either {ADAPTER_WEIGHTS} ({EXPORTED}, {RESAVED})")
    moved = moved_experts(cb) and not moved_experts(ca)
    tensors, notes, renamed = _tensor_mismatches(a, b, moved)
    config = config_mismatches(ca, cb, moved) if ca is not None and cb is not None else []
    logits = None
    if first is None or again is None:
        problems.append("no logits to compare (" + ", ".join(n for n, t in (("first load", first), ("re-saved load", again)) if t is None) + ")")
    else:
        logits = logits_mismatch(first, again)
    mismatches = tensors + config + ([logits] if logits else [])
    worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None and not math.isnan(m.max_abs_diff)), default=0.0)
    compared = f"{len(set(a) | set(b))} tensor(s) compared ({len(a)} exported, {len(b)} re-saved)"
    if problems or mismatches:
        parts = list(problems)
        if tensors:
            kinds = ", ".join(f"{k} {sum(m.kind == k for m in tensors)}" for k in sorted({m.kind for m in tensors}))
            diffs = [m.max_abs_diff for m in tensors if m.max_abs_diff is not None]
            parts.append(f"{len(tensors)} of {compared} differ ({kinds}" + (f"; max abs diff {max(diffs):.3g}" if diffs else "") + ")")
        elif a or b:
            parts.append(f"{compared}, all bitwise equal")
        parts += [str(m) for m in config]
        if first is not None and again is not None:
            parts.append(f"{logits}" if logits else f"logits of a fresh load of the re-save {tuple(first.shape)} torch.equal the first load's")
        if tensors:
            parts.append("tensors: " + "; ".join(map(str, tensors[:SHOWN])) + (f"; and {len(tensors) - SHOWN} more" if len(tensors) > SHOWN else ""))
        return Check(NAME, "failed", "; ".join(parts + notes), worst, BITWISE, mismatches)
    same = len(set(a) & set(b)) + renamed
    if not same:  # nothing of the export compared: the logits alone would be a weaker check than the one named
        return Check(NAME, "failed", f"no export tensor found in the re-save, by name or by value ({compared}): nothing of the "
                     "export was compared", None, BITWISE)
    how = "bitwise equal" if all(a[k].dtype == b[k].dtype for k in set(a) & set(b)) else "found with exactly their values"
    return Check(NAME, "passed", f"peft save_pretrained of the loaded adapter: the export's {same} tensor(s) {how}, adapter_config {'/'.join(CONFIG_FIELDS)} equal, a fresh load's logits "
                 f"{tuple(first.shape)} torch.equal the first load's" + "".join(f"; {n}" for n in notes), 0.0, BITWISE)
