"""interrupted-save: a save that never finished, and what a resuming job then sees (issue 11, item 2).

A preempted job leaves a half-written checkpoint directory; the job that resumes picks "the
latest" one. This case saves a good checkpoint at step 1 and then interrupts the save of step 2
one named way (`interruption`, a matrix axis), all in one world at S, in a verl-like layout
(`checkpoints/global_step_<N>/` plus verl's tracker `latest_checkpointed_iteration.txt`, which the
case writes on rank 0 only once a save is complete: after a sync save returns, or in a finalize
function of an async request, as Megatron-LM does):

  kill-after-shard     the last rank SIGKILLs itself at the start of torch_dist's finalize step
                       (harness.faults.hooks.kill_last_rank_before_save_finalize): every rank's .distcp
                       files are on disk, the coordinator's `.metadata` and megatron-core's
                       `metadata.json` are not
  async-not-finalized  `dist_checkpointing.save(..., async_sharded_save=True)` (mcore async
                       strategy); the request's write function is run in the rank (what the async
                       caller's worker does), its finalize functions never
  write-error          the last rank's writes are capped by RLIMIT_FSIZE (SIGXFSZ ignored, so the
                       write raises OSError EFBIG instead of killing the process)

Then, in a fresh world at D, what a resuming job would see.

Checks:
  interruption           the save was interrupted the way asked: the world died with the killed
                         rank named (kill), the save returned with shards and no metadata (async),
                         or the world ended as an error, not a timeout, whose text has EFBIG, the
                         failing rank and the path being written (write-error)
  recognised-incomplete  megatron-core's own rule (`dist_checkpointing.check_is_distributed_checkpoint`,
                         i.e. a readable metadata.json) says the step-2 directory is no checkpoint
  tracker                verl's tracker still names step 1, never the interrupted step 2
  scope                  every file any rank opened for writing during the saves is under the
                         case's scratch dir (Python's `open` audit events; C++ writes are not seen)
  outcome, loaded-canonical  the load of the step-2 directory at D, judged by corrupt-load's judge:
                         refused passes, silent fails (unless bitwise canonical), crashed fails
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Sequence

from .shared import damaged_load as cl
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core import truth
from harness.core.context import RankContext
from harness.core.parity import NOT_COMPARED
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec, get_model
from harness.faults.damage import Damage
from harness.judge.checks import assembled
from harness.models import mcore as models
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, WorldTimeout

Interruption = Literal["kill-after-shard", "async-not-finalized", "write-error"]

#: verl's tracker file (verl/utils/checkpoint/checkpoint_manager.py), in the checkpoints root.
TRACKER = "latest_checkpointed_iteration.txt"
GOOD_STEP, INTERRUPTED_STEP = 1, 2
#: RLIMIT_FSIZE of the write-error rank: far below one tiny-model shard (400 KB per rank for
#: gpt-gqa at tp2, measured), above the rank's own log and record files.
FSIZE_LIMIT = 64 * 1024
KILL_HOOK = "harness.faults.hooks:kill_last_rank_before_save_finalize"


@dataclass(frozen=True)
class InterruptedOptions:
    interruption: Interruption = "kill-after-shard"


def step_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}"


@dataclass(frozen=True)
class _SavePhase:
    model: ModelSpec
    topo: Topology
    backend: BackendRef  # import path + options
    root: str  # the checkpoints root (verl layout)
    interruption: str


def _record_writes(path: Path) -> list[bool]:
    """Append the absolute path of every file this process opens for writing to `path`, one a
    line, written at once (a SIGKILLed rank leaves its record). Returns the on/off switch: an
    audit hook cannot be removed, so it is turned off after the saves."""
    import sys

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # before the hook: not recorded
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    on = [True]

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not on[0]:
            return
        target, mode, flags = (tuple(args) + (None, None, None))[:3]
        if not isinstance(target, (str, bytes, os.PathLike)):
            return
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & writing):
            os.write(fd, (os.path.abspath(os.fsdecode(target)) + "\n").encode())

    sys.addaudithook(hook)
    return on


def writes_path(workdir: Path, rank: int) -> Path:
    return workdir / f"writes-rank{rank}.txt"


class SaveFailedError(RuntimeError):
    """Raised by a save-side rank around the interrupted save only, so the parent's report carries
    the save's exception chain (torch DCP's CheckpointException is a BaseException: torch
    multiprocessing's wrapper writes no error file for it and the harness would see only "exit
    code 1"). Message: the exception chain; a CheckpointException's text carries each failed
    rank's exception and traceback (on the coordinator, which gathered them)."""


