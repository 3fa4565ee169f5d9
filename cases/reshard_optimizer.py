"""reshard-optimizer: a training checkpoint (model + megatron optimizer) saved at S, loaded at D.

Checks:
  propagation      every knob the case asked (use_distributed_optimizer, overlap, grad dtype, lr)
                   is what the built DDP config and optimizer use, at S and at D (verl PR #5775)
  optimizer-state  fp32 main params, exp_avg, exp_avg_sq per parameter, assembled to full shape
                   in megatron's model-space form, bitwise equal at D and at S
  step             the optimizer step at D equals the step at S (a reset to 0 is a defect)
  model-weights    the trained weights loaded at D equal those saved at S, bitwise
  refusal          (expect: refuse) the load raised one of `refuse_with`, with its message;
                   a silent load fails, and so does a refusal through an obscure exception
"""

from __future__ import annotations

from typing import Any

from cases._training import DEFAULT_WORKAROUNDS, WORKAROUNDS, TrainPhase, train_phase
from cases.reshard_weights import record_memory, state_check
from harness import models
from harness.case import Case, RunEnv, timed
from harness.matrix import CaseSpec
from harness.parity import assemble, compare_state
from harness.result import CaseResult, Check
from harness.training import SHARDING_TYPES, TrainConfig
from harness.world import WorldError, exception_of

_OWN_OPTIONS = {"sharding", "mem_efficient", "steps", "workarounds", "refuse_with"}


def validate_training_options(case: Case, spec: CaseSpec) -> None:
    case.check_model_kind(spec)
    opts = spec.opts
    unknown = set(opts) - _OWN_OPTIONS - TrainConfig.option_names()
    if unknown:
        raise ValueError(f"case {case.name}: unknown option(s) {sorted(unknown)}")
    if opts.get("sharding", "dp_reshardable") not in SHARDING_TYPES:
        raise ValueError(f"sharding must be one of {SHARDING_TYPES}, got {opts.get('sharding')!r}")
    bad = set(opts.get("workarounds", DEFAULT_WORKAROUNDS)) - set(WORKAROUNDS)
    if bad:
        raise ValueError(f"unknown workaround(s) {sorted(bad)}; known: {sorted(WORKAROUNDS)}")
    if spec.backend != "mcore_dist":
        raise ValueError(f"case {case.name} needs a backend that saves training state (mcore_dist), got {spec.backend}")


def phase_args(spec: CaseSpec) -> dict[str, Any]:
    opts = spec.opts
    return dict(
        model=models.get_model(spec.model),
        cfg=TrainConfig.from_options(opts),
        backend=spec.backend,
        sharding=opts.get("sharding", "dp_reshardable"),
        mem_efficient=bool(opts.get("mem_efficient", False)),
        workarounds=tuple(opts.get("workarounds", DEFAULT_WORKAROUNDS)),
    )


def propagation_check(*outs_by_side: tuple[str, list[dict]]) -> Check:
    bad = [
        f"{side} rank {r}: {p['knob']} asked {p['asked']!r}, built {p['actual']!r}"
        for side, outs in outs_by_side
        for r, o in enumerate(outs)
        for p in o["propagation"]
        if not p["ok"]
    ]
    knobs = sorted({p["knob"] for _, outs in outs_by_side for o in outs for p in o["propagation"]})
    if bad:
        return Check("propagation", "failed", "; ".join(bad[:6]), tolerance="exact")
    return Check("propagation", "passed", f"{', '.join(knobs)} reach DDP config and optimizer", tolerance="exact")


