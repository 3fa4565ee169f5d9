"""Which of a mutant's covering cases run, and in what order (issue 41's speed on a whole gate slice).

A mutant in megatron.core.dist_checkpointing.mapping is run by nearly every case of the gate's
selection: running all of them for each mutant is hours. Two things keep a campaign to a night:

- **stop at the first kill**: the cases go in batches (2, 4, 8, ...) and the next batch runs only
  while every case so far kept its outcome. A killed mutant costs a batch or two; only survivors pay
  for their whole list.
- **the likeliest killers first**: the covering cases go round-robin over (check, backend) kinds, so
  the first batch already asks the mutant different questions (weights and optimizer state, resume,
  HF export, adapters) instead of the same one at ten topologies. Within a kind the next case is the
  one that runs most of the mutant's file that few other cases run (`rarity`: each line it runs
  weighs one over the number of cases that run it): a module-level constant is "run" by every case
  that imports the module, but only the cases that reach its rare users can tell it changed (the
  follow-up campaign's integrity-manifest chunk size and strict-flag survivors sat behind ten cases
  that never hash a file nor load a foreign checkpoint). Then the case whose id brings the most
  words no case before it had (a model, a topology, an optimizer, a variant), the fastest among equals.
  Before all of that, one case per named defect: an xfailed case stops where its defect strikes
  (Bridge's GPT-OSS merged export raises in the source world, so its EP2 export at the target never
  runs) and tells only a mutant that changes that defect, which one case of it asks as well as five
  (c5's `ep_size <= 2` survivor sat behind five GPT-OSS cases of one defect; the passing EP2 exports it
  never ran kill it). So a case whose clean run did not pass and whose defect (xfail reason, or status)
  an earlier-ranked case already carries goes after every other case of its kind; the first of each
  defect stays in place (Lion's layer-wise xfail is what a mutant of optimizer_state_keys changes).

`--max-cases N` caps the list: a mutant that kept its outcome through N cases is recorded as
survived with the count of covering cases it never ran, never as killed; the kill rate can only be
under-stated by a cap, and mutate.md says how many survivors it touched.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

FIRST_BATCH = 2


def kind(case_id: str) -> tuple[str, str]:
    """(check, backend) of a case id such as reshard-weights[mcore_dist-gpt-gqa-tp2...->tp1...]."""
    check, _, rest = case_id.partition("[")
    return check, rest.split("-", 1)[0]


def words(case_id: str) -> frozenset[str]:
    """What a case id says beyond its kind: model, topologies, options (`-`, `->` and `_` apart)."""
    inside = case_id.partition("[")[2].rstrip("]")
    return frozenset(w for w in re.split(r"->|[-_]", inside) if w)


def rarity(by_line: dict[int, set[str]]) -> dict[str, float]:
    """{case: how much of a file it runs that few cases run}: the sum over the lines it runs of one over
    the number of contexts that run each (`by_line`: coverage_hook.lines' entry for the file)."""
    out: dict[str, float] = {}
    for contexts in by_line.values():
        for c in contexts:
            out[c] = out.get(c, 0.0) + 1.0 / len(contexts)
    return out


def order(cases: list[str], clean: dict[str, Any], rare: dict[str, float] | None = None) -> list[str]:
    """`cases` round-robin over their kinds (kinds by their rarest case, then their first case's order);
    from each kind in turn a case before another case of a defect already asked, then the highest
    `rare` score (rarity of the mutant's file; none: all equal), then the most words not seen in any
    case before it (the very first: the fastest), then the fastest by its clean run's seconds, then the
    earlier; deterministic for the same inputs."""
    seconds = {r["id"]: float((r.get("phases") or {}).get("total") or 0.0) for r in clean.get("results", [])}
    defect = {r["id"]: r.get("xfail_reason") or r.get("status") for r in clean.get("results", []) if r.get("status") != "passed"}
    at = {c: i for i, c in enumerate(cases)}
    kinds: dict[tuple[str, str], list[str]] = {}
    for c in cases:
        kinds.setdefault(kind(c), []).append(c)
    rare = rare or {}
    score = {c: round(rare.get(c, 0.0), 6) for c in cases}
    firsts: dict[str, str] = {}  # defect -> its case that asks first: the rarest, then the fastest, then the earlier
    for c in sorted((c for c in cases if c in defect), key=lambda c: (-score[c], seconds.get(c, 0.0), at[c])):
        firsts.setdefault(defect[c], c)
    repeat = {c for c in cases if c in defect and firsts[defect[c]] != c}
    queues = sorted(kinds.values(), key=lambda q: -max(score[c] for c in q))  # stable: ties keep first-case order
    said = {c: words(c) for c in cases}
    seen: set[str] = set()
    out: list[str] = []
    while any(queues):
        for q in queues:
            if q:
                best = min(q, key=lambda c: (c in repeat, -score[c], -len(said[c] - seen) if seen else 0,
                                             seconds.get(c, 0.0), at[c]))
                q.remove(best)
                seen |= said[best]
                out.append(best)
    return out


def batches(cases: list[str], first: int = FIRST_BATCH) -> Iterator[list[str]]:
    """`cases` in batches of first, 2*first, 4*first, ...: each a `run` of its own."""
    size, at = max(1, first), 0
    while at < len(cases):
        yield cases[at:at + size]
        at += size
        size *= 2
