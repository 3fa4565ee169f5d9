"""resume: train at S, save, keep training (the uninterrupted run); reload at D and train the same
steps; losses and final weights must agree.

When S == D the resumed run must be bitwise identical to the uninterrupted one. When the topology
changes, fp32 reductions happen in another order (TP splits matmuls into partial sums; DP changes
how gradients are summed across ranks; PP does not change the arithmetic), so after a few Adam
steps values differ in the last bits; RESUME_TOLERANCE bounds that, and is far below what a lost
optimizer state does (a reset Adam moves weights by ~lr per step = 1e-3).

Checks: propagation (as reshard-optimizer), losses (steps k+1..2k), final-weights, and
weights-match-main-params (dtype bf16: the resumed job's bf16 weights right after the load equal
its fp32 main params cast to bf16, bitwise, as do the uninterrupted job's at the save; not-run for
fp32, which has no main/model split).

dtype bf16 takes RESUME_LOSS_TOLERANCE_BF16 / RESUME_WEIGHT_TOLERANCE_BF16 across a topology
change (S == D stays bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cases._train_phase import TrainOut, phase_of, train_phase
from cases.contract import Case
from harness.backends import get_backend, ref_of
from harness.core.parity import Tolerance
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
    tensor_check,
    weights_match_main_params,
)
from harness.models.training import (
    TrainOptions,
    cp_rule,
    untrainable,
    workaround_notes,
)
from harness.run.envelope import RunEnv, timed

RESUME_TOLERANCE = Tolerance(atol=2e-5, rtol=1e-4, why="topology change reorders fp32 reductions (TP matmul partial sums, DP grad sums)")
# bf16 (dtype bf16, grad_reduce_in_fp32 false): grads are bf16 and reduced in bf16 across DP, and
# every activation is rounded to bf16, so a topology change moves far more than in fp32. Measured
# after 3+3 steps over 8 TP/DP/PP changes (gpt-gqa: dp2->dp1, tp2->tp1, pp2->tp2, tp1->tp2dp2,
# tp2->pp2, tp2pp2->tp1pp1; gpt-tied: pp2->dp2, dp2->pp2): losses max 7.6e-4, final bf16 weights
# max 2.9e-3 (3 bf16 ulps of a weight in [0.125, 0.25)). What a reset Adam step does in bf16
# (dp_reshardable dp2->dp1): losses 3.7e-3, weights 7.8e-3. The bounds sit between, 2.6x and 1.7x
# above the measured maxima and below the reset drift; rtol 0 because a relative term wide enough
# for reordering noise on a weight near 1 (one bf16 ulp = 7.8e-3 there) would also pass the reset.
# The margins are thin: in bf16 the bitwise optimizer-state and weights-match-main-params checks
# carry the proof, these two keep an order-of-magnitude guard on the resumed trajectory.
RESUME_LOSS_TOLERANCE_BF16 = Tolerance(atol=2e-3, rtol=0.0, why="bf16: topology change reorders bf16 grad reductions (measured max 7.6e-4)")
# A norm weight near 1.0 sits where one bf16 ulp is 2^-7 = 7.8e-3: a topology change flips it by
# one ulp (measured on gpt-gqa dp2 -> tp2 final_layernorm and gpt-moe-shared dp2ep2 -> dp2etp2,
# both exactly 7.8125e-3), so the bound is atol 5e-3 plus one bf16 ulp relative (rtol 2^-7). That
# also admits the one-ulp moves of an Adam step reset on such weights: in bf16 the losses bound
# (and the bitwise optimizer-state check) is what catches a reset (dp_reshardable dp2 -> dp1: losses
# 3.7e-3 vs 2e-3).
RESUME_WEIGHT_TOLERANCE_BF16 = Tolerance(atol=5e-3, rtol=2**-7, why="bf16: topology change flips bf16 weight ulps (measured max one ulp, 7.8e-3 at 1.0)")


def resume_tolerances(src: str, dst: str, dtype: str) -> tuple[Tolerance | None, Tolerance | None]:
    """(losses, final weights): bitwise when the topology is unchanged, else the dtype's bounds
    (fp32: RESUME_TOLERANCE for both)."""
    if src == dst:
        return None, None
    if dtype == "bf16":
        return RESUME_LOSS_TOLERANCE_BF16, RESUME_WEIGHT_TOLERANCE_BF16
    return RESUME_TOLERANCE, RESUME_TOLERANCE


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

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.saves <= 3:
            raise ValueError(f"option 'saves' must be 1, 2 or 3, got {self.saves}")


def _losses(outs: list[TrainOut]) -> list[float]:
    """The losses of the last pipeline stage (other stages record None)."""
    vals = [o.losses_after for o in outs if o.losses_after and o.losses_after[0] is not None]
    return vals[0] if vals else []


def _segment_losses(k: int, first: int, ref_l: list[float], res_l: list[float], src: str, dst: str, name: str, tol) -> Check:
    if len(ref_l) != k or len(res_l) != k:
        return Check(name, "failed", f"expected {k} losses, got {len(ref_l)} and {len(res_l)}")
    check = tensor_check(
        name, torch.tensor(ref_l, dtype=torch.float64), torch.tensor(res_l, dtype=torch.float64),
        f"uninterrupted@{src}", f"resumed@{dst}", "", tol,
    )
    check.detail = f"steps {first + 1}..{first + k}: uninterrupted {[round(x, 6) for x in ref_l]} resumed {[round(x, 6) for x in res_l]}"
    return check


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
            _segment_losses(k, i * k, ref_l, res_l, src, dst, f"resave-losses@{i}", loss_tol),
            state_check(f"resave-final-weights@{i}", w_ref, w_res, f"uninterrupted@{src}", f"resumed@{dst}",
                        f"{len(w_res)} weights after {(i + 1) * k} steps agree (checkpoint {i}, saved at step {i * k})",
                        weight_tol, problems=p_ref + p_res),
        ]
    return checks


class _Final:
    """One rank's final weights of later segment j, as `assembled` reads a field."""

    def __init__(self, out: TrainOut, j: int) -> None:
        self.shards = out.final_more[j] if len(out.final_more) > j else []


