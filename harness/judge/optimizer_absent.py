"""Judging a training load asked for optimizer state that the checkpoint does not hold
(NVIDIA-NeMo/Megatron-Bridge #5706, docs/user-reports.md): a torch_dist checkpoint saved with
save_optim false, resumed with load_optim true.

The expected outcome is a clear refusal: the load raises, and its error names the optimizer state it
could not find. A load that completes has put fresh (or decoy) optimizer state under a resumed job:
the run goes on with Adam's moments and step reset, which moves the trajectory silently. A load that
dies on a bare KeyError('optimizer') inside the loader (the report's traceback) is a crash, not a
refusal: the user learns neither what is missing nor what to do."""

from __future__ import annotations

from harness.core.parity import NOT_COMPARED
from harness.core.result import Check

OPTIMIZER_ABSENT = "optimizer-absent"
#: exceptions a loader raises by accident, not to refuse (as harness.judge.checks.refusal_check reads them)
CRASHES = ("KeyError", "AttributeError", "TypeError", "IndexError", "AssertionError", "UnboundLocalError", "NameError")


def optimizer_absent_check(exc_type: str | None, message: str, change: str, frame: str = "", fresh: str = "") -> Check:
    """`exc_type` None: the load completed (`fresh`: what the job's optimizer held after it, e.g.
    "0 Adam states"). Passes only for a refusal through a non-crash exception whose message names the
    optimizer state."""
    first = (message.splitlines() or [""])[0][:240]
    where = f", raised at {frame}" if frame else ""
    if exc_type is None:
        return Check(OPTIMIZER_ABSENT, "failed",
                     f"the load across {change} completed although the checkpoint holds no optimizer state (saved with save_optim "
                     f"false) and the job asked for it (load_optim true): training goes on from fresh optimizer state"
                     + (f" ({fresh})" if fresh else ""), tolerance=NOT_COMPARED)
    if exc_type in CRASHES:
        return Check(OPTIMIZER_ABSENT, "failed",
                     f"the load across {change} crashed with {exc_type}: {first!r}{where} instead of refusing with an error that "
                     f"says the checkpoint holds no optimizer state", tolerance=NOT_COMPARED)
    if "optim" not in message.lower():
        return Check(OPTIMIZER_ABSENT, "failed", f"the load across {change} refused with {exc_type}: {first!r}{where}, "
                     f"which does not name the missing optimizer state", tolerance=NOT_COMPARED)
    return Check(OPTIMIZER_ABSENT, "passed", f"refused across {change}: {exc_type}: {first}", tolerance=NOT_COMPARED)
