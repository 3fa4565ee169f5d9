"""What a case run produced: the record that reports, the CLI and the pytest plugin all read."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from harness.core.parity import BITWISE, Mismatch, Tolerance

#: Case statuses, in the order reports list them. `not-run`: the machine lacks what the case
#: requires (harness.core.requires); its reason is in `not_run_reason`. `not-applicable`: the release
#: under test lacks an API the case needs (a package this environment moved from the project's pins);
#: its reason, the API_MISSING line, is in `not_applicable_reason`. Neither is ever counted green.
STATUSES = ("passed", "failed", "error", "xfailed", "not-run", "not-applicable")
#: Statuses a run counts as green.
GREEN = ("passed", "xfailed")
#: Statuses that showed nothing either way (coverage holes with a reason): neither green nor failing.
HOLES = ("not-run", "not-applicable")
#: How an error says the harness could not drive an upstream API in this release (a coverage hole):
#: "API not available in <package> <version>: <what>" (harness.orchestration.runner.api_unavailable)
API_MISSING = "API not available in "
#: the note an xfailed case carries when it met its defect in the form declared for an installed
#: release (matrix known_on; harness.judge.status): the reports show it apart from the plain xfails
KNOWN_FORM = "the named defect, in the form it is known on "
_API_LINE = re.compile(rf"^{API_MISSING}(\S+) (\S+): (.*)$", re.M)


def api_missing_line(error: str | None) -> str | None:
    """The API_MISSING line of a result's error, if it has one."""
    return next((ln.strip() for ln in (error or "").splitlines() if ln.startswith(API_MISSING)), None)


def api_missing_parts(error: str | None) -> tuple[str, str, str] | None:
    """(package, version, what) of the API_MISSING line in `error`, if it has one."""
    m = _API_LINE.search(error or "")
    return (m[1], m[2], m[3]) if m else None


def missing_api(module: str, what: str) -> AttributeError:
    """What a driver raises when it finds (by signature or attribute) that this release lacks what the
    case asks of `module`: an AttributeError in the form api_unavailable names with package and version."""
    return AttributeError(f"module '{module}' has no attribute '{what}'")