def _write_tracker(root: Path, step: int) -> None:
    (root / TRACKER).write_text(str(step))


def _rank_save(ctx: RankContext, p: _SavePhase) -> int:
    """Step 1 saved whole (tracker written), then step 2 interrupted. Returns the step the tracker
    names when the rank gets that far (async-not-finalized; the other kinds end the world)."""
    import resource
    import signal

    import torch.distributed as dist

    backend = get_backend(p.backend)
    root = Path(p.root)
    if ctx.is_rank0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    on = _record_writes(writes_path(ctx.workdir, ctx.rank))
    model = models.build_gpt(p.model, p.topo)
    models.fill_canonical(model, p.model)
    backend.save(ctx, model, step_dir(root, GOOD_STEP))
    if ctx.is_rank0:  # verl: the tracker after the save returns
        _write_tracker(root, GOOD_STEP)
    dist.barrier()
    last = ctx.rank == ctx.world_size - 1
    target = step_dir(root, INTERRUPTED_STEP)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if p.interruption == "async-not-finalized":
            _async_save_without_finalize(ctx, models.sharded_state_dict(model), target)
        else:
            if p.interruption == "write-error" and last:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, limits[1]))
            try:
                backend.save(ctx, model, target)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
                raise SaveFailedError(cl.chain_text(exc)) from exc
            if ctx.is_rank0:
                _write_tracker(root, INTERRUPTED_STEP)
    finally:  # what follows is the harness' (torch's error file, the log), not the save's
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        on[0] = False
    dist.barrier()
    return int((root / TRACKER).read_text())


