"""A person's judgement of a campaign's survivors (harness/gate/mutant_triage.yaml), applied to its records.

Issue 41 asks every survivor to be classified: a blind spot (a case is added until it is killed),
equivalent (one line why) or out of the harness's reach on CPU (what would reach it). Only the last two
are written down here; a blind spot stays a plain survivor until a campaign kills it.

- `equivalent`: the record becomes outcome `equivalent` with `judged` (the reason): left out of both
  rates, as a mutant whose bytecode equals the original's is.
- `out-of-reach`: the record stays `survived` (the rate counts it) and carries `reach`.

A key is a mutant id (`module:line:operator:digest`), or a function (`module:Qualname`) for `out-of-reach`
only: every mutant of a function whose body runs only on hardware the CPU harness lacks (fp8 export,
Transformer-Engine's grouped linears, a CUDA buffer). A not-covered mutant under such an entry stays
not covered (the coverage rate counts it) and carries `reach`: the report then tells the blind spots a CPU
case could close from those that need a GPU, and gives the coverage of the rest beside the rate.

A judgement never overrides a run: an entry for a mutant that was killed, or that the campaign did not
sample, changes nothing, and the report names the killed ones (a wrong judgement).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).with_name("mutant_triage.yaml")
CLASSES = ("equivalent", "out-of-reach")


def load(path: Path | None) -> dict[str, dict[str, str]]:
    """The entries of `path` (None: no triage), each checked: a clear error names the file and the key."""
    import yaml

    if path is None:
        return {}
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"triage file {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"triage file {path}: expected a mapping of mutant id -> {{class, why}}, got {type(doc).__name__}")
    for key, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"class", "why"}:
            raise ValueError(f"triage file {path}: {key}: give exactly `class` and `why`")
        if is_function_key(str(key)) and entry["class"] != "out-of-reach":
            raise ValueError(f"triage file {path}: {key}: a function-wide entry can only be out-of-reach (judge each mutant "
                             "equivalent by its own id)")
        if entry["class"] not in CLASSES:
            raise ValueError(f"triage file {path}: {key}: class {entry['class']!r} is not one of {', '.join(CLASSES)}")
        if not str(entry["why"]).strip():
            raise ValueError(f"triage file {path}: {key}: `why` is empty: say in one line why")
    return doc


def is_function_key(key: str) -> bool:
    """`module:Qualname` (a function-wide entry) rather than a mutant id `module:line:operator:digest`."""
    parts = key.split(":")
    return len(parts) == 2 and not parts[1].isdigit()


def apply(records: list[dict[str, Any]], triage: dict[str, dict[str, str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records with each surviving or not-covered mutant's judgement applied, and the ids judged
    equivalent that a case killed (the judgement is wrong; the kill stands)."""
    out, wrong = [], []
    for r in records:
        entry = triage.get(r["id"]) or triage.get(f"{r['module']}:{r.get('function') or '<module>'}")
        if entry is None:
            out.append(r)
        elif r["outcome"] == "not-covered":
            out.append({**r, "reach": entry["why"]} if entry["class"] == "out-of-reach" else r)
        elif r["outcome"] == "survived":
            out.append({**r, "outcome": "equivalent", "judged": entry["why"]} if entry["class"] == "equivalent"
                       else {**r, "reach": entry["why"]})
        else:
            if entry["class"] == "equivalent" and r["outcome"].startswith("killed"):
                wrong.append(r["id"])
            out.append(r)
    return out, wrong
