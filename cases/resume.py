"""resume: train at S, save, keep training (the uninterrupted run); reload at D and train the same
steps; losses and final weights must agree.

When S == D the resumed run must be bitwise identical to the uninterrupted one. When the topology
changes, fp32 reductions happen in another order (TP splits matmuls into partial sums; DP changes
how gradients are summed across ranks; PP does not change the arithmetic), so after a few Adam
steps values differ in the last bits; RESUME_TOLERANCE bounds that, and is far below what a lost
optimizer state does (a reset Adam moves weights by ~lr per step = 1e-3).

Checks: propagation (as reshard-optimizer), losses (steps k+1..2k), final-weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends import resolve
from harness.case import Case, RunEnv, timed
from harness.checks import assembled, knob_check, state_check, tensor_check
from harness.parity import Tolerance
from harness.result import CaseResult, Check
from harness.spec import CaseSpec
from harness.training import TrainOptions, TrainOut, phase_of, train_phase, workaround_notes
from harness.zoo import get_model

RESUME_TOLERANCE = Tolerance(atol=2e-5, rtol=1e-4, why="topology change reorders fp32 reductions (TP matmul partial sums, DP grad sums)")


@dataclass(frozen=True)
class Options(TrainOptions):
    steps: int = 3


def _losses(outs: list[TrainOut]) -> list[float]:
    """The losses of the last pipeline stage (other stages record None)."""
    vals = [o.losses_after for o in outs if o.losses_after and o.losses_after[0] is not None]
    return vals[0] if vals else []


def judge(k: int, src: str, dst: str, reference: list[TrainOut], resumed: list[TrainOut]) -> list[Check]:
    tol = None if src == dst else RESUME_TOLERANCE
    ref_l, res_l = _losses(reference), _losses(resumed)
    if len(ref_l) != k or len(res_l) != k:
        losses = Check("losses", "failed", f"expected {k} losses, got {len(ref_l)} and {len(res_l)}")
    else:
        losses = tensor_check(
            "losses", torch.tensor(ref_l, dtype=torch.float64), torch.tensor(res_l, dtype=torch.float64),
            f"uninterrupted@{src}", f"resumed@{dst}", "", tol,
        )
        losses.detail = f"steps {k + 1}..{2 * k}: uninterrupted {[round(x, 6) for x in ref_l]} resumed {[round(x, 6) for x in res_l]}"
    w_ref, p_ref = assembled(reference, "final_shards", src)
    w_res, p_res = assembled(resumed, "final_shards", dst)
    return [
        knob_check("propagation", [(src, [o.propagation for o in reference]), (dst, [o.propagation for o in resumed])],
                   "use_distributed_optimizer, overlap_grad_reduce, grad_reduce_in_fp32, lr reach DDP config and optimizer"),
        losses,
        state_check("final-weights", w_ref, w_res, f"uninterrupted@{src}", f"resumed@{dst}",
                    f"{len(w_res)} weights after {2 * k} steps agree", tol, problems=p_ref + p_res),
    ]


class Resume(Case):
    name = "resume"
    description = "train k steps, save at S, reload at D, k more steps == the uninterrupted run"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("propagation", "losses", "final-weights")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        k, ckpt = opts.steps, env.case_dir / "ckpt"
        model, backend = get_model(spec.model, "gpt"), resolve(spec.backend)
        result.notes += workaround_notes(opts)
        reference = env.launch(result, "save", train_phase, phase_of(
            model, opts, backend, topo=spec.source, save_to=str(ckpt), steps_before_save=k, steps_after=k, views=("final",)), spec.source)
        resumed = env.launch(result, "load", train_phase, phase_of(
            model, opts, backend, topo=spec.target, load_from=str(ckpt), first_step=k, steps_after=k, views=("final",)), spec.target)
        with timed(result, "compare"):
            result.checks.extend(judge(k, spec.source.id, spec.target.id, reference, resumed))


CASE = Resume()