def _async_save_without_finalize(ctx: RankContext, sharded_state: dict, target: Path) -> None:
    """Megatron-LM's async_save (mcore strategy, no nvidia-resiliency-ext) minus the finalize: the
    request's write function runs here, synchronously, as AsyncRequest.execute_sync runs it (the
    preload staging the tensors, the write, the barrier), and its finalize functions, torch DCP's
    `.metadata`, megatron-core's `metadata.json` and the tracker appended as Megatron-LM appends
    its own, are dropped: the job is preempted before the next train step would finalize it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if ctx.is_rank0:
        target.mkdir(parents=True, exist_ok=False)
    dist.barrier()
    request = dist_checkpointing.save(sharded_state, str(target), async_sharded_save=True, async_strategy="mcore")
    request.add_finalize_fn(lambda: _write_tracker(target.parent, INTERRUPTED_STEP) if ctx.is_rank0 else None)
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[1] = request.preload_fn()
    if request.async_fn is not None:
        request.async_fn(*args, **request.async_fn_kwargs)
    dist.barrier()


# --------------------------------------------------------------------------- the judge


def shard_files(files: Sequence[str], rank: int | None = None) -> list[str]:
    """The .distcp files (of one rank's writer when `rank` is given: torch DCP names them
    `__<rank>_<n>.distcp`)."""
    prefix = f"__{rank}_" if rank is not None else "__"
    return sorted(f for f in files if f.startswith(prefix) and f.endswith(".distcp"))


def judge_interruption(
    kind: str, victim: int, error: str | None, timed_out: bool, files: Sequence[str], directory: str,
    error_rank: int | None = None,
) -> Check:
    """Was step 2 interrupted the way `kind` asks? `error`: the save world's error text (None when
    it completed), `timed_out`: it ended by the harness' timeout, `files`: what step 2's directory
    holds, `directory`: its path (write-error's report must name it or the rank's shard file),
    `error_rank`: the rank the launcher blames (WorldError.rank; the text's wording differs between
    torch multiprocessing and torchrun, so either names the rank)."""
    left = f"left {sorted(files)}"
    if timed_out:
        return Check("interruption", "failed", f"{kind}: the save world hung until the timeout: {(error or '')[:300]}", tolerance=NOT_COMPARED)
    finalised = [f for f in (".metadata", "metadata.json") if f in files]
    if kind == "async-not-finalized":
        if error is not None:
            return Check("interruption", "failed", f"{kind}: the unfinalised async save raised: {error[:300]}", tolerance=NOT_COMPARED)
        if not shard_files(files) or finalised:
            return Check("interruption", "failed", f"{kind}: expected shard files and no {finalised or 'metadata'}; {left}", tolerance=NOT_COMPARED)
        return Check("interruption", "passed", f"{kind}: the write ran, the finalize never did; {left}", tolerance=NOT_COMPARED)
    if error is None:
        return Check("interruption", "failed", f"{kind}: the save of step {INTERRUPTED_STEP} completed; {left}", tolerance=NOT_COMPARED)
    head = error.splitlines()[0][:200] if error else ""
    if kind == "kill-after-shard":
        problems = []
        if (error_rank != victim and f"rank {victim} " not in error) or "SIGKILL" not in error:
            problems.append(f"the report does not say rank {victim} was SIGKILLed ({head!r})")
        if not shard_files(files, victim):
            problems.append(f"rank {victim} had written no shard file")
        if finalised:
            problems.append(f"{finalised} written: the kill came after the finalize")
        if problems:
            return Check("interruption", "failed", f"{kind}: " + "; ".join(problems) + f"; {left}", tolerance=NOT_COMPARED)
        return Check("interruption", "passed", f"{kind}: {head}; {left}", tolerance=NOT_COMPARED)
    # write-error
    missing = []
    if not any(s in error for s in ("EFBIG", "File too large", "Errno 27")):
        missing.append("EFBIG (File too large)")
    if error_rank != victim and f"rank {victim}" not in error and f"ranks:dict_keys([{victim}])" not in error:
        missing.append(f"rank {victim}")
    if directory not in error and not any(f"__{victim}_" in line for line in error.splitlines()):
        missing.append(f"the path ({directory} or rank {victim}'s .distcp)")
    if missing:
        return Check("interruption", "failed", f"{kind}: the save failed but the report lacks {', '.join(missing)}: "
                     f"{cl.quote(error)}; {left}", tolerance=NOT_COMPARED)
    return Check("interruption", "passed", f"{kind}: {cl.quote(error)}; {left}", tolerance=NOT_COMPARED)


def judge_recognised(is_checkpoint: bool, files: Sequence[str]) -> Check:
    """megatron-core's rule (check_is_distributed_checkpoint) on the interrupted directory."""
    if is_checkpoint:
        return Check("recognised-incomplete", "failed", "megatron-core's check_is_distributed_checkpoint calls the interrupted "
                     f"directory a checkpoint (files: {sorted(files)})", tolerance=NOT_COMPARED)
    return Check("recognised-incomplete", "passed", "check_is_distributed_checkpoint: False (no metadata.json; "
                 f"files: {sorted(files)})", tolerance=NOT_COMPARED)


def judge_tracker(tracker: str | None) -> Check:
    """verl's rule: the tracker names the newest complete step, never the interrupted one."""
    if tracker is None:
        return Check("tracker", "failed", f"no {TRACKER}: step {GOOD_STEP}'s complete save is lost to a resume", tolerance=NOT_COMPARED)
    text = tracker.strip()
    if text == str(GOOD_STEP):
        return Check("tracker", "passed", f"{TRACKER} names step {GOOD_STEP}, the last complete save", tolerance=NOT_COMPARED)
    if text == str(INTERRUPTED_STEP):
        return Check("tracker", "failed", f"{TRACKER} names the interrupted step {INTERRUPTED_STEP}: a resume loads it", tolerance=NOT_COMPARED)
    return Check("tracker", "failed", f"{TRACKER} holds {text!r}, expected {GOOD_STEP}", tolerance=NOT_COMPARED)


