"""resume: train at S, save, keep training (the uninterrupted run); reload at D and train the same
steps; losses and final weights must agree.

When S == D the resumed run must be bitwise identical to the uninterrupted one. When the topology
changes, fp32 reductions happen in another order (TP splits matmuls into partial sums; DP changes
how gradients are summed across ranks; PP does not change the arithmetic), so after a few Adam
steps values differ in the last bits; RESUME_TOLERANCE bounds that, and is far below what a lost
optimizer state does (a reset Adam moves weights by ~lr per step = 1e-3).
"""

from __future__ import annotations

from cases._training import WORKAROUNDS, TrainPhase, train_phase
from cases.reshard_optimizer import phase_args, propagation_check, validate_training_options
from cases.reshard_weights import record_memory, state_check
from harness.case import Case, RunEnv, timed
from harness.matrix import CaseSpec
from harness.parity import Tolerance, assemble, compare_state, compare_tensors
from harness.result import CaseResult, Check

RESUME_TOLERANCE = Tolerance(atol=2e-5, rtol=1e-4, why="topology change reorders fp32 reductions (TP matmul partial sums, DP grad sums)")


def _losses(outs: list[dict], key: str) -> list[float]:
    vals = [o[key] for o in outs if o[key] and o[key][0] is not None]
    return vals[0] if vals else []


class Resume(Case):
    name = "resume"
    description = "train k steps, save at S, reload at D, k more steps == the uninterrupted run"

    def validate(self, spec: CaseSpec) -> None:
        validate_training_options(self, spec)

    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        import torch

        args = phase_args(spec)
        k = int(spec.opts.get("steps", 3))
        ckpt = env.case_dir / "ckpt"
        result.notes += [f"workaround applied: {w}: {WORKAROUNDS[w]}" for w in args["workarounds"]]
        reference = env.launch(
            result, "save", train_phase,
            TrainPhase(topo=spec.source, save_to=str(ckpt), steps_before_save=k, steps_after=k, views=("final",), **args),
            spec.source.world_size,
        )
        result.compat_shims = reference[0]["compat"]
        record_memory(result, "save", reference)
        resumed = env.launch(
            result, "load", train_phase,
            TrainPhase(topo=spec.target, load_from=str(ckpt), first_step=k, steps_after=k, views=("final",), **args),
            spec.target.world_size,
        )
        record_memory(result, "load", resumed)
        same_topology = spec.source == spec.target
        tol = None if same_topology else RESUME_TOLERANCE
        label = "bitwise" if tol is None else str(tol)
        with timed(result, "compare"):
            result.checks.append(propagation_check((spec.source.id, reference), (spec.target.id, resumed)))
            ref_l, res_l = _losses(reference, "losses_after"), _losses(resumed, "losses_after")
            if len(ref_l) != k or len(res_l) != k:
                result.checks.append(Check("losses", "failed", f"expected {k} losses, got {len(ref_l)} and {len(res_l)}"))
            else:
                a, b = torch.tensor(ref_l, dtype=torch.float64), torch.tensor(res_l, dtype=torch.float64)
                m = compare_tensors("loss", a, b, f"uninterrupted@{spec.source.id}", f"resumed@{spec.target.id}", tol)
                diff = float((a - b).abs().max())
                detail = f"steps {k + 1}..{2 * k}: uninterrupted {[round(x, 6) for x in ref_l]} resumed {[round(x, 6) for x in res_l]}"
                result.checks.append(Check("losses", "failed" if m else "passed", detail, diff, label, [m] if m else []))
            w_ref, p_ref = assemble((s for o in reference for s in o["final_shards"]), spec.source.id)
            w_res, p_res = assemble((s for o in resumed for s in o["final_shards"]), spec.target.id)
            mism = p_ref + p_res + compare_state(w_ref, w_res, f"uninterrupted@{spec.source.id}", f"resumed@{spec.target.id}", tol)
            check = state_check("final-weights", mism, f"{len(w_res)} weights after {2 * k} steps agree", label)
            if not mism:
                check.max_abs_diff = max((float((w_ref[key].double() - w_res[key].double()).abs().max()) for key in w_ref), default=0.0)
            result.checks.append(check)


CASE = Resume()
