"""finetune: a job at D starts from a training checkpoint written at S as its pretrained checkpoint
(Megatron-Bridge's `checkpoint.pretrained_checkpoint`, the job's own `checkpoint.load` empty):
the weights come from it, the optimizer state, scheduler and iteration do not.

The pretrain world trains k steps at S and saves through the case's backend; then, as the
reference, the same job restarts the way a finetune starts (harness.models.training.restart:
Adam state dropped, bf16 main params reloaded from the weights, a new scheduler at step 0) and
trains k steps from step 0. The finetune world builds a job at D from another seed, starts it from
the checkpoint through the loading backend (option `load_with`, default the case's backend: a
Bridge finetune of a plain megatron-core checkpoint is `backends: [mcore_dist]`,
`load_with: bridge_training`) and trains the same k steps.

Checks:
  pretrained-weights  the weights right after the start equal the weights saved, bitwise
  fresh-start         right after the start: no Adam state, the scheduler at step 0 and the LR the
                      reference restarted with (a finetune that kept the optimizer or the schedule
                      fails, as does one that replayed the pretrain's warmup position)
  losses, lr, grad-norm, final-weights  the finetune's k steps vs the reference's: per-step losses,
                      LRs (exact) and grad norms, and the final weights (bitwise at S == D, the
                      resume case's tolerances across a topology change)
  main-params         (dtype bf16) every fp32 main param right after the start is the saved bf16 weight
                      widened to fp32, bitwise, whichever way the start reloads them: from the model
                      params, or from the loaded state dict (the loader's option
                      load_main_params_from_ckpt, Bridge's CheckpointConfig field: what that state
                      dict holds, harness.judge.main_params)
  refusal             (expect: refuse; option `pretrained`: missing, empty or foreign) the start
                      raised one of `refuse_with`; a job that starts from its random init fails.
                      The detail says whether the error names the directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .ranks.train_phase import TrainOut, phase_of, train_phase
from .contract import Case
from .shared.trajectory import grad_norm_tolerance, losses_of, resume_tolerances, schedule_checks, segment_losses
from harness.backends import get_backend, parse_ref, ref_of
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import get_model
from harness.judge.checks import assembled, refusal_check, state_check
from harness.judge.main_params import MAIN_PARAMS, main_params_check
from harness.models.training import TrainOptions, cp_rule, untrainable, workaround_notes
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of

@dataclass(frozen=True)
class Options(TrainOptions):
    steps: int = 3
    #: what `pretrained_checkpoint` names: the checkpoint the pretrain world saved; a path that does
    #: not exist; an empty directory; a checkpoint of another model (`foreign_model`)
    pretrained: Literal["saved", "missing", "empty", "foreign"] = "saved"
    foreign_model: str = "gpt-tied"
    #: the backend the finetune starts through, with its options (harness.backends.parse_ref:
    #: "bridge_training finetune=true"; default the case's backend, which writes the checkpoint)
    load_with: str = ""
    refuse_with: tuple[str, ...] = ("FileNotFoundError", "CheckpointingException")


def fresh_check(tuned: list[TrainOut], reference: list[TrainOut], dst: str) -> Check:
    """Every rank of the finetune holds no Adam state, a scheduler at step 0 and the reference's LR."""
    want = next((o.fresh for o in reference if o.fresh), None) or {}
    problems = []
    for rank, o in enumerate(tuned):
        f = o.fresh or {}
        if f.get("adam_states") or f.get("nonzero_moments") or f.get("steps"):
            problems.append(f"rank {rank}: {f.get('adam_states')} Adam state(s) with {f.get('nonzero_moments')} non-zero "
                            f"moment element(s), steps {f.get('steps')} (the optimizer state was loaded)")
        if f.get("scheduler_steps") not in (0, None) or f.get("scheduler_steps") != want.get("scheduler_steps"):
            problems.append(f"rank {rank}: scheduler at step {f.get('scheduler_steps')}, a finetune starts at "
                            f"{want.get('scheduler_steps')} (the schedule was restored)")
        if f.get("lrs") != want.get("lrs"):
            problems.append(f"rank {rank}: LR {f.get('lrs')}, the restarted reference's {want.get('lrs')}")
    if problems:
        return Check("fresh-start", "failed", "; ".join(problems[:6]), tolerance=EXACT)
    return Check("fresh-start", "passed", f"at {dst}: no Adam state, scheduler step {want.get('scheduler_steps')}, "
                 f"LR {want.get('lrs')} as the restarted reference", tolerance=EXACT)


def main_check(src: str, dst: str, reference: list[TrainOut], tuned: list[TrainOut], path: str) -> Check:
    """main-params: the finetune's fp32 main params at its start against the pretrain's saved bf16
    weights (and, in the detail only, against the pretrain's own fp32 main params at its save)."""
    if not any(o.main_shards is not None for o in tuned):
        return Check(MAIN_PARAMS, "not-run", "the finetune's optimizer is not megatron-core's distributed optimizer "
                     "(use_distributed_optimizer: false): its main params are not viewed")
    w_saved, p_saved = assembled(reference, "model_shards", f"pretrain@{src}")
    mains, p_mains = assembled(tuned, "main_shards", f"finetune@{dst}")
    saved_mains, _ = assembled(reference, "optimizer_shards", f"pretrain@{src}")
    return main_params_check(w_saved, mains, src, dst, saved_mains, path, p_saved + p_mains)


