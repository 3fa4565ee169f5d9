"""A resumed or restarted job's trajectory against the run it must reproduce: the per-step losses
of the last pipeline stage and the tolerances a topology change allows (the resume and finetune
cases share them)."""

from __future__ import annotations

import torch

from ..ranks.train_phase import TrainOut
from harness.core.parity import Tolerance
from harness.core.result import Check
from harness.judge.checks import tensor_check

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


# Each step's global grad norm: fp32 takes RESUME_TOLERANCE. bf16 reduces bf16 grads in another order
# after a topology change: measured over the resume cases' bf16 TP/DP/PP changes (smoke, nightly-GPU
# on CPU) max |diff| 6.0e-3 on norms ~3 (tp1pp1dp4 -> tp2pp2dp1; tp2 -> pp2: 4.6e-3); what a reset
# or shared Adam step does in fp32 is 1.0e-2 to 5.1e-2 (dp_reshardable, buckets), a lost optimizer
# state 2 to 76. The bound is 1.7x the measured max; as for the losses, the bitwise optimizer-state
# checks carry the proof in bf16.
GRAD_NORM_TOLERANCE_BF16 = Tolerance(atol=1e-2, rtol=0.0, why="bf16: topology change reorders bf16 grad reductions (measured max 6.0e-3)")


def grad_norm_tolerance(src: str, dst: str, dtype: str) -> Tolerance | None:
    """Bitwise when the topology is unchanged, else RESUME_TOLERANCE (fp32) or GRAD_NORM_TOLERANCE_BF16."""
    if src == dst:
        return None
    return GRAD_NORM_TOLERANCE_BF16 if dtype == "bf16" else RESUME_TOLERANCE


def losses_of(outs: list[TrainOut]) -> list[float]:
    """The losses of the last pipeline stage (other stages record None)."""
    vals = [o.losses_after for o in outs if o.losses_after and o.losses_after[0] is not None]
    return vals[0] if vals else []


def segment_losses(k: int, first: int, ref_l: list[float], res_l: list[float], src: str, dst: str, name: str, tol,
                   labels: tuple[str, str] = ("uninterrupted", "resumed")) -> Check:
    """Steps first+1..first+k of the reference (`labels[0]`) and the job under test (`labels[1]`)."""
    if len(ref_l) != k or len(res_l) != k:
        return Check(name, "failed", f"expected {k} losses, got {len(ref_l)} and {len(res_l)}")
    check = tensor_check(
        name, torch.tensor(ref_l, dtype=torch.float64), torch.tensor(res_l, dtype=torch.float64),
        f"{labels[0]}@{src}", f"{labels[1]}@{dst}", "", tol,
    )
    check.detail = (f"steps {first + 1}..{first + k}: {labels[0]} {[round(x, 6) for x in ref_l]} "
                    f"{labels[1]} {[round(x, 6) for x in res_l]}")
    return check


def _trace(outs: list[TrainOut]) -> list[dict]:
    """The per-step trace of the first rank that recorded one (LR and the global grad norm are the
    same on every rank: megatron reduces the norm over the model-parallel group)."""
    return next((o.trace_after for o in outs if o.trace_after), [])


def schedule_checks(k: int, first: int, reference: list[TrainOut], tested: list[TrainOut], src: str, dst: str, tol,
                    labels: tuple[str, str] = ("uninterrupted", "resumed")) -> list[Check]:
    """`lr`: the LR of each of the k steps, exactly (a pure function of the scheduler's step: a
    scheduler saved but not restored replays the warmup); `grad-norm`: each step's global grad
    norm within `tol` (grad_norm_tolerance: None is bitwise)."""
    from harness.core.parity import EXACT

    ref, got = _trace(reference), _trace(tested)
    steps = f"steps {first + 1}..{first + k}"
    if len(ref) != k or len(got) != k:
        why = f"expected {k} traced steps, got {len(ref)} ({labels[0]}) and {len(got)} ({labels[1]})"
        return [Check("lr", "failed", why, tolerance=EXACT), Check("grad-norm", "failed", why)]
    lrs = [t["lr"] for t in ref], [t["lr"] for t in got]
    lr = Check("lr", "passed" if lrs[0] == lrs[1] else "failed",
               f"{steps}: {labels[0]} {lrs[0]} {labels[1]} {lrs[1]}", tolerance=EXACT)
    norms = [t["grad_norm"] for t in ref], [t["grad_norm"] for t in got]
    if None in norms[0] + norms[1]:
        return [lr, Check("grad-norm", "not-run", "the optimizer computed no grad norm (clip_grad 0)")]
    norm = tensor_check("grad-norm", torch.tensor(norms[0], dtype=torch.float64), torch.tensor(norms[1], dtype=torch.float64),
                        f"{labels[0]}@{src}", f"{labels[1]}@{dst}", "", tol)
    norm.detail = f"{steps}: {labels[0]} {[round(x, 6) for x in norms[0]]} {labels[1]} {[round(x, 6) for x in norms[1]]}"
    return [lr, norm]
