"""Memory budgets of a matrix entry, judged against what the case's worlds measured."""

from __future__ import annotations

from typing import Iterable

from harness.core.memory import Budget, MiB, PhaseMemory
from harness.core.parity import BUDGET
from harness.core.result import Check, WorldRecord


class Budgets:
    """One check per budget (a harness.core.result.CheckSource): the phase's peak on that rank
    within the limit, failed when the case measured no such phase."""

    #: a body that raised measured its phases only partly: its budgets are not judged
    after_error = False

    def __init__(self, budgets: Iterable[Budget]) -> None:
        self.budgets = tuple(budgets)

    def checks_of(self, record: WorldRecord) -> list[Check]:
        out = []
        for b in self.budgets:
            m = record.memory.get(b.phase, {}).get(str(b.rank))
            name = f"memory-budget:{b.phase}@rank{b.rank}"
            if m is None:
                out.append(Check(name, "failed", f"the case measured no {b.phase!r} phase on rank {b.rank}"))
                continue
            fields = {k: v for k, v in m.items() if k in PhaseMemory.__dataclass_fields__}
            violation = b.violation(PhaseMemory(**fields), m.get("shard_bytes", 0))
            delta = m["peak_delta"] / MiB
            by = f" (measured by {m['measured_by']}, whose source world this case reused)" if m.get("measured_by") else ""
            out.append(Check(name, "failed" if violation else "passed", (violation or f"peak RSS delta {delta:.1f} MiB") + by,
                             tolerance=BUDGET))
        return out
