"""peft-adapter-io's judges for adapter tensors whose shapes are not the model's: the two ways users meet
them in PEFT's save_and_load.

  invalid-warning   (save_from zero3 / fsdp) LoRA tensors left as an ungathered ZeRO-3 / FSDP rank holds
                    them (empty or a flat 1-D shard) make a file that looks valid; save_pretrained must
                    say so: one PeftWarning giving their number, the first three by file key with the
                    shape each was saved with, and "(+N more)" for the rest
  mismatch-fresh    (load_base unresized, ignore_mismatched_sizes) the file tensors whose shape is not the
                    loaded model's are left out of the load: each such parameter equals the one of a model
                    built the same way that loaded nothing, bitwise
  mismatch-warning  the load's ignore_mismatched_sizes warning lists exactly those tensors with the file's and
                    the model's shape; any missing-key warning names only them

Which tensors must be named comes from what the case did (the tensors it replaced; the parameters whose
shape differs between the saving and the loading model and whose values the file holds), never from PEFT.
"""

from __future__ import annotations

import re

import torch

from harness.core.parity import EXACT, compare_tensors
from harness.core.result import Check

#: peft 0.21.2's _validate_lora_adapter_state_dict warning (utils/save_and_load.py:84-95)
INVALID = re.compile(r"Adapter '(?P<adapter>[^']*)': (?P<count>\d+) LoRA tensor\(s\) have invalid shape: "
                     r"(?P<preview>.*?)(?: \(\+(?P<more>\d+) more\))?\. A 1-D")
PREVIEW = re.compile(r"([\w.]+):(\([\d, ]*\))")
#: a line of peft's ignore_mismatched_sizes warning (utils/save_and_load.py:660-665)
MISMATCHED = re.compile(r"- ([\w.]+): found shape torch\.Size\(\[([\d, ]*)\]\) in the checkpoint and "
                        r"torch\.Size\(\[([\d, ]*)\]\) in the model")
KEYS = re.compile(r"base_model\.model\.[\w.]+")
SHOWN = 6


def file_key(name: str, adapter: str) -> str:
    """The key PEFT's file gives a parameter: its name without the adapter's segment."""
    return ".".join(s for s in name.split(".") if s != adapter)


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.strip("()[] ").split(",") if d.strip())


def invalid_warning_check(warned: list[str], ungathered: dict[str, tuple[int, ...]], adapter: str) -> Check:
    """invalid-warning: the save's warnings against `ungathered` (parameter name -> the shape it was saved with)."""
    name = "invalid-warning"
    if not ungathered:
        return Check(name, "failed", "nothing to compare: no LoRA tensor was left ungathered")
    want = {file_key(n, adapter): s for n, s in ungathered.items()}
    found = [m for w in warned if w.startswith("PeftWarning") and (m := INVALID.search(w))]
    if len(found) != 1:
        return Check(name, "failed", f"{len(want)} LoRA tensors saved empty or 1-D, and the save gave {len(found)} "
                     f"invalid-shape warning(s), not one: {[w[:200] for w in warned[:3]]}")
    m = found[0]
    preview = PREVIEW.findall(m["preview"])
    problems = [] if m["adapter"] == adapter else [f"names adapter {m['adapter']!r}, not {adapter!r}"]
    if int(m["count"]) != len(want):
        problems.append(f"says {m['count']} invalid tensor(s), {len(want)} were saved empty or 1-D")
    if len(preview) != min(3, len(want)) or len({k for k, _ in preview}) != len(preview):
        problems.append(f"names {len(preview)} distinct tensor(s), not {min(3, len(want))}: {m['preview'][:200]!r}")
    for key, shape in preview:
        if key not in want:
            problems.append(f"names {key}, not one of the ungathered tensors")
        elif _shape(shape) != want[key]:
            problems.append(f"gives {key} shape {shape}, it was saved as {want[key]}")
    more = int(m["more"]) if m["more"] else 0
    if more != max(0, len(want) - 3):
        problems.append(f"says {more} more beyond those it names (no suffix: none); {len(want)} in all make it "
                        f"'(+{max(0, len(want) - 3)} more)'")
    if problems:
        return Check(name, "failed", "; ".join(problems[:SHOWN]))
    return Check(name, "passed", f"the save warned of {len(want)} invalid LoRA tensor(s), named {len(preview)} of them "
                 f"with the shapes they were saved with" + (f" and '(+{more} more)'" if more else ""))


