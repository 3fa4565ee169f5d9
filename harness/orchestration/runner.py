"""Runs cases: matrix -> case -> world -> backend -> result. Owns status, timing and scratch dirs."""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from harness.backends import ref_of
from harness.core.result import CaseResult
from harness.core.spec import CaseSpec, XFail
from harness.faults import coverage_hook
from harness.judge.budgets import Budgets
from harness.judge.status import api_unavailable, apply_expected_failure, conclude
from harness.orchestration.schedulers import Scheduler, Settings
from harness.orchestration.schedulers import get as get_scheduler
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
    from harness.cases import get_case
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
def case_envelope(result: CaseResult, options: RunOptions, timeout_s: float | None = None,
                  xfail: XFail | None = None) -> Iterator[RunEnv]:
    """The one envelope of every way a case runs (run_case, golden make and check, explore).

    Yields the RunEnv of a fresh scratch directory (under `options.workdir`, named after the case)
    with `options`' dist backend, launcher and rank hooks, each world limited to `timeout_s`
    (`options.timeout_s` when None), sharing the run's source store when `options.sources` is set,
    `options.reuse` holds and no rank hook may damage what a world writes; every case that used the store
    gets its `source-unchanged` checks. An exception raised inside (any but an interrupt or exit) is
    not raised further. At the end each source the body put in `env.sources` (the case's backends,
    its budgets) and the store are asked for their checks once, and harness.judge.status.conclude
    decides the status, from `error_text` when the body raised (the "API not available in <package> <version>"
    line first when the harness's own code reached for a missing upstream API, then the failing
    rank's traceback or this process's), else from the checks; then `xfail` applies.
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
        hooks=tuple(options.rank_hooks), log_dir=logs, case_id=result.id,
        store=SourceStore(options.sources) if options.reuse and options.sources and not options.rank_hooks else None,
    )
    start = time.perf_counter()
    try:
        error = None
        try:
            yield env
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise  # the user's or the interpreter's stop: never a case result
        except BaseException as exc:  # noqa: BLE001 - a rank's or the harness's error is reported, not raised: the
            # matrix goes on; torch's CheckpointException is a BaseException, and it must not end the run
            error = error_text(exc, traceback.format_exc())
        # what the worlds recorded reaches the result once; each source judges it, once, here (the
        # store also after an error: a loader that wrote into a source must not hand it to the next case)
        env.record.into(result)
        contributed = [c for source in [*env.sources, env] if error is None or source.after_error for c in source.checks_of(env.record)]
        conclude(result, contributed, xfail, error, moved_from_pins() if error else None)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a source's own checks raised: the case errs, the run goes on
        conclude(result, [], xfail, error_text(exc, traceback.format_exc()), moved_from_pins())
    finally:
        result.phases["total"] = round(time.perf_counter() - start, 3)
        if options.keep:
            result.notes.append(f"scratch kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)  # our own mkdtemp, nothing else
        quiet.close()


def run_case(spec: CaseSpec, options: RunOptions | None = None) -> CaseResult:
    from harness.cases import get_case
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
        apply_expected_failure(spec.xfail, result)
        return result
    reason = not_run_reason(spec, options, opts)
    if reason:  # decided before any world starts: nothing of the case ran
        result.status, result.not_run_reason = "not-run", reason
        result.phases["total"] = 0.0
        return result
    coverage_hook.case(spec.id)  # a mutation campaign's instrumented run only: this case's lines from here
    with case_envelope(result, options, spec.timeout_s, spec.xfail) as env:
        driven = [get_backend(r) for r in case.backends(spec, opts)]
        env.sources += [*driven, Budgets(spec.budgets)]  # they judge the case when the envelope concludes
        # idempotent; forked ranks inherit the imports
        warm(bridge=get_model(spec.model).kind == "hf", modules=tuple(m for b in driven for m in b.preload))
        result.notes += [n for b in driven for n in b.notes()]
        case.run(spec, opts, env, result)
    return result


def run_cases(
    specs: Iterable[CaseSpec], options: RunOptions | None = None, on_result: Callable[[CaseResult], None] | None = None,
    jobs: int = 1, gpus_per_node: int | None = None, durations: dict[str, float] | None = None,
    scheduler: Scheduler | str | None = None,
) -> list[CaseResult]:
    """Every case the scheduler selects (all but for `shard`), in matrix order in the returned list;
    `on_result` as each finishes. `scheduler`: one of harness.orchestration.schedulers, or its name;
    None: the one today's arguments imply (`jobs` > 1: pool, forked workers; `gpus_per_node`:
    packing onto that many GPUs, `durations` from a previous run ordering them; else serial)."""
    specs = list(specs)
    if not isinstance(scheduler, Scheduler):
        scheduler = get_scheduler(scheduler, Settings(jobs=jobs, gpus_per_node=gpus_per_node, durations=durations))
    with source_store(options or RunOptions()) as options:
        scheduler.check(specs, options)
        return scheduler.run(specs, options, run_case, on_result)


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
