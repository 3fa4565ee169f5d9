"""A person's judgement of a campaign's survivors (harness/gate/mutant_triage.yaml), applied to its records.

Issue 41 asks every survivor to be classified: a blind spot (a case is added until it is killed),
equivalent (one line why) or out of the harness's reach on CPU (what would reach it). Only the last two
are written down here; a blind spot stays a plain survivor until a campaign kills it.

- `equivalent`: the record becomes outcome `equivalent` with `judged` (the reason): left out of both
  rates, as a mutant whose bytecode equals the original's is.
- `out-of-reach`: the record stays `survived` (the rate counts it) and carries `reach`.

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
        if entry["class"] not in CLASSES:
            raise ValueError(f"triage file {path}: {key}: class {entry['class']!r} is not one of {', '.join(CLASSES)}")
        if not str(entry["why"]).strip():
            raise ValueError(f"triage file {path}: {key}: `why` is empty: say in one line why")
    return doc


def apply(records: list[dict[str, Any]], triage: dict[str, dict[str, str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records with each surviving mutant's judgement applied, and the ids judged equivalent that a
    case killed (the judgement is wrong; the kill stands)."""
    out, wrong = [], []
    for r in records:
        entry = triage.get(r["id"])
        if entry is None:
            out.append(r)
        elif r["outcome"] == "survived":
            out.append({**r, "outcome": "equivalent", "judged": entry["why"]} if entry["class"] == "equivalent"
                       else {**r, "reach": entry["why"]})
        else:
            if entry["class"] == "equivalent" and r["outcome"].startswith("killed"):
                wrong.append(r["id"])
            out.append(r)
    return out, wrong
