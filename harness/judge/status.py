"""Why a case is what it is: the one place a case's status is decided.

Every way a case runs (a matrix, the golden corpus, explore, bench) ends here, in `conclude`: the
checks the case's other sources contributed (its backends, memory budgets, the source store) join
the case's own, then `settle` after the case's body (its checks decide), or `errored` when the body
raised (an upstream API the harness's own code reached for and this release lacks is
`not-applicable`; anything else is `error`), then `apply_expected_failure` (a named upstream
defect met exactly is `xfailed`).

The rules, each a guard against a verdict that says more than was seen:
- passed needs at least one passed check that judges the case itself (a memory budget or the
  source store's own `source-unchanged` check beside not-run ones proves nothing of the format);
- a case whose judging checks were all not-run is `not-run`, with their reasons; a case that
  recorded no judging check at all is an `error` of the harness (it judged nothing);
- `not-applicable` only when the raising frame of an ImportError/AttributeError is the harness's
  own (harness/, cases/) and the missing name lies in a package this environment moved from the
  pins; the same lookup failing inside an upstream package's frames is that package's own error.
"""

from __future__ import annotations

import re
import sys
from typing import Iterable

from harness.core.frames import OWN_PACKAGES, raising_frame
from harness.core.result import API_MISSING, KNOWN_FORM, CaseResult, Check, api_missing_line, api_missing_parts
from harness.core.spec import XFail

#: Checks that say something about the run, not about the format under test: never enough to pass.
AUXILIARY = ("memory-budget:", "source-unchanged")


def judges(name: str) -> bool:
    """Whether a check of this name judges the case itself (not an AUXILIARY one)."""
    return not name.startswith(AUXILIARY)


def judging(checks: Iterable[Check]) -> list[Check]:
    """The checks that judge the case itself (AUXILIARY ones left out)."""
    return [c for c in checks if judges(c.name)]


def settle(result: CaseResult) -> None:
    """The status of a case whose body returned: failed on any failed check; passed when a judging
    check passed; not-run when every judging check was not run (their reasons joined); an error when
    it recorded no judging check. A body that set `result.error` keeps `error`."""
    if result.error is not None:
        result.status = "error"
        return
    if result.failed_checks:
        result.status = "failed"
        return
    judged = judging(result.checks)
    if any(c.status == "passed" for c in judged):
        result.status = "passed"
    elif judged:
        result.status = "not-run"
        reasons = dict.fromkeys(f"{c.name}: {c.detail}" if c.detail else c.name for c in judged)
        result.not_run_reason = "every check was not run: " + "; ".join(reasons)
    else:
        result.status = "error"
        names = ", ".join(c.name for c in result.checks) or "none"
        result.error = (f"the case recorded no check that judges it (checks: {names}): nothing was compared, "
                        "so it cannot pass; a harness defect")


_CHECK_STOP = re.compile(r"^(?:[\w.]+\.)?CheckStop: ([\w:@.-]+): (.*)$", re.M)


def errored(result: CaseResult, error: str, moved: set[str]) -> None:
    """The status of a case whose body raised (`error`: error_text's text, the API_MISSING line first
    when the harness's own frame reached for a missing API): `failed` on the named check when the body
    stopped on a failed check (harness.core.result.CheckStop), `not-applicable` when that API's
    package is one this environment moved from the project's pins (`moved`), else `error`."""
    if stops := _CHECK_STOP.findall(error):
        name, detail = stops[-1]
        result.checks.append(Check(name, "failed", f"{detail} (the case stopped here)"))
        result.status = "failed"
        return
    result.status, result.error = "error", error
    if (api := api_missing_parts(error)) and api[0] in moved:
        # the release under test lacks what the case needs: not-applicable to it, the traceback kept in `error`
        result.status = "not-applicable"
        result.not_applicable_reason = f"{api_missing_line(error)} (this environment moved {api[0]} from the project's pins)"


def apply_expected_failure(xfail: XFail | None, result: CaseResult) -> None:
    """Strict expected failure: the named failure becomes `xfailed`, another failure stays
    `failed` (with why), and a pass becomes `failed` as XPASS(strict). A `not-run` case showed
    nothing either way and stays `not-run`; a `not-applicable` one stays so unless the named defect is
    that missing API itself."""
    if xfail is None or result.status == "not-run":
        return
    if result.status in ("failed", "error", "not-applicable"):
        unexpected = xfail.explains(result)
        if unexpected and (result.status == "not-applicable" or (result.status == "error" and api_missing_line(result.error))):
            # the case could not run here (and the defect is not that API's absence): neither met nor missed, a hole
            result.notes.append(f"expected failure not judged: the case could not run here ({xfail.reason})")
            return
        if unexpected:
            result.notes.append(f"failed, but not as expected: {unexpected} ({xfail.reason})")
            result.status = "failed"
        else:
            if release := xfail.met_as(result):  # judged on the failure itself, before it is xfailed
                result.notes.append(f"{KNOWN_FORM}{release} (matrix known_on)")
            result.status = "xfailed"
        return
    result.status = "failed"
    result.error = (
        f"XPASS(strict): expected to fail ({xfail.reason}) but passed; "
        "if upstream fixed it, remove the xfail from the matrix"
    )