def judge(k: int, src: str, dst: str, reference: list[TrainOut], tuned: list[TrainOut], dtype: str = "fp32",
          path: str = "") -> list[Check]:
    """The finetune at `dst` against the pretrain job at `src`: weights at the start, a fresh
    optimizer and schedule, the k-step trajectory after the restart, and (bf16) the main params
    at the start, reloaded as `path` says."""
    loss_tol, weight_tol = resume_tolerances(src, dst, dtype)
    w_saved, p_saved = assembled(reference, "model_shards", f"pretrain@{src}")
    w_start, p_start = assembled(tuned, "model_shards", f"finetune@{dst}")
    w_ref, p_ref = assembled(reference, "final_shards", src)
    w_end, p_end = assembled(tuned, "final_shards", dst)
    return [
        state_check("pretrained-weights", w_saved, w_start, f"saved@{src}", f"finetune-start@{dst}",
                    f"{len(w_start)} weights at the finetune's start equal those saved", problems=p_saved + p_start),
        fresh_check(tuned, reference, dst),
        segment_losses(k, 0, losses_of(reference), losses_of(tuned), src, dst, "losses", loss_tol, ("restarted", "finetune")),
        *schedule_checks(k, 0, reference, tuned, src, dst, grad_norm_tolerance(src, dst, dtype), ("restarted", "finetune")),
        state_check("final-weights", w_ref, w_end, f"restarted@{src}", f"finetune@{dst}",
                    f"{len(w_end)} weights after {k} finetune steps agree", weight_tol, problems=p_ref + p_end),
        *([main_check(src, dst, reference, tuned, path)] if dtype == "bf16" else []),
    ]


class Finetune(Case):
    name = "finetune"
    description = "train at S, save; a finetune at D starts from its weights only (pretrained_checkpoint)"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("pretrained-weights", "fresh-start", "losses", "lr", "grad-norm", "final-weights", MAIN_PARAMS, "refusal")
    refusable = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        untrainable(spec)
        cp_rule(spec, opts)
        loader = get_backend(parse_ref(opts.load_with) if opts.load_with else ref_of(spec))
        if "finetune" not in loader.capabilities:
            raise ValueError(f"case finetune starts through backend {opts.load_with or spec.backend!r}, which cannot start a job "
                             "from a pretrained checkpoint (capability finetune); name one that can with option 'load_with'")
        if opts.pretrained != "saved" and spec.expect != "refuse":
            raise ValueError(f"option pretrained: {opts.pretrained} names no usable checkpoint: it goes with expect: refuse")
        if opts.pretrained == "foreign":
            get_model(opts.foreign_model, "gpt")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        k, pre, own = opts.steps, env.case_dir / "pretrained", env.case_dir / "finetune-run"
        model, saver = get_model(spec.model, "gpt"), ref_of(spec)
        loader = parse_ref(opts.load_with) if opts.load_with else saver
        result.notes += workaround_notes(opts, spec.source, spec.target)
        mains = opts.dtype == "bf16" and opts.use_distributed_optimizer  # main-params: both jobs' main params viewed
        reference: list[TrainOut] = []
        if opts.pretrained in ("saved", "foreign"):
            saved = opts.pretrained == "saved"
            reference = env.launch("pretrain", train_phase, phase_of(
                model if saved else get_model(opts.foreign_model, "gpt"), opts, saver, topo=spec.source, save_to=str(pre),
                steps_before_save=k, steps_after=k if saved else 0, restart_after_save=saved,
                views=("weights", "fresh", "final") + (("optimizer",) if mains and saved else ())), spec.source)
        elif opts.pretrained == "empty":
            pre.mkdir(parents=True)
        try:
            tuned = env.launch("finetune", train_phase, phase_of(
                model, opts, loader, topo=spec.target, pretrained_from=str(pre), run_dir=str(own), steps_after=k,
                views=("weights", "fresh", "final") + (("main",) if mains else ())), spec.target)
            error = None
        except WorldError as exc:
            tuned, error = [], exc
        if spec.expect == "refuse":
            exc_type, message = exception_of(error.rank_traceback or str(error)) if error else (None, "")
            check = refusal_check(exc_type, message, opts.refuse_with, f"pretrained_checkpoint {opts.pretrained}")
            if exc_type is not None:
                check.detail += "; the error names the directory" if str(pre) in message else "; the error does not name the directory"
            result.checks.append(check)
            return
        if error is not None:
            raise error
        with env.timed("compare"):
            from_sd = getattr(get_backend(loader).options, "load_main_params_from_ckpt", False)
            path = (" (load_main_params_from_ckpt: reload_model_params(state_dict), the loaded model section)" if from_sd
                    else " (reload_model_params(): from the loaded model params)")
            result.checks.extend(judge(k, spec.source.id, spec.target.id, reference, tuned, opts.dtype, path))


CASE = Finetune()
