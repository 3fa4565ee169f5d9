"""async-save: what an asynchronous checkpoint save must guarantee (issue 21), through any backend
whose save returns before the checkpoint is written: mcore_dist `async_save: mcore | nvrx`
(megatron-core's forked writer, or nvidia-resiliency-ext's), verl_manager `async_save: true` (verl
0.9.1's MegatronCheckpointManager over megatron-core's writer), bridge_training `async_save: true`
(Megatron-Bridge's save_checkpoint; `use_persistent_ckpt_worker: false` on CPU).

A training job at S trains k steps. Option `fault`:

  none         it saves step k twice: through the backend's synchronous twin (same options,
               async_save off) and asynchronously; trains k more steps while the async write is
               in flight (the writer must hold the state as it was when saved), then finalizes.
               Checks: async-finalize (incomplete until its finalize, complete after), tracker
               (it named the async step only once finalized), async-equals-sync (the two
               checkpoints read back the same: every tensor bitwise, every object and file by
               value, harness.judge.ckpt_content; not raw bytes, see there), and a job at D
               resumed from each: losses-vs-sync, lr-vs-sync, grad-norm-vs-sync,
               final-weights-vs-sync (bitwise: both resume the same state at the same topology),
               losses (the async resume against the job that trained on; bitwise when S == D)
  kill-writer  step k saved async and finalized (the tracker names k); then a job trained to step
  kill-rank    k+1 (the same state: training is deterministic) saves it async while the write of
               the last rank of DP rank 0 (not the coordinator, and one with shards of its own) is
               killed mid-write (harness.faults.hooks.kill_async_write_in_flight: part of its
               shards written, then SIGKILL of the forked writer, or of the rank's process group:
               a node lost). Two worlds, so the first save's records survive the kill. Checks:
               interruption (the write was in flight when killed; kill-writer: the job lives and
               its save fails loudly on every rank, never reports success; kill-rank: the world
               died, never hung nor completed), tracker (names k, never k+1),
               recognised-incomplete (step k+1's dist checkpoints are not complete by
               megatron-core's rule), resumed (a job at D resuming from the root, as the backend's
               resume does, holds step k's model and optimizer bitwise), outcome + loaded-equal (a
               job at D loading step k+1 itself, as verl's resume_from_path, Bridge's ckpt_step or
               Megatron-LM's iteration directory do: refused with an error, or complete and equal
               to step k+1's state; never a silent partial load)
"""

from __future__ import annotations

import json
from pathlib import Path

from .shared import damaged_load as cl
from .ranks.async_save import (
    LoadPhase,
    Options,
    SavePhase,
    kill_record,
    load_rank,
    save_rank,
    tracker_text,
    views_path,
)
from .shared.trajectory import losses_of, resume_tolerances, schedule_checks, segment_losses
from .contract import Case
from harness.backends import get_backend, ref_of
from harness.core.parity import NOT_COMPARED, Shard
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import get_model
from harness.faults.damage import Damage
from harness.judge.checks import (
    ASYNC_EQUALS_SYNC,
    ASYNC_FINALIZE,
    assembled,
    async_equals_sync_check,
    finalize_gate,
    not_run_checks,
    state_check,
    tracker_names_check,
)
from harness.models.training import cp_rule, untrainable, workaround_notes
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, WorldTimeout

KILL_HOOK = "harness.faults.hooks:kill_async_write_in_flight"
#: differences between the sync and the async checkpoint that are the save's own record of how it
#: ran (regex over the difference's path -> why): reported, never failed
RECORDS_HOW_SAVED = {
    r"run_config\.yaml\.checkpoint\.async_save:": "Megatron-Bridge writes its CheckpointConfig, async_save included, to run_config.yaml",
}


class _Views:
    """The shards one rank dumped at a step, as `assembled` reads a field."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards


def step_dir(root: Path, step: int) -> Path:
    """Where a backend put step `step` under its root: Megatron-LM's and Bridge's `iter_NNNNNNN`, verl's `global_step_N`."""
    for name in (f"iter_{step:07d}", f"global_step_{step}"):
        if (root / name).exists():
            return root / name
    return root / f"iter_{step:07d}"


def dist_dirs(directory: Path) -> list[Path]:
    """Every torch_dist checkpoint directory under `directory` (one holding .distcp files or a metadata.json)."""
    if not directory.is_dir():
        return []
    found = {p.parent for p in directory.rglob("*.distcp")} | {p.parent for p in directory.rglob("metadata.json")}
    return sorted(found)


