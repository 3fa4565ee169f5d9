"""A rollback's refusal: an older stack reading files a newer one wrote may refuse them, with a named
exception raised in its own loader; a crash (an AttributeError or KeyError inside the loader) is no
refusal, and the verdict names the frame that raised it. The harness's own lookup of an API the older
release does not offer is neither: it could not drive that reader (a hole the verdict says first)."""

from __future__ import annotations

import traceback

from harness.core.frames import raising_frame
from harness.core.result import Check
from harness.judge.checks import refusal_check
from harness.judge.status import api_unavailable
from harness.run.world import WorldError, WorldTimeout, exception_of

def refusal_of(exc_type: str | None, message: str, traceback_text: str, refusals: tuple[str, ...], change: str) -> Check | None:
    """A rollback's verdict on a load that raised `exc_type`: one of `refusals` passes as a clean
    refusal; anything else fails, naming the frame that raised it (core.frames.raising_frame, the
    one traceback reader). None when no Python exception was raised (a rank that died, or hung), or the
    harness's own code looked up a name the older release lacks (status.api_unavailable: Bridge 0.4.2 has
    no load_fsdp_dtensor_checkpoint): not a refusal, an error, which the envelope reports with its
    "API not available" line (a coverage hole)."""
    if not exc_type or api_unavailable(exc_type, message, traceback_text):
        return None
    frame = raising_frame(traceback_text)
    return refusal_check(exc_type, message, refusals, change, "an older stack refuses files a newer one wrote",
                         frame=str(frame) if frame else "")


def rollback_refusal(exc: Exception, refusals: tuple[str, ...], change: str) -> Check | None:
    """`refusal_of` for what a corpus load raised: a world's failure by its failing rank's
    exception and traceback, anything raised here (reading the writer's files) by its own."""
    if isinstance(exc, WorldError) and not isinstance(exc, WorldTimeout):
        tb = exc.rank_traceback or ""
        return refusal_of(*exception_of(tb), tb, refusals, change)
    return None if isinstance(exc, WorldTimeout) else refusal_of(type(exc).__name__, str(exc), traceback.format_exc(), refusals, change)