def judge_scope(written: Sequence[str], root: str) -> Check:
    """Every path opened for writing lies under `root`."""
    base = os.path.join(os.path.abspath(root), "")
    outside = sorted({p for p in written if not os.path.abspath(p).startswith(base)})
    if outside:
        return Check("scope", "failed", f"{len(outside)} file(s) written outside {root}: {outside[:5]}", tolerance=NOT_COMPARED)
    if not written:
        return Check("scope", "not-run", "no write was recorded (the audit hook saw nothing)", tolerance=NOT_COMPARED)
    return Check("scope", "passed", f"{len(set(written))} file(s) written, all under the case dir", tolerance=NOT_COMPARED)


def incomplete_damage(kind: str, directory: Path, files: Sequence[str]) -> Damage:
    """The interrupted directory as corrupt-load's judge describes damage: what a clear refusal
    names (the missing finalisation files, or the directory)."""
    return Damage(kind, (), ("metadata.json", ".metadata", directory.name),
                  f"save of {directory.name} interrupted; it holds {sorted(files)}")


# --------------------------------------------------------------------------- the case


class InterruptedSave(Case):
    name = "interrupted-save"
    description = "a save interrupted one named way: the directory must read as incomplete, the tracker stay put, a load refuse"
    Options = InterruptedOptions
    needs = frozenset({"weights"})
    checks = ("interruption", "recognised-incomplete", "tracker", "scope", "outcome", "loaded-canonical")

    def validate_options(self, spec: CaseSpec, opts: InterruptedOptions) -> None:
        from harness.backends.mcore_dist import McoreDist

        if spec.source.world_size < 2:
            raise ValueError("interrupted-save interrupts the last rank while rank 0 coordinates: give a source of >= 2 ranks")
        if not isinstance(get_backend(ref_of(spec)), McoreDist):
            raise ValueError(f"interrupted-save drives megatron-core's dist_checkpointing save; backend {spec.backend!r} is not mcore_dist")

    def run(self, spec: CaseSpec, opts: InterruptedOptions, env: RunEnv, result: CaseResult) -> None:
        model = get_model(spec.model, "gpt")
        src, dst = spec.source, spec.target
        backend = ref_of(spec)
        kind = opts.interruption
        root = env.case_dir / "checkpoints"
        target = step_dir(root, INTERRUPTED_STEP)
        save_env = replace(env, hooks=env.hooks + (KILL_HOOK,)) if kind == "kill-after-shard" else env
        error, timed_out, error_rank = None, False, None
        try:
            save_env.launch("save", _rank_save, _SavePhase(model, src, backend, str(root), kind), src)
        except WorldError as exc:
            error, timed_out, error_rank = str(exc), isinstance(exc, WorldTimeout), exc.rank
            (env.case_dir / "save-error.txt").write_text(error)  # the whole report, for --keep
        with env.timed("inspect"):
            from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

            files = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
            workdir = env.case_dir / "world-save"
            written = [ln for r in range(src.world_size) if writes_path(workdir, r).exists()
                       for ln in writes_path(workdir, r).read_text().splitlines() if ln]
            tracker = (root / TRACKER).read_text() if (root / TRACKER).exists() else None
            result.checks += [
                judge_interruption(kind, src.world_size - 1, error, timed_out, files, str(target), error_rank),
                judge_recognised(check_is_distributed_checkpoint(str(target)), files),
                judge_tracker(tracker),
                judge_scope(written, str(env.case_dir)),
            ]
        dmg = incomplete_damage(kind, target, files)
        try:
            outs = env.launch("load", cl.rank_dist, cl.DistPhase(model, dst, backend, load_from=str(target)), dst)
        except WorldError as exc:
            outcome = cl.outcome_of(exc)
            if outcome is None:
                raise
            result.checks += cl.judge(dmg, outcome, allowed=get_backend(backend).refusals)
            return
        with env.timed("compare"):
            full, problems = assembled(outs, "shards", dst.id)
            canonical = {k: truth.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in full.items()}
            result.checks += cl.judge(dmg, cl.Outcome("silent"), canonical, full, problems, dst.id)


CASE = InterruptedSave()