def judge_recognised(directory: Path) -> Check:
    """megatron-core's rule (metadata.json readable, torch DCP's .metadata there) on every dist
    checkpoint the killed step's directory holds: none may read as complete."""
    from harness.backends.mcore_dist import is_complete

    dirs = dist_dirs(directory)
    rel = {str(d.relative_to(directory.parent)): is_complete(d) for d in dirs}
    if not dirs:
        return Check("recognised-incomplete", "passed", f"{directory.name}: no dist checkpoint was written (files: "
                     f"{sorted(p.name for p in directory.rglob('*'))[:8] if directory.exists() else 'no directory'})", tolerance=NOT_COMPARED)
    complete = sorted(d for d, ok in rel.items() if ok)
    if complete:
        return Check("recognised-incomplete", "failed", f"megatron-core calls {complete} complete checkpoints though a writer "
                     "was killed mid-write (the load must then equal the saved step: outcome)", tolerance=NOT_COMPARED)
    return Check("recognised-incomplete", "passed", f"{sorted(rel)}: no metadata.json/.metadata, not a checkpoint by "
                 "megatron-core's rule", tolerance=NOT_COMPARED)


def judge_interruption(fault: str, victim: int, record: dict | None, errors: list[str | None] | None, world_error: str | None,
                       timed_out: bool, error_rank: int | None) -> Check:
    """The write of step k+1 was in flight when killed, and the job learned of it. `record`: what the
    killed writer wrote down, `errors`: each rank's exception from the interrupted save (None: it
    returned), `world_error`: the save world's error (None when it completed)."""
    def failed(why: str) -> Check:
        return Check("interruption", "failed", f"{fault}: {why}", tolerance=NOT_COMPARED)

    if timed_out:
        return failed(f"the job hung until the harness' timeout after the kill (a user's job would hang): {(world_error or '')[:300]}")
    if record is None:
        return failed("the armed writer never ran (no record): the save did not go through megatron-core's async writer")
    left = f"writer of rank {record['rank']} killed with {record['left']} on disk ({record['buckets']} bucket(s))"
    if fault == "kill-writer":
        if world_error is not None:
            return failed(f"{left}; the job died instead of failing the save: {cl.quote(world_error)}")
        silent = [r for r, e in enumerate(errors or []) if e is None]
        if silent:
            return failed(f"{left}; the save of the interrupted step returned and finalized without an error on rank(s) {silent}: "
                          "a lost write reported as a checkpoint")
        return Check("interruption", "passed", f"{left}; every rank's save failed: {cl.quote(errors[0] or '')}", tolerance=NOT_COMPARED)
    if world_error is None:
        return failed(f"{left}; the world completed though rank {victim} was to be SIGKILLed")
    # which rank the launcher blames first is a race (the peer's collective fails as the rank dies): either is the kill
    named = (error_rank == victim or f"rank {victim} " in world_error) and "SIGKILL" in world_error
    how = "" if named else f" (the launcher reported a peer first, rank {victim}'s group was SIGKILLed by the hook)"
    return Check("interruption", "passed", f"{left}; {world_error.splitlines()[0][:200]}{how}", tolerance=NOT_COMPARED)


def read_views(views: Path, step: int, world: int) -> tuple[list[_Views], list[_Views], bool]:
    """(model, optimizer) shard records of every rank at `step` (dumped by the save world), and whether all were there."""
    import torch

    found = [torch.load(views_path(views, step, r), weights_only=False) for r in range(world) if views_path(views, step, r).exists()]
    return [_Views(f["model"]) for f in found], [_Views(f["optimizer"]) for f in found], len(found) == world


def state_of(model_outs: list, opt_outs: list, label: str) -> tuple[dict, list]:
    weights, p1 = assembled(model_outs, "shards", label)
    opt, p2 = assembled(opt_outs, "shards", label)
    return {**{f"model:{k}": v for k, v in weights.items()}, **opt}, p1 + p2


def loaded_state(outs: list, label: str) -> tuple[dict, list]:
    """The model and optimizer state the load worlds' ranks recorded, assembled as state_of does."""
    return state_of([_Views(o.model_shards) for o in outs], [_Views(o.optimizer_shards) for o in outs], label)


