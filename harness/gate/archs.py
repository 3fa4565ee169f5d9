"""The HF architectures an installed Megatron-Bridge registers, and what a bump did to them.

`probe` runs inside the environment under test (`run --probe-imports` writes its answer into
results.json as `bridge_architectures`, beside `import_problems`): Megatron-Bridge's own registry,
`AutoBridge.list_supported_models()` (the dispatch table `get_model_bridge._exact_types` where that
classmethod is missing). The rest is pure over results.json documents:

- `diff(base, cand)`: an architecture the candidate no longer registers is a breaking change
  (`architecture-removed`, failing: every user converting that model breaks); a new one is listed
  (`architecture-added`) with whether the harness runs it (a zoo HF model of that family);
- the registry missing on a side, or empty on the baseline, is an evidence problem (`problem`):
  an empty registry on both sides is not "no change", the gate cannot tell what was removed.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from harness.gate.compare import Finding

KEY = "bridge_architectures"
#: what HF names after the family in a model class (LlamaForCausalLM, Qwen2VLForConditionalGeneration)
_SUFFIX = re.compile(r"(For[A-Z][A-Za-z]*|LMHeadModel|Model)$")


def probe() -> dict[str, Any]:
    """{architectures: sorted names | None, source, error} of the Megatron-Bridge installed here;
    never raises (a Bridge that does not import is `import_problems`' finding, recorded here as error)."""
    import traceback

    try:
        from harness.compat.cuda import guard_megatron_import
        from harness.compat.te import import_megatron_bridge

        guard_megatron_import()
        import_megatron_bridge()
        import megatron.bridge.models  # noqa: F401  (every model bridge registers on import)
        from megatron.bridge.models.conversion import model_bridge

        try:
            from megatron.bridge import AutoBridge

            names, source = list(AutoBridge.list_supported_models()), "AutoBridge.list_supported_models()"
        except (ImportError, AttributeError):
            table = getattr(model_bridge.get_model_bridge, "_exact_types", {})
            names = [t if isinstance(t, str) else getattr(t, "__name__", str(t)) for t in table]
            source = "megatron.bridge.models.conversion.model_bridge.get_model_bridge._exact_types"
        return {"architectures": sorted(set(map(str, names))), "source": source, "error": None}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - whatever the Bridge raised is the record
        return {"architectures": None, "source": None, "error": traceback.format_exc()[-2000:]}


def registry(doc: dict[str, Any] | None) -> list[str] | None:
    """The architectures a results.json recorded, or None when it recorded none (no probe, or it failed)."""
    rec = (doc or {}).get(KEY)
    names = rec.get("architectures") if isinstance(rec, dict) else None
    return sorted(names) if isinstance(names, list) else None


def family(architecture: str) -> str:
    """LlamaForCausalLM -> llama, Qwen3MoeForCausalLM -> qwen3moe: the key a zoo model's arch matches."""
    return re.sub(r"[^a-z0-9]", "", _SUFFIX.sub("", architecture).lower())


def zoo_models(architecture: str, zoo: dict[str, Any] | None = None) -> list[str]:
    """The zoo's HF models of this architecture (an explicit `architecture` field, else the family of
    the model's HF `arch`, e.g. hf-llama for LlamaForCausalLM)."""
    if zoo is None:
        from harness.core.zoo import ZOO as zoo
    out = []
    for name, m in zoo.items():
        if getattr(m, "kind", None) != "hf":
            continue
        named = getattr(m, "architecture", None) or getattr(m, "hf_architecture", None)
        if named == architecture or (not named and re.sub(r"[^a-z0-9]", "", str(getattr(m, "arch", "")).lower()) == family(architecture)):
            out.append(name)
    return sorted(out)


def cases_of(doc: dict[str, Any] | None, architecture: str, models: Callable[[str], list[str]] = zoo_models) -> list[dict]:
    """The case records of `doc` whose model is a zoo model of `architecture`."""
    names = set(models(architecture))
    return [r for r in (doc or {}).get("results") or [] if r.get("model") in names]


def problem(base: dict[str, Any] | None, cand: dict[str, Any] | None) -> str | None:
    """Why the gate cannot say which architectures the candidate removed (None when it can)."""
    b, c = registry(base), registry(cand)
    why = []
    for side, doc, names in (("baseline", base, b), ("candidate", cand, c)):
        if names is None:
            err = ((doc or {}).get(KEY) or {}).get("error") if isinstance((doc or {}).get(KEY), dict) else None
            why.append(f"the {side} run recorded no Megatron-Bridge architecture registry"
                       + (f" (the probe failed: {err.strip().splitlines()[-1]})" if err else
                          " (no `bridge_architectures` in its results.json: run with --probe-imports)"))
    if b == [] and c == []:
        why.append("both registries are empty: that is no evidence of 'no change' (the Bridge registered nothing, "
                   "or the probe read the wrong table)")
    elif b == [] and c:
        why.append("the baseline registry is empty: the gate cannot tell which architectures the candidate removed")
    return "; ".join(why) or None


def diff(base: dict[str, Any] | None, cand: dict[str, Any] | None,
         models: Callable[[str], list[str]] = zoo_models) -> list[Finding]:
    """architecture-removed (failing) for each name the baseline registers and the candidate does not;
    architecture-added (listed) for each new one, with whether the harness runs it."""
    b, c = registry(base), registry(cand)
    if b is None or c is None:
        return []
    out = [Finding(f"architecture {a}", "architecture-removed", f"{a} is registered by the baseline's Megatron-Bridge "
                   f"and not by the candidate's: converting such a checkpoint (AutoBridge.from_hf_pretrained) breaks"
                   f"{_ran(base, a, models, 'baseline')}", "registered", "absent") for a in sorted(set(b) - set(c))]
    out += [Finding(f"architecture {a}", "architecture-added", f"{a} is new in the candidate's registry; "
                    f"{_runs(cand, a, models)}", "absent", "registered") for a in sorted(set(c) - set(b))]
    return out


def exit_code(code: int, why: str | None) -> int:
    """The gate's exit once the registry is read: a removal is already a failing finding (exit 1 in
    `code`); a gate that would say SAFE without a registry to compare says nothing (2) instead."""
    return 2 if code == 0 and why else code


def _ran(doc: dict[str, Any] | None, a: str, models: Callable[[str], list[str]], side: str) -> str:
    n = len(cases_of(doc, a, models))
    return f" ({n} case(s) of it ran on the {side})" if n else ""


def _runs(doc: dict[str, Any] | None, a: str, models: Callable[[str], list[str]]) -> str:
    zoo = models(a)
    if not zoo:
        return "the harness does not run it (no zoo model of its family)"
    n = len(cases_of(doc, a, models))
    return (f"the harness runs it ({', '.join(zoo)}; {n} case(s) in this gate)" if n else
            f"the zoo has {', '.join(zoo)}, which this selection did not run")


def _name(f: Finding) -> str:
    return f.case.removeprefix("architecture ")


def lines(findings: list[Finding], why: str | None, base: dict[str, Any] | None, cand: dict[str, Any] | None) -> list[str]:
    """The verdict's architecture lines (in its first lines): removals first, then additions, then
    what stopped the comparison."""
    removed = [f for f in findings if f.kind == "architecture-removed"]
    added = [f for f in findings if f.kind == "architecture-added"]
    b, c = registry(base), registry(cand)
    out = []
    if why:
        out.append(f"- **Architecture registry: no evidence**: {why}.")
    elif not removed and not added:
        out.append(f"- Architectures: the candidate's Megatron-Bridge registers the same {len(c or [])} HF "
                   "architecture(s) as the baseline's.")
    if removed:
        out.append(f"- **{len(removed)} architecture(s) removed** (breaking: the baseline's Bridge registers them, the "
                   f"candidate's does not): {', '.join(f'`{_name(f)}`' for f in removed)}.")
    if added:
        out.append(f"- {len(added)} architecture(s) added by the candidate: "
                   + "; ".join(f"`{_name(f)}` ({f.detail.split('; ', 1)[1]})" for f in added) + ".")
    if b is not None and c is not None and (removed or added):
        out.append(f"- Registries: baseline {len(b)}, candidate {len(c)} architecture(s).")
    return out
