"""verl-checkpoint's restored-state checks (RNG, LR scheduler): each proves a restore only where the
state before the load differed from the saved one."""

from __future__ import annotations

from ..ranks.verl_checkpoint import VerlOut
from harness.core.parity import EXACT, NOT_COMPARED
from harness.core.result import Check

SAME_BEFORE = "the state before the load already equalled the saved one"


def rng_check(saved: list[VerlOut], loaded: list[VerlOut]) -> Check:
    """Every loaded rank's RNG digests equal those the save at its (pp, tp) carried. The loading job
    starts from a decoy (DECOY_RNG_SEED, recorded as `rng_before`): a digest that already equalled
    the saved one before the load proves nothing; if none proves anything the check is not-run."""
    if not loaded:
        return Check("rng", "failed", "nothing to judge: no rank loaded", tolerance=EXACT)
    by_coords = {o.coords: o.rng for o in saved}
    bad, vacuous, proven = [], [], 0
    for o in loaded:
        want = by_coords.get(o.coords)
        if not want:
            bad.append(f"no rank at {o.coords} saved an RNG state")
            continue
        bad += [f"{k}@(pp,tp)={o.coords}" for k in want if want[k] != o.rng.get(k)]
        same = [f"{k}@(pp,tp)={o.coords}" for k in want if o.rng_before is not None and o.rng_before.get(k) == want[k]]
        vacuous += same
        proven += len(want) - len(same)
    if bad:
        return Check("rng", "failed", f"RNG state not restored: {sorted(set(bad))}", tolerance=EXACT)
    if not proven:
        return Check("rng", "not-run", f"nothing proven: {SAME_BEFORE} ({sorted(set(vacuous))[:6]})", tolerance=EXACT)
    also = f"; {SAME_BEFORE} for {sorted(set(vacuous))[:6]}" if vacuous else ""
    return Check("rng", "passed", f"python, numpy, torch and tracker RNG restored on {len(loaded)} rank(s){also}", tolerance=EXACT)


def scheduler_check(saved: list[VerlOut], loaded: list[VerlOut]) -> Check:
    """The LR scheduler (num_steps, LR) a load restores is the one saved. megatron-core's
    OptimizerParamScheduler.load_state_dict adds the saved num_steps to the job's, so the job cannot
    start from a decoy scheduler: where the fresh one (`scheduler_before`) already equalled the saved
    one (a save before any step), the check is not-run, saying so."""
    s = next((o.scheduler for o in saved if o.scheduler is not None), None)
    if s is None:
        return Check("scheduler", "not-run", "the job has no LR scheduler", tolerance=NOT_COMPARED)
    if not loaded:
        return Check("scheduler", "failed", "nothing to judge: no rank loaded", tolerance=EXACT)
    bad = [o.scheduler for o in loaded if o.scheduler != s]
    if bad:
        return Check("scheduler", "failed", f"at S {s}, after the load {bad[0]}", tolerance=EXACT)
    if all(o.scheduler_before == s for o in loaded):
        return Check("scheduler", "not-run", f"{SAME_BEFORE}: num_steps {s['state'].get('num_steps')}, lr {s['lr']} "
                     "before and after the load", tolerance=NOT_COMPARED)
    return Check("scheduler", "passed", f"num_steps {s['state'].get('num_steps')}, lr {s['lr']} restored", tolerance=EXACT)