def refusal_check(exc: WorldError | None, allowed: list[str], spec: CaseSpec) -> Check:
    change = f"{spec.source.id} -> {spec.target.id}"
    meaning = ""
    if spec.opts.get("sharding", "dp_reshardable") == "dp_reshardable" and (
        (spec.source.tp, spec.source.pp) != (spec.target.tp, spec.target.pp)
    ):
        meaning = " (meaning: a dp_reshardable optimizer checkpoint can change DP only; a TP/PP change needs fully_reshardable)"
    if exc is None:
        return Check("refusal", "failed", f"the load across {change} was expected to refuse but completed{meaning}")
    exc_type, message = exception_of(exc.rank_traceback or str(exc))
    first = message.splitlines()[0][:240] if message else ""
    if exc_type in allowed:
        return Check("refusal", "passed", f"refused across {change}: {exc_type}: {first}{meaning}", tolerance="-")
    return Check(
        "refusal", "failed",
        f"refused across {change}, but with {exc_type or 'an unrecognised error'}: {first!r}; not one of {allowed}, "
        "so a user gets no clear reason",
        tolerance="-",
    )


def step_check(saved: list[dict], loaded: list[dict], spec: CaseSpec) -> Check:
    steps_s = sorted({x for o in saved for x in o["steps"]["values"]})
    steps_d = sorted({x for o in loaded for x in o["steps"]["values"]})
    shared = sum(o["steps"]["shared_step_tensors"] for o in loaded)
    detail = f"step at {spec.source.id}: {steps_s}, at {spec.target.id}: {steps_d}"
    if shared:
        detail += f"; {shared} param(s) share another param's Adam step tensor after the load (each step then advances it once per param)"
    ok = steps_s == steps_d and bool(steps_s) and not shared
    return Check("step", "passed" if ok else "failed", detail, tolerance="exact")


class ReshardOptimizer(Case):
    name = "reshard-optimizer"
    description = "model + optimizer checkpoint saved at S, loaded at D: optimizer state bitwise, step kept"

    def validate(self, spec: CaseSpec) -> None:
        validate_training_options(self, spec)

    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        args = phase_args(spec)
        steps = int(spec.opts.get("steps", 2))
        ckpt = env.case_dir / "ckpt"
        result.notes += [f"workaround applied: {w}: {WORKAROUNDS[w]}" for w in args["workarounds"]]
        saved = env.launch(
            result, "save", train_phase, TrainPhase(topo=spec.source, save_to=str(ckpt), steps_before_save=steps, **args),
            spec.source.world_size,
        )
        result.compat_shims = saved[0]["compat"]
        record_memory(result, "save", saved)
        try:
            loaded = env.launch(
                result, "load", train_phase, TrainPhase(topo=spec.target, load_from=str(ckpt), first_step=steps, **args),
                spec.target.world_size,
            )
            error = None
        except WorldError as exc:
            loaded, error = None, exc
        if spec.expect == "refuse":
            result.checks.append(refusal_check(error, list(spec.opts.get("refuse_with", ["CheckpointingException"])), spec))
            if loaded is None:
                return
        elif error is not None:
            raise error
        record_memory(result, "load", loaded)
        with timed(result, "compare"):
            result.checks.append(propagation_check((spec.source.id, saved), (spec.target.id, loaded)))
            opt_s, p_s = assemble((s for o in saved for s in o["optimizer_shards"]), spec.source.id)
            opt_d, p_d = assemble((s for o in loaded for s in o["optimizer_shards"]), spec.target.id)
            result.checks.append(
                state_check(
                    "optimizer-state", p_s + p_d + compare_state(opt_s, opt_d, spec.source.id, spec.target.id),
                    f"{len(opt_d)} optimizer tensors (param, exp_avg, exp_avg_sq) equal",
                )
            )
            result.checks.append(step_check(saved, loaded, spec))
            w_s, q_s = assemble((s for o in saved for s in o["model_shards"]), spec.source.id)
            w_d, q_d = assemble((s for o in loaded for s in o["model_shards"]), spec.target.id)
            result.checks.append(
                state_check("model-weights", q_s + q_d + compare_state(w_s, w_d, spec.source.id, spec.target.id),
                            f"{len(w_d)} trained weights equal")
            )


CASE = ReshardOptimizer()
