"""Helpers the schedulers share: the serial loop, the imports every forked worker inherits, the
writers-first order, a worker's share of the cores."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from harness.core.result import CaseResult
from harness.core.spec import CaseSpec


def bare(spec: Any, status: str, **fields: Any) -> CaseResult:
    """The result of a case that did not run through run_case (refused, or its worker or job died)."""
    return CaseResult(id=spec.id, case=spec.case, model=spec.model, backend=spec.backend, source=spec.source.id,
                      target=spec.target.id, options=spec.opts, status=status, notes=list(spec.notes),
                      xfail_reason=spec.xfail.reason if spec.xfail else None, phases={"total": 0.0}, **fields)


def serially(specs: Sequence[CaseSpec], options: Any, run_one, on_result=None) -> list[CaseResult]:
    """Each case in turn in this process."""
    results = []
    for spec in specs:
        r = run_one(spec, options)
        results.append(r)
        if on_result:
            on_result(r)
    return results


def writers_first(specs: Sequence[CaseSpec]) -> list[int]:
    """The order parallel workers take `specs` in: the first case of each likely source
    (schedulers._balance.source_group) in matrix order, then the rest,
    so two workers rarely wait on one store entry (the store's real key decides what is shared)."""
    from harness.orchestration.schedulers._balance import source_group

    seen: set[str] = set()
    first, rest = [], []
    for i, spec in enumerate(specs):
        group = source_group(spec)
        (rest if group in seen else first).append(i)
        seen.add(group)
    return first + rest


def preload(specs: Sequence[CaseSpec]) -> None:
    """What run_case would import, once here for every worker forked from this process."""
    import threading

    from harness.backends import get_backend, ref_of
    from harness.core.zoo import get_model
    from harness.run.preload import warm

    if threading.active_count() == 1:  # what run_case would import, once here, for every worker
        bridge, modules = False, set()
        for spec in specs:
            try:
                bridge |= get_model(spec.model).kind == "hf"
                modules.update(get_backend(ref_of(spec)).preload)
            except (KeyError, ValueError):
                pass  # run_case reports the invalid spec
        try:
            warm(bridge=bridge, modules=tuple(sorted(modules)))
        except Exception as exc:  # noqa: BLE001 - preloading only saves time: each case imports again inside its
            # own envelope, so one package that does not import ends the cases that need it as `error`, not the run
            print(f"ckpt-harness: preloading failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                  "the cases that need it will error", file=sys.stderr)
            warm(bridge=False)


def worker_threads(n: int) -> None:
    """A worker's share of the cores for its in-process judging: torch's default (every core) in
    each of `jobs` workers spun OpenMP threads against the other workers' ranks; on 2 cores with
    --jobs 2 a compare phase took 0.2-4.6 s instead of 0.06 s (docs/measurements.md)."""
    import torch

    torch.set_num_threads(n)