def judge(k: int, src: str, dst: str, reference: list[TrainOut], resumed: list[TrainOut], dtype: str = "fp32") -> list[Check]:
    """Losses and final weights of the resumed run vs the uninterrupted one; for bf16 also the
    model/main-param agreement of both jobs (recorded by the "optimizer" view: the reference's
    before its save, the resumed job's right after its load)."""
    loss_tol, weight_tol = resume_tolerances(src, dst, dtype)
    losses = _segment_losses(k, k, _losses(reference), _losses(resumed), src, dst, "losses", loss_tol)
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
                   "use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather, grad_reduce_in_fp32, lr, dtype, buckets, layer_spec reach DDP config, optimizer and model"),
        losses,
        state_check("final-weights", w_ref, w_res, f"uninterrupted@{src}", f"resumed@{dst}",
                    f"{len(w_res)} weights after {2 * k} steps agree", weight_tol, problems=p_ref + p_res),
        weights_match_main_params(sides, dtype),
    ]


class Resume(Case):
    name = "resume"
    description = "train k steps, save at S, reload at D, k more steps == the uninterrupted run"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("propagation", "losses", "final-weights", WEIGHTS_MATCH_MAIN_PARAMS, "resave-losses", "resave-final-weights",
              ASYNC_FINALIZE)
    finalizes_saves = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        untrainable(spec)
        cp_rule(spec, opts)

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        k, ckpt = opts.steps, env.case_dir / "ckpt"
        later = tuple(str(env.case_dir / f"ckpt{i}") for i in range(2, opts.saves + 1))
        model, backend = get_model(spec.model, "gpt"), ref_of(spec)
        result.notes += workaround_notes(opts, spec.source, spec.target)
        # bf16 also records model + optimizer views (the reference's at its save, the resumed job's
        # right after its load: steps_before_save is 0 there) for weights-match-main-params.
        views = ("final", "optimizer") if opts.dtype == "bf16" else ("final",)
        reference = env.launch(result, "save", train_phase, phase_of(
            model, opts, backend, topo=spec.source, save_to=str(ckpt), steps_before_save=k, steps_after=k, views=views,
            resave_to=later), spec.source)
        finalized = finalize_gate(get_backend(backend), reference, [str(ckpt), *later])
        if finalized is not None:
            result.checks.append(finalized)
            if finalized.failed:  # never resume from what was never completed
                result.checks += not_run_checks([c for c in self.checks if c != ASYNC_FINALIZE and (later or "resave" not in c)],
                                                "the checkpoint was never completed (async-finalize failed): nothing to resume from")
                return
        resumed = env.launch(result, "load", train_phase, phase_of(
            model, opts, backend, topo=spec.target, load_from=str(ckpt), first_step=k, steps_after=k, views=views,
            reload_from=later), spec.target)
        with timed(result, "compare"):
            result.checks.extend(judge(k, spec.source.id, spec.target.id, reference, resumed, opts.dtype))
            if later:
                result.checks.extend(judge_resave(k, spec.source.id, spec.target.id, reference, resumed, opts.dtype))


CASE = Resume()