def names_check(check: Check, message: str, ungathered: dict[str, tuple[int, ...]]) -> Check:
    """A passed refusal of an ungathered adapter fails unless its message names every broken tensor."""
    missed = sorted(n for n in ungathered if n not in message)
    if check.status == "passed" and missed:
        check.status = "failed"
        check.detail += f"; the message does not name {len(missed)} of the {len(ungathered)} broken tensors, e.g. {missed[0]}"
    elif check.status == "passed":
        check.detail += f"; it names each of the {len(ungathered)} broken tensors"
    return check


def mismatched(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor],
               file: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The parameters ignore_mismatched_sizes must leave out (name -> (file shape, model shape)): those
    whose shape differs between the saving and the loading model and whose values the file holds."""
    out = {}
    for n in sorted(set(saved) & set(loaded)):
        s, t = saved[n], loaded[n]
        if s.shape != t.shape and any(v.shape == s.shape and torch.equal(v, s) for v in file.values()):
            out[n] = (tuple(s.shape), tuple(t.shape))
    return out


def fresh_check(want: dict[str, tuple], loaded: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> Check:
    """mismatch-fresh: each of `want` in the loaded model equals the never-loaded model's, bitwise."""
    name = "mismatch-fresh"
    if not want:
        return Check(name, "failed", "nothing to compare: no file tensor has a shape the loaded model does not", tolerance=EXACT)
    problems = []
    for n in sorted(want):
        if n not in loaded or n not in fresh:
            problems.append(f"{n}: not in the {'loaded' if n not in loaded else 'never-loaded'} model")
        elif (bad := compare_tensors(n, fresh[n], loaded[n], "never loaded", "loaded", EXACT)) is not None:
            problems.append(str(bad))
    if problems:
        return Check(name, "failed", f"{len(problems)} of {len(want)} mismatched tensors: " + "; ".join(problems[:SHOWN]),
                     tolerance=EXACT)
    return Check(name, "passed", f"{len(want)} mismatched tensor(s) left at the fresh model's values, bitwise: "
                 + ", ".join(sorted(want)), 0.0, EXACT)


def mismatch_warning_check(warned: list[str], want: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> Check:
    """mismatch-warning: the load's ignore_mismatched_sizes warning against `want`; other missing /
    unexpected-key warnings may name only those tensors."""
    name = "mismatch-warning"
    if not want:
        return Check(name, "failed", "nothing to compare: no mismatched tensor expected")
    lists = [w for w in warned if "ignore_mismatched_sizes" in w]
    if len(lists) != 1:
        return Check(name, "failed", f"{len(lists)} ignore_mismatched_sizes warning(s), not one, for {len(want)} "
                     f"mismatched tensor(s): {sorted(want)[:3]}")
    got = {k: (_shape(a), _shape(b)) for k, a, b in MISMATCHED.findall(lists[0])}
    problems = [f"{k}: mismatched, not listed" for k in sorted(set(want) - set(got))]
    problems += [f"{k}: listed, not mismatched" for k in sorted(set(got) - set(want))]
    problems += [f"{k}: listed as {got[k][0]} in the file, {got[k][1]} in the model; they are {want[k][0]}, {want[k][1]}"
                 for k in sorted(set(got) & set(want)) if got[k] != want[k]]
    others = [w for w in warned if w is not lists[0] and re.search(r"missing|unexpected", w, re.IGNORECASE)]
    problems += [f"another warning names {k}: {w[:160]}" for w in others for k in KEYS.findall(w) if k not in want]
    if problems:
        return Check(name, "failed", f"{len(problems)} problem(s): " + "; ".join(problems[:SHOWN]))
    return Check(name, "passed", f"the load's warning lists exactly the {len(want)} mismatched tensor(s) with both shapes"
                 + (f"; {len(others)} missing-key warning(s) name only them" if others else ""))
