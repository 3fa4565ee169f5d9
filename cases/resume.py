"""resume: train at S, save, keep training (the uninterrupted run); reload at D and train the same
steps; losses and final weights must agree.

When S == D the resumed run must be bitwise identical to the uninterrupted one. When the topology
changes, fp32 reductions happen in another order (TP splits matmuls into partial sums; DP changes
how gradients are summed across ranks; PP does not change the arithmetic), so after a few Adam
steps values differ in the last bits; RESUME_TOLERANCE bounds that, and is far below what a lost
optimizer state does (a reset Adam moves weights by ~lr per step = 1e-3).

Checks: propagation (as reshard-optimizer), losses (steps k+1..2k), lr (each step's LR, exactly:
a scheduler saved but not restored replays its warmup), grad-norm (each step's global grad norm,
bitwise at S == D, else shared.trajectory.grad_norm_tolerance), final-weights, and
weights-match-main-params (dtype bf16: the resumed job's bf16 weights right after the load equal
its fp32 main params cast to bf16, bitwise, as do the uninterrupted job's at the save; not-run for
fp32, which has no main/model split).

next-step (option next_step: true; torchtitan's checkpoint_compat_test, Megatron-LM's
checkpoint-consistency test): the step right past the load, on its own: its loss, the params and
the optimizer state after it equal the uninterrupted run's after the same step (bitwise at S == D,
else the resume tolerances). With `betas: [0, 0]` Adam's saved moments are the last gradient and
its square, so a load that lost or reset them shows in that one step.

dtype bf16 takes RESUME_LOSS_TOLERANCE_BF16 / RESUME_WEIGHT_TOLERANCE_BF16 across a topology
change (S == D stays bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ranks.train_phase import TrainOut, phase_of, train_phase
from .shared.trajectory import (  # noqa: F401  (the tolerances, where the docs name them)
    RESUME_LOSS_TOLERANCE_BF16,
    RESUME_TOLERANCE,
    RESUME_WEIGHT_TOLERANCE_BF16,
    grad_norm_tolerance,
    losses_of,
    resume_tolerances,
    schedule_checks,
    segment_losses,
)
from .contract import Case
from harness.backends import get_backend, parse_ref, ref_of
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import get_model
from harness.judge.checks import (
    ASYNC_FINALIZE,
    WEIGHTS_MATCH_MAIN_PARAMS,
    assembled,
    finalize_gate,
    knob_check,
    not_run_checks,
    state_check,
    weights_match_main_params,
)
from harness.models.training import (
    TrainOptions,
    cp_rule,
    knobs_reached,
    untrainable,
    workaround_notes,
)
from harness.run.envelope import RunEnv


@dataclass(frozen=True)
class Options(TrainOptions):
    steps: int = 3
    #: N > 1: the uninterrupted job checkpoints every k steps, N times (with the same backend
    #: instance, so a save strategy's caches serve the later saves: megatron-core reuses the
    #: cached local plan from the 2nd save and the cached central plan and global metadata from
    #: the 3rd), training k steps after each; the resumed job loads the first checkpoint, trains
    #: k, then loads each later one into the same job and trains k. Every checkpoint is judged
    #: alike: losses and final-weights for the first, resave-losses@i and resave-final-weights@i
    #: for checkpoint i.
    saves: int = 1
    #: the backend the resumed job loads through, with its options (harness.backends.parse_ref:
    #: "mcore_dist strict=assume_ok_unexpected"; default the case's backend): a checkpoint one tool
    #: wrote, resumed by another
    load_with: str = ""
    #: true: both jobs view model and optimizer right after the first step past the save / the load
    #: (TrainOut.next_model / next_optimizer): check next-step
    next_step: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.saves <= 3:
            raise ValueError(f"option 'saves' must be 1, 2 or 3, got {self.saves}")


def judge_resave(k: int, src: str, dst: str, reference: list[TrainOut], resumed: list[TrainOut], dtype: str = "fp32") -> list[Check]:
    """Every later checkpoint (saves > 1), judged as the first: the resumed job, reloaded from
    checkpoint i (saved at i*k), trains steps i*k+1..(i+1)*k as the uninterrupted job did after
    saving it. A job that lost a segment fails both checks of that checkpoint."""
    loss_tol, weight_tol = resume_tolerances(src, dst, dtype)
    n = max(len(o.losses_more) for o in reference + resumed)
    checks = []
    for j in range(n):
        i = j + 2  # checkpoint number
        ref_l = next((o.losses_more[j] for o in reference if len(o.losses_more) > j and o.losses_more[j][:1] != [None]), [])
        res_l = next((o.losses_more[j] for o in resumed if len(o.losses_more) > j and o.losses_more[j][:1] != [None]), [])
        w_ref, p_ref = assembled([_Final(o, j) for o in reference], "shards", src)
        w_res, p_res = assembled([_Final(o, j) for o in resumed], "shards", dst)
        checks += [
            segment_losses(k, i * k, ref_l, res_l, src, dst, f"resave-losses@{i}", loss_tol),
            state_check(f"resave-final-weights@{i}", w_ref, w_res, f"uninterrupted@{src}", f"resumed@{dst}",
                        f"{len(w_res)} weights after {(i + 1) * k} steps agree (checkpoint {i}, saved at step {i * k})",
                        weight_tol, problems=p_ref + p_res),
        ]
    return checks


def next_step_check(k: int, src: str, dst: str, reference: list[TrainOut], resumed: list[TrainOut], dtype: str = "fp32") -> Check:
    """next-step: step k+1, the first past the save (uninterrupted) and the load (resumed): its loss,
    then the params and the optimizer state after it, each equal (resume_tolerances: bitwise at S == D)."""
    loss_tol, weight_tol = resume_tolerances(src, dst, dtype)
    parts = [segment_losses(1, k, losses_of(reference)[:1], losses_of(resumed)[:1], src, dst, "next-step", loss_tol)]
    for field, what in (("next_model", "params"), ("next_optimizer", "optimizer tensors")):
        e, pe = assembled(reference, field, src)
        a, pa = assembled(resumed, field, dst)
        parts.append(state_check("next-step", e, a, f"uninterrupted@{src}", f"resumed@{dst}", f"{len(a)} {what} after step {k + 1} agree",
                                 weight_tol, problems=pe + pa))
    failed = [c for c in parts if c.failed]
    worst = max((c.max_abs_diff or 0.0) for c in parts)
    said = lambda c: c.detail + "".join(f" [{m.key}: {m.detail}]" for m in c.mismatches[:4])  # noqa: E731
    return Check("next-step", "failed" if failed else "passed", "; ".join(map(said, failed or parts)), worst,
                 parts[1].tolerance, [m for c in failed for m in c.mismatches])


class _Final:
    """One rank's final weights of later segment j, as `assembled` reads a field."""

    def __init__(self, out: TrainOut, j: int) -> None:
        self.shards = out.final_more[j] if len(out.final_more) > j else []


