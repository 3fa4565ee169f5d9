"""Judging an HF PEFT adapter as users load it (redai-studio/Relax #262, docs/user-reports.md): a
load that reports a missing or unexpected adapter key, and an adapter that loads as a no-op.

PEFT's PeftModel.from_pretrained accepts an adapter whose keys lack PEFT's `base_model.model.`
prefix with one UserWarning ("Found missing adapter keys") and leaves the adapter at its init:
with init_lora_weights true, every lora_B zero, so the model computes the base model's logits.
A warning can be filtered or logged away; the load result (missing_keys, unexpected_keys) cannot,
and neither can the loaded weights and logits. Pure functions of what the loader read; the loading
itself is cases/shared/peft.py's (peft_load_problems)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.core.parity import EXACT, Tolerance
from harness.core.result import Check

#: logits of the adapted model within this of the base model's: the adapter did nothing. A LoRA branch
#: whose lora_B is zero adds exact zeros (the logits are bitwise the base's); the harness's seeded
#: adapters move the logits by 1.3..3.4 (cases/shared/peft.py), a trained one by its training.
NOOP_LOGITS_TOLERANCE = Tolerance(atol=1e-6, rtol=0.0, why="adapted vs base logits: a no-op LoRA branch adds exact zeros")


@dataclass
class AdapterLoad:
    """What one user-style load of an adapter reported and left behind."""

    warnings: list[str] = field(default_factory=list)  # what PEFT warned about adapter keys
    missing: list[str] = field(default_factory=list)  # load_result.missing_keys (adapter keys only)
    unexpected: list[str] = field(default_factory=list)  # load_result.unexpected_keys
    loaded_lora_b: int = 0  # lora_B tensors of the loaded adapter
    loaded_lora_b_max: float = 0.0  # max |lora_B| over them
    saved_lora_b: int = 0  # lora_B tensors in the adapter's file
    saved_lora_b_max: float = 0.0  # max |lora_B| over the file's
    effect: float | None = None  # max |logits(adapted) - logits(base)|; None: not measured


def adapter_load_problems(r: AdapterLoad, tol: Tolerance = NOOP_LOGITS_TOLERANCE) -> list[str]:
    """Every problem of `r` ([] when none): each warning, missing key and unexpected key; every
    loaded lora_B zero (no-op adapter, whatever the file held); the adapted logits equal to the
    base model's within `tol` while the file's lora_B are not all zero (the load lost them)."""
    problems: list[str] = []  # the no-op findings first: a check's detail shows the first few
    if r.loaded_lora_b and r.loaded_lora_b_max == 0.0:
        problems.append(f"no-op adapter: all {r.loaded_lora_b} lora_B of the loaded adapter are zero "
                        f"(the file's max |lora_B| is {r.saved_lora_b_max:.3g})")
    elif not r.loaded_lora_b:
        problems.append("no-op adapter: the loaded model holds no lora_B")
    if r.effect is not None and r.effect <= tol.atol and r.saved_lora_b_max > 0.0:
        problems.append(f"no-op load: the adapted model's logits are within {r.effect:.2e} (<= {tol.atol:g}) of the base "
                        f"model's although the file's lora_B reach {r.saved_lora_b_max:.3g}")
    problems += [f"from_pretrained warned: {w}" for w in r.warnings]
    problems += [f"missing: {k}" for k in r.missing]
    problems += [f"unexpected: {k}" for k in r.unexpected]
    return problems


def peft_load_check(problems: list[str], ok: str = "no missing or unexpected keys; the adapter changes the logits") -> Check:
    """The peft-load check from `adapter_load_problems` (and whatever else the caller found)."""
    return Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or ok, tolerance=EXACT)
