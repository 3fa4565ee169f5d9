"""The gate's scale axis: `ckpt-harness plan` for a few production shapes, in each side's
environment, and a diff of what each side's Megatron-Core says a checkpoint of that shape holds.

The matrix's models are tiny; a candidate that renames a key, changes a global shape or dtype, or
chunks a tensor differently only at scale (expert axes over EP 8-32, 80-layer stacks over PP 16)
shows here even where the small cases agree. Each plan builds every distinct model-parallel
coordinate on the meta device under fake process groups (harness.plan), so it costs CPU seconds,
not memory.

- a key saved or asked for on one side only, or a key whose global shape or dtype differs: a
  failing finding (`regression`): a checkpoint one side writes at that shape is not what the other
  reads;
- the same keys, shapes and dtypes but other chunks (offsets, local shapes, replica ids): a
  warning (`layout-change`): DCP reshards across it, but who writes what changed;
- a plan that the baseline ran and the candidate could not: `regression`; neither side: `not-evaluated`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.gate.compare import Finding


@dataclass(frozen=True)
class ScalePlan:
    name: str
    model: str  # a harness/plan preset
    source: str
    target: str
    format: str = "fully_reshardable"

    def args(self, out: Path) -> list[str]:
        return ["plan", "--model", self.model, "--from", self.source, "--to", self.target, "--format", self.format, "--out", str(out)]


#: The shapes the gate plans by default: a 70B dense over PP 8 -> 16 (its layer stack split finer)
#: and a 235B MoE over EP 8 -> 16 (its expert axis re-chunked). ~1-2 min a side on 2 cores.
PLANS: tuple[ScalePlan, ...] = (
    ScalePlan("llama3-70b tp8pp8dp16->tp4pp16dp16", "llama3-70b", "tp8pp8dp16", "tp4pp16dp16"),
    ScalePlan("qwen3-235b-a22b tp2pp2dp32ep8->tp1pp2dp64ep16", "qwen3-235b-a22b", "tp2pp2dp32ep8", "tp1pp2dp64ep16"),
)


def load(path: Path) -> dict[str, Any] | None:
    """A side's plan.json, or None when the plan did not write one (it failed)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def diff(plan: ScalePlan, base: dict[str, Any] | None, cand: dict[str, Any] | None, base_log: str = "",
         cand_log: str = "") -> list[Finding]:
    """The findings of one production shape (pure over the two plan.json documents)."""
    case = f"scale {plan.name}"
    if base is None and cand is None:
        return [Finding(case, "not-evaluated", f"neither side could plan it (baseline: {base_log[-300:]!r})")]
    if cand is None:
        return [Finding(case, "regression", f"the candidate could not plan it where the baseline did: {cand_log[-500:]}")]
    if base is None:
        return [Finding(case, "fixed-upstream", f"the candidate plans it, the baseline could not: {base_log[-300:]}")]
    out: list[Finding] = []
    for side in ("save", "load"):
        b, c = (d.get("layout", {}).get(side) for d in (base, cand))
        if not b or not c:
            out.append(Finding(case, "not-evaluated", f"{side}: a side's plan.json has no layout (an older harness wrote it)"))
            continue
        gone, new = sorted(set(b) - set(c)), sorted(set(c) - set(b))
        changed = sorted(k for k in set(b) & set(c) if (b[k]["shape"], b[k]["dtype"]) != (c[k]["shape"], c[k]["dtype"]))
        chunks = sorted(k for k in set(b) & set(c) if k not in changed and b[k]["digest"] != c[k]["digest"])
        topo = (base.get(side) or {}).get("topology", side)
        if gone or new or changed:
            parts = [f"{len(gone)} key(s) only in the baseline's ({_few(gone)})" if gone else "",
                     f"{len(new)} only in the candidate's ({_few(new)})" if new else "",
                     f"{len(changed)} with another global shape or dtype ({_few(changed, b, c)})" if changed else ""]
            out.append(Finding(case, "regression", f"{side} at {topo}: " + "; ".join(p for p in parts if p),
                               base=len(b), candidate=len(c)))
        if chunks:
            out.append(Finding(case, "layout-change", f"{side} at {topo}: {len(chunks)} key(s) chunked otherwise "
                               f"(offsets, local shapes or replica ids; DCP reshards across it): {_few(chunks)}"))
    if base.get("verdict") == "VALID" and cand.get("verdict") != "VALID":
        out.append(Finding(case, "regression", f"the candidate's plan is {cand.get('verdict')} where the baseline's is VALID"))
    return out


def _few(keys: list[str], b: dict | None = None, c: dict | None = None, n: int = 3) -> str:
    if b is None or c is None:
        text = ", ".join(keys[:n])
    else:
        text = ", ".join(f"{k} {b[k]['shape']} {b[k]['dtype']} -> {c[k]['shape']} {c[k]['dtype']}" for k in keys[:n])
    return text + (f", ... {len(keys) - n} more" if len(keys) > n else "")
