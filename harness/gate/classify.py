"""Whose fault is a red candidate case: the candidate's, or the harness's own limits?

A gate over a release the harness was not written against sees errors of three kinds, and the
verdict must tell them apart (a candidate is never blamed for what the harness cannot drive):

- **api-break** (fails the gate): the candidate removed or renamed an API *users* call, one of
  the public entry points in `PUBLIC_APIS` (AutoBridge, `save_hf_adapter`,
  `dist_checkpointing.save`, `get_megatron_optimizer`, ...). Whoever bumps will hit it too.
- **not-evaluated** (a coverage hole, counted per case kind, never failing): the error says an
  API is missing in a package whose version is the same on both sides (that package cannot be
  the culprit: the harness's own call is wrong for the new neighbour), or an internal API the
  harness's driver reaches for and this release does not have, or such a lookup where the environment
  pairs a Megatron-Bridge with a Megatron-Core line it was not built against (not a valid release
  set; an error raised inside Bridge or Core on such a pair stays red, the pair named).
- everything else stays what compare found (regression, new-refusal, ...).

Pure functions over results.json documents: the versions come from each document's own
`versions` table, the pairing from harness.gate.releases (stdlib only).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable

from harness.core.result import api_missing_parts

#: The upstream entry points users call (issue 18 item 3): a candidate that loses one breaks users.
PUBLIC_APIS = frozenset({
    # Megatron-Bridge
    "AutoBridge", "from_hf_pretrained", "to_megatron_provider", "provide_distributed_model", "to_megatron_model",
    "save_hf_pretrained", "save_hf_weights", "export_hf_weights", "load_hf_weights", "save_hf_adapter",
    "export_adapter_weights", "export_adapter_ckpt", "save_checkpoint", "load_checkpoint",
    # Megatron-Core
    "dist_checkpointing", "save", "load", "load_plain_tensors", "sharded_state_dict", "load_state_dict",
    "get_megatron_optimizer", "DistributedDataParallel", "DistributedDataParallelConfig", "OptimizerConfig",
    "GPTModel", "TransformerConfig", "initialize_model_parallel", "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec", "OptimizerParamScheduler", "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper", "CheckpointingException", "StrictHandling",
    # verl
    "MegatronCheckpointManager",
    # peft / transformers
    "PeftModel", "LoraConfig", "get_peft_model", "AutoModelForCausalLM", "from_pretrained", "save_pretrained",
})
_MISSING = re.compile(r"has no attribute '(\w+)'|cannot import name '(\w+)'|No module named '([\w.]+)'")


def missing_name(text: str) -> str | None:
    """The attribute, name or module an import/attribute error says is missing (its last part)."""
    m = _MISSING.search(text)
    if not m:
        return None
    return next(g for g in m.groups() if g).rsplit(".", 1)[-1]


def _pair_problem(versions: dict[str, Any]) -> str | None:
    bridge, core = versions.get("megatron-bridge"), versions.get("megatron-core")
    if not bridge or not core:
        return None
    from harness.gate.releases import pairing_problem

    return pairing_problem(str(bridge), str(core))


def cause(case: dict[str, Any], base_versions: dict[str, Any], cand_versions: dict[str, Any]) -> tuple[str, str] | None:
    """('api-break' | 'not-evaluated', why) for a candidate case in error or not-applicable (an error in a
    release that lacks an API the case needs), or None (compare's call stands)."""
    if case.get("status") not in ("error", "not-applicable"):
        return None
    parts = api_missing_parts(case.get("error") or case.get("not_applicable_reason"))
    if parts and _uses_bridge(case) and (problem := _pair_problem(cand_versions)):
        # only the harness's own lookup is excused by the pair: an error raised inside Bridge or Core
        # on this pair is what whoever installs it hits (reclassify names the pair on that regression)
        return "not-evaluated", f"not a valid release set: {problem}"
    if parts:
        package, version, what = parts
        if base_versions.get(package) == cand_versions.get(package) and base_versions.get(package) is not None:
            return ("not-evaluated", f"it fails in {package} {version}, the same version on both sides (the environment "
                    f"around the candidate, or the harness's call), so not the candidate: {what}")
        name = missing_name(what)
        if name in PUBLIC_APIS:
            return "api-break", f"{package} {version} does not offer {name}, a public API users call: {what}"
        return ("not-evaluated", f"the harness has no driver for {package} {version}: it reaches for "
                f"{name or 'an internal API'} that this release does not offer ({what})")
    return None


_BRIDGE_BACKENDS = ("bridge_hf", "bridge_peft", "bridge_training")


def _uses_bridge(case: dict[str, Any]) -> bool:
    """Whether a case ran Megatron-Bridge (a Bridge backend, an HF model Bridge builds, or a Bridge frame
    in its error): only such a case is blamed on a Bridge/Core pair that is no release set; a Core-only
    case beside it is judged as any other."""
    text = f"{case.get('error') or ''}\n{case.get('not_applicable_reason') or ''}"
    return ("megatron/bridge" in text or "megatron.bridge" in text or case.get("backend") in _BRIDGE_BACKENDS
            or str(case.get("model") or "").startswith("hf-"))


def versions_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A results document's versions table plus every package of its environment's pip freeze (so a
    package the table does not list, pyarrow beside an old numpy, is known unchanged or moved)."""
    from harness.gate.metadata import normalize

    out: dict[str, Any] = {}
    for line in (doc.get("environment") or {}).get("pip_freeze") or []:
        name, sep, version = str(line).partition("==")
        if sep:
            out[normalize(name)] = version.strip()
    out.update(doc.get("versions") or {})
    return out


def reclassify(findings: Iterable[Any], base: dict[str, Any], cand: dict[str, Any]) -> list[Any]:
    """compare's findings with the candidate's own errors sorted into api-break / not-evaluated; a
    regression in a Bridge case on a Bridge/Core pair that is no release set says so."""
    bv, cv = versions_of(base), versions_of(cand)
    cases = {r["id"]: r for r in cand.get("results") or []}
    problem = _pair_problem(cv)
    out = []
    for f in findings:
        c = cases.get(f.case)
        found = cause(c, bv, cv) if c is not None and f.kind in ("regression", "new-refusal") else None
        if found:
            f = replace(f, kind=found[0], detail=f"{f.base} -> {f.candidate}: {found[1]}")
        elif problem and c is not None and f.failing and _uses_bridge(c):
            f = replace(f, detail=f"{f.detail} (note: not a valid release set, {problem}; whoever installs this pair hits it)")
        out.append(f)
    return out


def case_kind(case_id: str) -> str:
    """`reshard-weights[...]` -> `reshard-weights`: the unit 'could not evaluate' is counted in."""
    return case_id.split("[", 1)[0]
