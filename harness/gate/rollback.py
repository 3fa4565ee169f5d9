"""A rollback's refusal: an older stack reading files a newer one wrote may refuse them, with a named
exception raised in its own loader; a crash (an AttributeError or KeyError inside the loader) is no
refusal, and the verdict names the frame that raised it."""

from __future__ import annotations

import re
import traceback

from harness.core.result import Check
from harness.judge.checks import refusal_check
from harness.run.world import WorldError, WorldTimeout, exception_of

_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\s*$')


def last_frame(traceback_text: str) -> str:
    """`file:line in function: source line` of the innermost frame of a Python traceback ("" when
    it names none): where a crash was raised."""
    lines = traceback_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME_LINE.match(lines[i])
        if m:
            path, line, fn = m.groups()
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME_LINE.match(lines[i + 1]) else ""
            return f"{path}:{line} in {fn}" + (f": {code}" if code and not code.startswith(("^", "~")) else "")
    return ""


def refusal_of(exc_type: str | None, message: str, traceback_text: str, refusals: tuple[str, ...], change: str) -> Check | None:
    """A rollback's verdict on a load that raised `exc_type`: one of `refusals` passes as a clean
    refusal; anything else fails, naming the traceback's last frame. None when no Python exception
    was raised (a rank that died, or hung): not a refusal, an error."""
    if not exc_type:
        return None
    return refusal_check(exc_type, message, refusals, change, "an older stack refuses files a newer one wrote",
                         frame=last_frame(traceback_text))


def rollback_refusal(exc: Exception, refusals: tuple[str, ...], change: str) -> Check | None:
    """`refusal_of` for what a corpus load raised: a world's failure by its failing rank's
    exception and traceback, anything raised here (reading the writer's files) by its own."""
    if isinstance(exc, WorldError) and not isinstance(exc, WorldTimeout):
        tb = exc.rank_traceback or ""
        return refusal_of(*exception_of(tb), tb, refusals, change)
    return None if isinstance(exc, WorldTimeout) else refusal_of(type(exc).__name__, str(exc), traceback.format_exc(), refusals, change)