#: fault none's checks that compare the finished async checkpoint (not-run when it never finished)
COMPARED = (ASYNC_EQUALS_SYNC, "losses-vs-sync", "lr-vs-sync", "grad-norm-vs-sync", "final-weights-vs-sync", "losses")


class AsyncSave(Case):
    name = "async-save"
    description = "an async save equals the sync one once finalized; a write killed in flight is never named latest nor loaded silently"
    Options = Options
    needs = frozenset({"training_state"})
    checks = (ASYNC_FINALIZE, "tracker", *COMPARED, "interruption", "recognised-incomplete", "resumed", "outcome", "loaded-equal")
    finalizes_saves = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        untrainable(spec)
        cp_rule(spec, opts)
        backend = get_backend(ref_of(spec))
        if getattr(backend.options, "async_save", False) in (False, "none"):
            raise ValueError(f"async-save needs a backend that saves asynchronously: backend {spec.backend!r} with "
                             "async_save (mcore_dist: mcore | nvrx; verl_manager, bridge_training: true)")
        if opts.fault != "none":
            if spec.source.world_size // (spec.source.dp * spec.source.cp) < 2:
                raise ValueError(f"fault {opts.fault!r} kills the write of a rank of DP rank 0 other than rank 0 (which coordinates; "
                                 f"a DP replica may write nothing): give a source with tp * pp >= 2, got {spec.source.id}")
            if getattr(backend.options, "layout", "megatron-lm") != "megatron-lm":
                raise ValueError(f"fault {opts.fault!r} judges the 'latest' tracker: mcore_dist needs layout 'megatron-lm' "
                                 "(the plain layout writes none)")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        model, ref = get_model(spec.model, "gpt"), ref_of(spec)
        result.notes += workaround_notes(opts, spec.source, spec.target)
        views = env.case_dir / "views"
        views.mkdir(parents=True, exist_ok=True)
        phase = SavePhase(model, spec.source, opts, ref, str(env.case_dir / "async"), str(env.case_dir / "sync"), str(views))
        if opts.fault == "none":
            self._clean(spec, opts, env, result, phase)
        else:
            self._killed(spec, opts, env, result, phase)

    # ------------------------------------------------------------------ fault none

    def _clean(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, p: SavePhase) -> None:
        from harness.judge.ckpt_content import read_tree

        k, backend = opts.steps, get_backend(p.backend)
        root, sync_root = Path(p.root), Path(p.sync_root)
        saved = env.launch("save", save_rank, p, spec.source)
        layout = getattr(backend.options, "layout", "")
        pending = root / f"iter_{k:07d}" if layout == "megatron-lm" else root
        fin = finalize_gate(backend, saved, [str(pending)]) if saved[0].pending_after_save else None
        result.checks.append(fin or Check(ASYNC_FINALIZE, "not-run", f"backend {backend.name} finalized its async save within the "
                                          "save call (nothing was pending after it)", tolerance=NOT_COMPARED))
        if layout == "plain":
            result.checks.append(Check("tracker", "not-run", "mcore_dist layout 'plain' writes no tracker", tolerance=NOT_COMPARED))
        else:
            seen = [("after the finalize", tracker_text(root), str(k))]
            if saved[0].pending_after_save:
                seen.insert(0, ("before the async save's finalize", saved[0].tracker_before_finalize, None))
            result.checks.append(tracker_names_check(seen))
        if fin is not None and fin.failed:
            result.checks += not_run_checks(COMPARED, "the async checkpoint was never completed (async-finalize failed)")
            return
        with env.timed("compare-files"):
            (a, la), (s, ls) = read_tree(root), read_tree(sync_root)
            result.checks.append(async_equals_sync_check(s, a, (ls, la), RECORDS_HOW_SAVED))
        from_sync, from_async = (env.launch(f"load-{side}", load_rank, LoadPhase(p.model, spec.target, opts, p.backend, str(d),
                                                                                        first_step=k, steps_after=k), spec.target)
                                 for side, d in (("sync", sync_root), ("async", root)))
        dst, labels = spec.target.id, ("from-sync", "from-async")
        lr, norm = schedule_checks(k, k, from_sync, from_async, dst, dst, None, labels)
        lr.name, norm.name = "lr-vs-sync", "grad-norm-vs-sync"
        w_s, q_s = assembled(from_sync, "final_shards", f"from-sync@{dst}")
        w_a, q_a = assembled(from_async, "final_shards", f"from-async@{dst}")
        result.checks += [
            segment_losses(k, k, losses_of(from_sync), losses_of(from_async), dst, dst, "losses-vs-sync", None, labels),
            lr, norm,
            state_check("final-weights-vs-sync", w_s, w_a, f"from-sync@{dst}", f"from-async@{dst}",
                        f"{len(w_a)} weights after {k} resumed steps equal", problems=q_s + q_a),
            segment_losses(k, k, losses_of(saved), losses_of(from_async), spec.source.id, dst, "losses",
                           resume_tolerances(spec.source.id, dst, opts.dtype)[0], ("trained on while in flight", "resumed from async")),
        ]

    # ------------------------------------------------------------------ faults

    def _killed(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, p: SavePhase) -> None:
        from dataclasses import replace

        k, src, dst = opts.steps, spec.source, spec.target
        root, views = Path(p.root), Path(p.views_dir)
        env.launch("save", save_rank, p, src)
        saved, world_error, timed_out, error_rank = None, None, False, None
        try:
            saved = replace(env, hooks=env.hooks + (KILL_HOOK,)).launch("save-killed", save_rank, replace(p, killed=True), src)
        except WorldError as exc:
            world_error, timed_out, error_rank = str(exc), isinstance(exc, WorldTimeout), exc.rank
            (env.case_dir / "save-error.txt").write_text(world_error)
        with env.timed("inspect"):
            record = json.loads(kill_record(views).read_text()) if kill_record(views).exists() else None
            errors = [o.save_error for o in saved] if saved else None
            interrupted = step_dir(root, k + 1)
            result.checks += [
                judge_interruption(opts.fault, record["rank"] if record else -1, record, errors, world_error, timed_out, error_rank),
                tracker_names_check([(f"after step {k + 1}'s write was killed", tracker_text(root), str(k))]),
                judge_recognised(interrupted),
            ]
        for step in (k, k + 1):
            if not read_views(views, step, src.world_size)[2]:
                result.checks += not_run_checks(["resumed", "outcome", "loaded-equal"], f"the save world died before every rank "
                                                f"recorded step {step}'s state: nothing to compare a load with")
                return
        try:
            resumed = env.launch("resume", load_rank, LoadPhase(p.model, dst, opts, p.backend, str(root), first_step=k), dst)
        except WorldError as exc:
            outcome = cl.outcome_of(exc)
            if outcome is None:
                raise
            result.checks.append(Check("resumed", "failed", f"the resume from the root (tracker: {tracker_text(root)}) {outcome.kind}: "
                                       f"{cl.quote(outcome.text)}", tolerance=NOT_COMPARED))
            resumed = None
        if resumed is not None:
            with env.timed("compare"):
                want, w_problems = state_of(*read_views(views, k, src.world_size)[:2], f"step {k}@{src.id}")
                got, g_problems = loaded_state(resumed, f"resumed@{dst.id}")
                result.checks.append(state_check("resumed", want, got, f"step {k}@{src.id}", f"resumed@{dst.id}",
                                                 f"the resume from the root loaded step {k}: {len(got)} model and optimizer tensors "
                                                 "bitwise", problems=w_problems + g_problems))
        dmg = Damage(opts.fault, (), ("metadata.json", ".metadata", interrupted.name), f"step {k + 1}'s async write killed in flight")
        try:
            loaded = env.launch("load-interrupted", load_rank, LoadPhase(p.model, dst, opts, p.backend, str(interrupted),
                                                                                 first_step=k + 1), dst)
        except WorldError as exc:
            outcome = cl.outcome_of(exc)
            if outcome is None:
                raise
            result.checks += _renamed(cl.judge(dmg, outcome))
            return
        with env.timed("compare"):
            want, w_problems = state_of(*read_views(views, k + 1, src.world_size)[:2], f"step {k + 1}@{src.id}")
            got, g_problems = loaded_state(loaded, f"loaded@{dst.id}")
            result.checks += _renamed(cl.judge(dmg, cl.Outcome("silent"), want, got, w_problems + g_problems, f"loaded@{dst.id}"))


def _renamed(checks: list[Check]) -> list[Check]:
    """corrupt-load's judge, its `loaded-canonical` named for what it compares here: the step's saved state."""
    for c in checks:
        if c.name == "loaded-canonical":
            c.name = "loaded-equal"
            c.detail = c.detail.replace("canonical", "the step's saved state")
    return checks


CASE = AsyncSave()