class CheckStop(Exception):
    """A check that fails where the case cannot go on (the next upstream call would deadlock or write
    garbage): the case is `failed` on check `name` (harness.judge.status.errored reads it from the
    rank's traceback), never an `error`, so an expected failure can name the check."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name, self.detail = name, detail


def shows_diff(name: str, tolerance: Any) -> bool:
    """Checks whose largest difference the summaries show: logits, and any with a named tolerance
    (not bitwise/exact), i.e. how close a case ran to its tolerance. `tolerance`: a Tolerance or
    its results.json form (structured, or the string older results hold)."""
    return "logits" in name or Tolerance.from_json(tolerance).toleranced


@dataclass
class Check:
    """One assertion of a case: passed, failed, or not run with the reason why (never silently)."""

    name: str
    status: str  # passed | failed | not-run
    detail: str = ""
    max_abs_diff: float | None = None
    tolerance: Tolerance = BITWISE
    mismatches: list[Mismatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.tolerance, Tolerance):  # a string here is what structured tolerances replaced
            raise TypeError(f"check {self.name}: tolerance must be a harness.core.parity.Tolerance, got {self.tolerance!r}")

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass
class CaseResult:
    id: str
    case: str
    model: str
    backend: str
    source: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)
    status: str = "error"
    checks: list[Check] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds, per phase
    error: str | None = None
    xfail_reason: str | None = None
    not_run_reason: str | None = None
    not_applicable_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    compat_shims: list[str] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    backend_options: dict[str, Any] = field(default_factory=dict)  # the backend's options (its strategy)
    #: what the backend recorded it ran, per world phase and rank (harness.backends.record_event)
    backend_events: dict[str, Any] = field(default_factory=dict)
    #: the run's stored source worlds this case wrote or reused (harness.run.reuse.SourceUse, as dicts)
    reuse: list[dict[str, Any]] = field(default_factory=list)
    #: where and when it ran when cases were packed onto a node's GPUs (harness.core.schedule.Placement.to_json)
    placement: dict[str, Any] | None = None
    #: the case's non-empty log files (rank and parent output; harness.run.ranklog), when it kept any
    logs: list[str] = field(default_factory=list)

    @property
    def hole_reason(self) -> str | None:
        """Why a `not-run` or `not-applicable` case showed nothing (None for any other status)."""
        return {"not-run": self.not_run_reason, "not-applicable": self.not_applicable_reason}.get(self.status)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for c in self.checks for m in c.mismatches]

    def to_dict(self) -> dict[str, Any]:
        """The results.json record; mismatches sit under the check that found them (once), each
        check's tolerance structured (Tolerance.to_json: kind, atol, rtol, why, label)."""
        doc = asdict(self)
        for c, d in zip(self.checks, doc["checks"]):
            d["tolerance"] = c.tolerance.to_json()
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "CaseResult":
        """A results.json record read back (to_dict's inverse), so reports drawn from records (the
        JUnit of merged shards) say what the run that wrote them said. Fields this version does not
        know are left out (the record itself stays in results.json); a missing required one raises
        TypeError naming it."""
        checks = [Check(**{**_known(Check, c), "tolerance": Tolerance.from_json(c.get("tolerance")),
                           "mismatches": [Mismatch(**_known(Mismatch, m)) for m in c.get("mismatches") or []]})
                  for c in doc.get("checks") or []]
        return cls(**{**_known(cls, doc), "checks": checks})

    def failure_text(self) -> str:
        lines = [f"{self.id}: {self.status}"]
        if self.error:
            lines.append(self.error.rstrip())
        lines.extend(n for n in self.notes if n.startswith("failed, but"))
        for c in self.failed_checks:
            lines.append(f"check {c.name} failed ({c.tolerance}): {c.detail}")
            lines.extend(f"  {m}" for m in c.mismatches[:10])
            if len(c.mismatches) > 10:
                lines.append(f"  ... and {len(c.mismatches) - 10} more")
        if self.logs:  # one case's directory (harness.run.ranklog)
            lines.append(f"logs in {os.path.dirname(self.logs[0])}: {', '.join(os.path.basename(p) for p in self.logs)}")
        return "\n".join(lines)


def _known(cls: type, doc: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in doc.items() if k in names}


@dataclass
class WorldRecord:
    """What a case's worlds recorded while it ran (harness.run.envelope.RunEnv writes it): per-phase
    seconds, memory per phase and rank, backend events per phase and rank, the shims any rank
    applied, the source-store uses and their notes. The sources that judge the case read it
    (CheckSource); the case's envelope hands it to the result once, at the end (`into`)."""

    phases: dict[str, float] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    backend_events: dict[str, Any] = field(default_factory=dict)
    compat_shims: list[str] = field(default_factory=list)
    reuse: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def into(self, result: CaseResult) -> None:
        """Add this record to `result` (seconds of a phase both hold are summed)."""
        for phase, s in self.phases.items():
            result.phases[phase] = round(result.phases.get(phase, 0.0) + s, 3)
        for own, theirs in ((self.memory, result.memory), (self.backend_events, result.backend_events)):
            for phase, ranks in own.items():
                theirs.setdefault(phase, {}).update(ranks)
        result.compat_shims += [s for s in self.compat_shims if s not in result.compat_shims]
        result.reuse += self.reuse
        result.notes += self.notes


@runtime_checkable
class CheckSource(Protocol):
    """Something besides the case's own judge that judges a case, from what its worlds recorded:
    each backend the case drove (what its saves and loads ran), the matrix entry's memory budgets,
    the run's source store. The case's envelope (harness.orchestration.runner.case_envelope) asks
    each once; `after_error`: whether it still judges a case whose body raised."""

    after_error: bool

    def checks_of(self, record: WorldRecord) -> list[Check]:
        """The checks this source adds (none when it has nothing to judge)."""
        ...