# Top-level module path -> the distribution a user would bump.
_UPSTREAM = (("megatron.bridge", "megatron-bridge"), ("megatron", "megatron-core"),  # megatron.core, megatron.training
             ("transformers", "transformers"), ("peft", "peft"), ("torch", "torch"))
_API_ERRORS = ("ImportError", "ModuleNotFoundError", "AttributeError")
_NAMED_MODULE = re.compile(r"No module named '([\w.]+)'|cannot import name '\w+' from '([\w.]+)'|module '([\w.]+)' has no attribute")
# An attribute missing on a builtin value (None where a dict was expected) is bad data, not a moved API.
_DATA_OBJECT = re.compile(r"^'(NoneType|dict|list|tuple|str|bytes|int|float|bool)' object has no attribute")
_OBJECT = re.compile(r"^(?:type object )?'(\w+)' (?:object )?has no attribute")


def _project(module: str) -> str | None:
    """The upstream project (a `_UPSTREAM` prefix) a dotted module belongs to, if any."""
    return next((p for p, _ in _UPSTREAM if module == p or module.startswith(p + ".")), None)


def _class_module(class_name: str) -> str | None:
    """The module of the upstream class named `class_name` among the modules imported here: an
    "'AutoBridge' object has no attribute" names no module. Only a class the holding module's own
    project defines counts: megatron modules re-export `torch.Tensor`, and an attribute missing on a
    tensor the candidate returned is never torch's missing API (torch did not move)."""
    for name, mod in list(sys.modules.items()):
        project = _project(name) if mod is not None else None
        if project is None or project == "torch":
            continue
        cls = vars(mod).get(class_name)  # never getattr: a lazy module (transformers) would import on it
        if isinstance(cls, type) and cls.__name__ == class_name and _project(cls.__module__) == project:
            return cls.__module__
    return None


def api_unavailable(exc_type: str, message: str, traceback_text: str) -> str | None:
    """'API not available in <package> <version>: <what> (looked up at <frame>)' when the harness's
    own code (the traceback's raising frame is in harness/ or cases/) imported or looked up a name an
    upstream package does not offer, else None. The same lookup raised inside an upstream package's
    frames is that package's own defect (a candidate whose code reads an attribute it no longer
    defines), never a missing API; a traceback that names no frame cannot say whose lookup it was."""
    from importlib import metadata

    if exc_type not in _API_ERRORS or (exc_type == "AttributeError" and _DATA_OBJECT.match(message)):
        return None
    frame = raising_frame(traceback_text)
    if frame is None or not frame.own:
        return None
    named = _NAMED_MODULE.search(message)
    obj = _OBJECT.match(message)
    module = next((g for g in named.groups() if g), "") if named else (obj and _class_module(obj[1])) or ""
    dist = dict(_UPSTREAM).get(_project(module) or "")
    top = module.split(".")[0]
    if dist is None and top and top not in OWN_PACKAGES:  # never an upstream's (verl ships a top-level `tests`)  # any other installed package (pyarrow under an old datasets)
        dist = next(iter(metadata.packages_distributions().get(top, [])), None)
    if dist is None:
        return None
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    first = message.splitlines()[0] if message else ""
    return f"{API_MISSING}{dist} {version}: {exc_type}: {first} (looked up at {frame})"


def conclude(result: CaseResult, contributed: Iterable[Check], xfail: XFail | None = None,
             error: str | None = None, moved: set[str] | None = None) -> None:
    """The case's verdict, decided once: `contributed` (the checks of its other sources, in order;
    a name two sources both record, e.g. two backends' `strategy`, is kept once, the first) joins
    its checks, then its status (`settle`, or `errored` from `error`'s text with `moved`, the
    packages this environment moved from the pins), then the matrix entry's expected failure."""
    seen: set[str] = set()
    for check in contributed:
        if check.name not in seen:
            result.checks.append(check)
        seen.add(check.name)
    if error is None:
        settle(result)
    else:
        errored(result, error, moved or set())
    apply_expected_failure(xfail, result)
