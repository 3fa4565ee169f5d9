"""Runs cases: matrix -> case -> world -> backend -> result. Owns status, timing and scratch dirs."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from harness.case import RunEnv
from harness.matrix import CaseSpec
from harness.memory import MiB, PhaseMemory
from harness.result import CaseResult, Check
from harness.world import WorldError


@dataclass
class RunOptions:
    dist_backend: str = "auto"
    workdir: Path | None = None  # parent of the per-case scratch dirs; a fresh temp dir if None
    keep: bool = False  # keep checkpoints and scratch dirs for inspection
    launcher: str = "mp"
    torchrun_template: str | None = None


def _case_dirname(case_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in case_id)


def budget_checks(spec: CaseSpec, result: CaseResult) -> list[Check]:
    """One check per memory budget of the matrix entry, against what the case measured."""
    checks = []
    for b in spec.budgets:
        m = result.memory.get(b.phase, {}).get(str(b.rank))
        name = f"memory-budget:{b.phase}@rank{b.rank}"
        if m is None:
            checks.append(Check(name, "failed", f"the case measured no {b.phase!r} phase on rank {b.rank}"))
            continue
        fields = {k: v for k, v in m.items() if k in PhaseMemory.__dataclass_fields__}
        violation = b.violation(PhaseMemory(**fields), m.get("shard_bytes", 0))
        delta = m["peak_delta"] / MiB
        checks.append(Check(name, "failed" if violation else "passed", violation or f"peak RSS delta {delta:.1f} MiB", tolerance="budget"))
    return checks


def _check_base(name: str) -> str:
    return name.split("@")[0]


def _unexpected_failure(spec: CaseSpec, result: CaseResult) -> str:
    """Why a failure is not the one an xfail names ("" when it is): the text must match
    `xfail.match`; with `xfail.checks`, those checks (by name, `@topology` suffix ignored) must fail
    and no other may, so a known defect cannot hide a new one in the same case."""
    if spec.xfail_match and not re.search(spec.xfail_match, result.failure_text()):
        return f"no match for {spec.xfail_match!r}"
    if spec.xfail_checks:
        if result.status == "error":
            return f"the case errored instead of failing checks {list(spec.xfail_checks)}"
        failed = {c.name for c in result.checks if c.status == "failed"}
        allowed = set(spec.xfail_checks)
        extra = sorted(n for n in failed if n not in allowed and _check_base(n) not in allowed)
        if extra:
            return f"check(s) {extra} failed too, beyond the expected {list(spec.xfail_checks)}"
        if not any(n in allowed or _check_base(n) in allowed for n in failed):
            return f"none of the expected checks {list(spec.xfail_checks)} failed"
    return ""


def run_case(spec: CaseSpec, options: RunOptions | None = None) -> CaseResult:
    from cases import get_case
    from harness.models import preload

    from harness.hf_models import HF_ZOO

    preload(bridge=spec.model in HF_ZOO)  # idempotent; ranks fork from a parent that has the imports
    options = options or RunOptions()
    result = CaseResult(
        id=spec.id, case=spec.case, model=spec.model, backend=spec.backend,
        source=spec.source.id, target=spec.target.id, options=spec.opts, xfail_reason=spec.xfail,
    )
    parent = Path(options.workdir) if options.workdir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_case_dirname(spec.id)[:80]}-", dir=parent))
    env = RunEnv(
        case_dir=scratch, dist_backend=options.dist_backend, timeout_s=spec.timeout_s,
        launcher=options.launcher, torchrun_template=options.torchrun_template,
    )
    start = time.perf_counter()
    try:
        get_case(spec.case).run(spec, env, result)
        result.checks.extend(budget_checks(spec, result))
        result.status = "failed" if result.failed_checks else "passed"
    except WorldError as exc:
        result.status = "error"
        result.error = str(exc)
    except Exception as exc:  # a harness-side error is reported, not raised: the matrix goes on
        import traceback

        result.status = "error"
        result.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        result.phases["total"] = round(time.perf_counter() - start, 3)
        if options.keep:
            result.notes.append(f"scratch kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)  # our own mkdtemp, nothing else
    if spec.xfail:
        unexpected = _unexpected_failure(spec, result)
        if result.status in ("failed", "error") and unexpected:
            result.notes.append(f"failed, but not as expected: {unexpected} ({spec.xfail})")
            result.status = "failed"
        elif result.status in ("failed", "error"):
            result.status = "xfailed"
        else:
            result.status = "failed"
            result.error = (
                f"XPASS(strict): expected to fail ({spec.xfail}) but passed; "
                "if upstream fixed it, remove the xfail from the matrix"
            )
    return result


def run_cases(
    specs: Iterable[CaseSpec], options: RunOptions | None = None, on_result: Callable[[CaseResult], None] | None = None
) -> list[CaseResult]:
    results = []
    for spec in specs:
        r = run_case(spec, options)
        results.append(r)
        if on_result:
            on_result(r)
    return results
