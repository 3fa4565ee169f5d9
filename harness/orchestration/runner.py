"""Runs cases: matrix -> case -> world -> backend -> result. Owns status, timing and scratch dirs."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from harness.backends import ref_of
from harness.core.memory import MiB, PhaseMemory
from harness.core.parity import BUDGET
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.judge.status import api_unavailable, apply_expected_failure, errored, settle
from harness.report.results import moved_from_pins
from harness.run import ranklog
from harness.run.envelope import RunEnv
from harness.run.reuse import SourceStore
from harness.run.world import WorldError, exception_of

#: A world's wall-clock limit where no matrix entry gives one (the golden corpus; explore passes its own).
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class RunOptions:
    dist_backend: str = "auto"
    workdir: Path | None = None  # parent of the per-case scratch dirs; a fresh temp dir if None
    keep: bool = False  # keep checkpoints and scratch dirs for inspection
    launcher: str = "mp"
    torchrun_template: str | None = None
    start_method: str | None = None  # None/"auto": fork for gloo, spawn for NCCL (harness.run.world.choose_start_method)
    rank_hooks: tuple[str, ...] = ()  # "module:function" run in every rank (fault injection, plugins)
    #: each world's limit in runs without a matrix entry (golden make/check, explore); a matrix
    #: entry's own `timeout_s` wins in run_case
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: save once, load many (harness.run.reuse): a source world shared by several cases runs once per run
    reuse: bool = True
    #: the run's source store; run_cases makes one (under `workdir`) when None and `reuse`
    sources: Path | None = None
    #: each case's rank and parent output goes to log_dir/<case id>/ (harness.run.ranklog), named in
    #: its result; None: rank output to the world's scratch dir, quoted on failure, the parent's left alone
    log_dir: Path | None = None


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
        by = f" (measured by {m['measured_by']}, whose source world this case reused)" if m.get("measured_by") else ""
        checks.append(Check(name, "failed" if violation else "passed", (violation or f"peak RSS delta {delta:.1f} MiB") + by, tolerance=BUDGET))
    return checks


def strategy_checks(spec: CaseSpec, result: CaseResult, driven: list | None = None) -> list[Check]:
    """Each backend's `strategy` check (its options asked what every save and load ran), if its
    options ask anything, or the checks a backend reads from what its saves and loads recorded;
    `driven`: the backends the case drove (Case.backends, configured; default the spec's). A check
    name two backends both record is kept once, the first backend's."""
    from harness.backends import get_backend

    out: list[Check] = []
    for backend in driven or [get_backend(ref_of(spec))]:
        check = backend.strategy_check(result.backend_events)
        found = list(check) if isinstance(check, (list, tuple)) else [check] if check is not None else []
        out += [c for c in found if all(c.name != o.name for o in out)]
    return out


def apply_xfail(spec: CaseSpec, result: CaseResult) -> None:
    """Strict expected failure of a matrix entry (harness.judge.status.apply_expected_failure)."""
    apply_expected_failure(spec.xfail, result)


def error_text(exc: Exception, tb: str | None = None) -> str:
    """What a result's `error` says: a world's failure as the launcher reported it (the failing
    rank's traceback), anything else as `Type: message` plus `tb` when given; both led by the
    "API not available in <package> <version>" line when an upstream API moved."""
    if isinstance(exc, WorldError):
        api = api_unavailable(*exception_of(exc.rank_traceback or ""), exc.rank_traceback or "")
        return f"{api}\n{exc}" if api else str(exc)
    api = api_unavailable(type(exc).__name__, str(exc), tb or "")
    return f"{api + chr(10) if api else ''}{type(exc).__name__}: {exc}" + (f"\n{tb}" if tb else "")


_VALIDATE = object()  # not_run_reason's `opts` default: validate the spec here


def not_run_reason(spec: CaseSpec, options: RunOptions, opts: Any = _VALIDATE) -> str | None:
    """Why this machine cannot run `spec` (harness.core.requires: the spec's requirements, what its
    options imply, plus NCCL when the run forces it), or None when it can. `opts`: the options
    `case.validate(spec)` returned (run_case validates once and passes them); without them the spec
    is validated here, and an invalid one raises what validation raises (KeyError, ValueError)."""
    from cases import get_case
    from harness.backends import get_backend
    from harness.core.requires import unmet

    case = get_case(spec.case)
    if opts is _VALIDATE:
        opts = case.validate(spec)
    needs = spec.requires + (("nccl",) if options.dist_backend == "nccl" else ())
    needs += tuple(case.machine_requirements(opts))  # a spec built in code gets what its options imply, as the loader adds
    reasons = unmet(needs, max(spec.source.world_size, spec.target.world_size), options.dist_backend)
    # a package the backend's options need (e.g. mcore_dist async_save nvrx: nvidia-resiliency-ext)
    backend_reason = get_backend(ref_of(spec)).unavailable()
    return "; ".join(reasons + ([backend_reason] if backend_reason else [])) or None


@contextmanager
def case_envelope(result: CaseResult, options: RunOptions, timeout_s: float | None = None) -> Iterator[RunEnv]:
    """The one envelope of every way a case runs (run_case, golden make and check, explore).

    Yields the RunEnv of a fresh scratch directory (under `options.workdir`, named after the case)
    with `options`' dist backend, launcher and rank hooks, each world limited to `timeout_s`
    (`options.timeout_s` when None), sharing the run's source store when `options.sources` is set,
    `options.reuse` holds and no rank hook may damage what a world writes; every case that used the store
    gets its `source-unchanged` checks. An exception raised inside (any but an interrupt or exit) is
    not raised further: harness.judge.status decides the status, from `error_text` when the body
    raised (the "API not available in <package> <version>" line first when the harness's own code
    reached for a missing upstream API, then the failing rank's traceback or this process's), else
    from the checks.
    The total time goes into result.phases["total"]; the scratch directory is removed unless
    `options.keep` (a note then says where it is). With `options.log_dir`, the case's rank output
    and this process's (judging in-process) go to its log directory, named in `result.logs`."""
    parent = Path(options.workdir) if options.workdir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_case_dirname(result.id)[:80]}-", dir=parent))
    quiet = ExitStack()  # closed last, in `finally`: what the case printed until then is in its log
    logs = quiet.enter_context(ranklog.case_logs(options.log_dir, result.id, result.logs))
    env = RunEnv(
        case_dir=scratch, dist_backend=options.dist_backend, timeout_s=options.timeout_s if timeout_s is None else timeout_s,
        launcher=options.launcher, torchrun_template=options.torchrun_template, start_method=options.start_method,
        hooks=tuple(options.rank_hooks), log_dir=logs,
        store=SourceStore(options.sources) if options.reuse and options.sources and not options.rank_hooks else None,
    )
    start = time.perf_counter()
    try:
        try:
            yield env
        finally:  # also after an error: a loader that wrote into a source must not hand it to the next case
            result.checks.extend(env.source_checks())
        settle(result)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise  # the user's or the interpreter's stop: never a case result
    except BaseException as exc:  # noqa: BLE001 - a rank's or the harness's error is reported, not raised: the
        # matrix goes on; torch's CheckpointException is a BaseException, and it must not end the run
        errored(result, error_text(exc, traceback.format_exc()), moved_from_pins())
    finally:
        result.phases["total"] = round(time.perf_counter() - start, 3)
        if options.keep:
            result.notes.append(f"scratch kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)  # our own mkdtemp, nothing else
        quiet.close()


def run_case(spec: CaseSpec, options: RunOptions | None = None) -> CaseResult:
    from cases import get_case
    from harness.backends import get_backend
    from harness.core.zoo import get_model
    from harness.run.preload import warm

    options = options or RunOptions()
    result = CaseResult(
        id=spec.id, case=spec.case, model=spec.model, backend=spec.backend,
        source=spec.source.id, target=spec.target.id, options=spec.opts, xfail_reason=spec.xfail.reason if spec.xfail else None,
        notes=list(spec.notes), backend_options=spec.backend_opts,
    )
    try:  # once: a spec built in code (not from a matrix) gets the loader's checks; requirements and run share the options
        case = get_case(spec.case)
        opts = case.validate(spec)
    except (KeyError, ValueError) as exc:  # an unknown case, model or backend, or what the case refuses: nothing ran
        result.status, result.error = "error", error_text(exc, traceback.format_exc())
        result.phases["total"] = 0.0
        apply_xfail(spec, result)
        return result
    reason = not_run_reason(spec, options, opts)
    if reason:  # decided before any world starts: nothing of the case ran
        result.status, result.not_run_reason = "not-run", reason
        result.phases["total"] = 0.0
        return result
    with case_envelope(result, options, spec.timeout_s) as env:
        driven = [get_backend(r) for r in case.backends(spec, opts)]
        # idempotent; forked ranks inherit the imports
        warm(bridge=get_model(spec.model).kind == "hf", modules=tuple(m for b in driven for m in b.preload))
        result.notes += [n for b in driven for n in b.notes()]
        case.run(spec, opts, env, result)
        result.checks.extend(strategy_checks(spec, result, driven))
        result.checks.extend(budget_checks(spec, result))
    apply_xfail(spec, result)
    return result


def run_cases(
    specs: Iterable[CaseSpec], options: RunOptions | None = None, on_result: Callable[[CaseResult], None] | None = None,
    jobs: int = 1, gpus_per_node: int | None = None, durations: dict[str, float] | None = None,
) -> list[CaseResult]:
    """Every case, in matrix order in the returned list; `on_result` as each finishes. With `jobs` > 1
    the cases are spread over that many worker processes forked from this one (after the imports
    every case needs, so workers start warm): a case is still a world per phase, run the same way,
    and most worlds here are 1-2 ranks that leave a 2-core machine half idle between phases.
    With `gpus_per_node`, cases are packed onto that many GPUs, each on its own set, largest first
    (harness.orchestration.packing; `durations` from a previous run order them)."""
    specs = list(specs)
    with source_store(options or RunOptions()) as options:
        if gpus_per_node:
            if jobs > 1:
                raise ValueError("--gpus-per-node packs cases by their GPU need: it cannot take --jobs too")
            from harness.orchestration.packing import run_packed

            _preload(specs)
            return run_packed(specs, options, run_case, gpus_per_node, durations, on_result)
        if jobs > 1 and len(specs) > 1:
            return _run_parallel(specs, options, on_result, jobs)
        results = []
        for spec in specs:
            r = run_case(spec, options)
            results.append(r)
            if on_result:
                on_result(r)
        return results


@contextmanager
def source_store(options: RunOptions) -> Iterator[RunOptions]:
    """`options` with a fresh source store for this run (under `workdir`, removed at the end
    unless `keep`) when reuse is on and none is given; a given store is the caller's to remove."""
    if not options.reuse or options.sources is not None:
        yield options
        return
    parent = Path(options.workdir) if options.workdir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckpt-harness-sources-", dir=parent))
    try:
        yield replace(options, sources=root)
    finally:
        if not options.keep:
            shutil.rmtree(root, ignore_errors=True)  # our own mkdtemp


def writers_first(specs: list[CaseSpec]) -> list[int]:
    """The order parallel workers take `specs` in: the first case of each likely source
    (harness.orchestration.shard.source_group) in matrix order, then the rest,
    so two workers rarely wait on one store entry (the store's real key decides what is shared)."""
    from harness.orchestration.shard import source_group

    seen: set[str] = set()
    first, rest = [], []
    for i, spec in enumerate(specs):
        group = source_group(spec)
        (rest if group in seen else first).append(i)
        seen.add(group)
    return first + rest


def _preload(specs: list[CaseSpec]) -> None:
    """What run_case would import, once here for every worker forked from this process."""
    import threading

    from harness.backends import get_backend
    from harness.core.zoo import get_model
    from harness.run.preload import warm

    if threading.active_count() == 1:  # what run_case would import, once here, for every worker
        bridge, preload = False, set()
        for spec in specs:
            try:
                bridge |= get_model(spec.model).kind == "hf"
                preload.update(get_backend(ref_of(spec)).preload)
            except (KeyError, ValueError):
                pass  # run_case reports the invalid spec
        try:
            warm(bridge=bridge, modules=tuple(sorted(preload)))
        except Exception as exc:  # noqa: BLE001 - preloading only saves time: each case imports again inside its
            # own envelope, so one package that does not import ends the cases that need it as `error`, not the run
            print(f"ckpt-harness: preloading failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                  "the cases that need it will error", file=sys.stderr)
            warm(bridge=False)


def _worker_threads(n: int) -> None:
    """A worker's share of the cores for its in-process judging: torch's default (every core) in
    each of `jobs` workers spun OpenMP threads against the other workers' ranks; on 2 cores with
    --jobs 2 a compare phase took 0.2-4.6 s instead of 0.06 s (docs/measurements.md)."""
    import torch

    torch.set_num_threads(n)


def _run_parallel(specs: list[CaseSpec], options: RunOptions, on_result, jobs: int) -> list[CaseResult]:
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed

    if options.dist_backend == "nccl" or options.launcher == "torchrun":
        raise ValueError("jobs > 1 runs several worlds at once on this machine: gloo worlds from the mp launcher only "
                         f"(got dist backend {options.dist_backend!r}, launcher {options.launcher!r}); on GPUs "
                         "pack cases with --gpus-per-node instead")
    _preload(specs)
    results: dict[int, CaseResult] = {}
    # fork when this process has one thread (the CLI): the workers inherit the imports above. A caller
    # with threads (pytest-xdist's execnet, an embedding program) gets forkserver workers instead, which
    # import for themselves: a fork taken while another thread holds a lock (stdout, logging) hangs
    # the worker on it. A worker is not a daemon, so its cases can start ranks.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method),
                             initializer=_worker_threads, initargs=(threads,)) as pool:
        futures = {pool.submit(run_case, specs[i], options): i for i in writers_first(specs)}
        for done in as_completed(futures):
            i = futures[done]
            results[i] = done.result()
            if on_result:
                on_result(results[i])
    return [results[i] for i in range(len(specs))]