def judge(k: int, src: str, dst: str, reference: list[TrainOut], resumed: list[TrainOut], dtype: str = "fp32") -> list[Check]:
    """Losses and final weights of the resumed run vs the uninterrupted one; for bf16 also the
    model/main-param agreement of both jobs (recorded by the "optimizer" view: the reference's
    before its save, the resumed job's right after its load)."""
    loss_tol, weight_tol = resume_tolerances(src, dst, dtype)
    losses = segment_losses(k, k, losses_of(reference), losses_of(resumed), src, dst, "losses", loss_tol)
    w_ref, p_ref = assembled(reference, "final_shards", src)
    w_res, p_res = assembled(resumed, "final_shards", dst)
    sides = []
    if dtype == "bf16":
        for label, outs in ((f"save@{src}", reference), (f"load@{dst}", resumed)):
            weights, _ = assembled(outs, "model_shards", label)
            optimizer, _ = assembled(outs, "optimizer_shards", label)
            sides.append((label, weights, optimizer))
    return [
        knob_check("propagation", [(src, [o.propagation for o in reference]), (dst, [o.propagation for o in resumed])],
                   knobs_reached(o.propagation for o in (*reference, *resumed))),
        losses,
        *schedule_checks(k, k, reference, resumed, src, dst, grad_norm_tolerance(src, dst, dtype)),
        state_check("final-weights", w_ref, w_res, f"uninterrupted@{src}", f"resumed@{dst}",
                    f"{len(w_res)} weights after {2 * k} steps agree", weight_tol, problems=p_ref + p_res),
        weights_match_main_params(sides, dtype),
        *([next_step_check(k, src, dst, reference, resumed, dtype)] if any(o.next_model is not None for o in reference + resumed) else []),
    ]


class Resume(Case):
    name = "resume"
    description = "train k steps, save at S, reload at D, k more steps == the uninterrupted run"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("propagation", "losses", "lr", "grad-norm", "final-weights", WEIGHTS_MATCH_MAIN_PARAMS, "resave-losses", "resave-final-weights",
              "next-step", ASYNC_FINALIZE)
    finalizes_saves = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        untrainable(spec)
        cp_rule(spec, opts)
        if opts.load_with and "training_state" not in get_backend(parse_ref(opts.load_with)).capabilities:
            raise ValueError(f"option load_with: backend {opts.load_with!r} cannot load a training job (capability training_state)")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        k = opts.steps
        model, backend = get_model(spec.model, "gpt"), ref_of(spec)
        result.notes += workaround_notes(opts, spec.source, spec.target)
        # bf16 also records model + optimizer views (the reference's at its save, the resumed job's
        # right after its load: steps_before_save is 0 there) for weights-match-main-params.
        views = (("final", "optimizer") if opts.dtype == "bf16" else ("final",)) + (("next",) if opts.next_step else ())
        # the reference run at S (and its saves) is the same for every target: once per run (harness.run.reuse)
        root, reference = env.launch_source("save", train_phase, lambda d: phase_of(
            model, opts, backend, topo=spec.source, save_to=str(d / "ckpt"), steps_before_save=k, steps_after=k, views=views,
            resave_to=tuple(str(d / f"ckpt{i}") for i in range(2, opts.saves + 1))), spec.source)
        ckpt, later = root / "ckpt", tuple(str(root / f"ckpt{i}") for i in range(2, opts.saves + 1))
        finalized = finalize_gate(get_backend(backend), reference, [str(ckpt), *later])
        if finalized is not None:
            result.checks.append(finalized)
            if finalized.failed:  # never resume from what was never completed
                result.checks += not_run_checks([c for c in self.checks if c != ASYNC_FINALIZE and (later or "resave" not in c)],
                                                "the checkpoint was never completed (async-finalize failed): nothing to resume from")
                return
        loader = parse_ref(opts.load_with) if opts.load_with else backend
        resumed = env.launch("load", train_phase, phase_of(
            model, opts, loader, topo=spec.target, load_from=str(ckpt), first_step=k, steps_after=k, views=views,
            reload_from=later), spec.target)
        with env.timed("compare"):
            result.checks.extend(judge(k, spec.source.id, spec.target.id, reference, resumed, opts.dtype))
            if later:
                result.checks.extend(judge_resave(k, spec.source.id, spec.target.id, reference, resumed, opts.dtype))


CASE = Resume()
