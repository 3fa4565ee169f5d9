"""reshard-optimizer: a training checkpoint (model + megatron optimizer) saved at S, loaded at D.

Checks:
  propagation      every knob the case asked (use_distributed_optimizer, optimizer type, overlap,
                   grad dtype, lr) is what the built DDP config and optimizer use, at S and at D
                   (verl PR #5775)
  optimizer-state  fp32 main params, exp_avg, exp_avg_sq (Muon: momentum_buffer) per parameter, assembled to full shape
                   in megatron's model-space form, bitwise equal at D and at S
  step             the optimizer step at D equals the step at S (a reset to 0 is a defect), and
                   no two params share one Adam step tensor
  model-weights    the trained weights loaded at D equal those saved at S, bitwise
  weights-match-main-params
                   (dtype bf16) every bf16 model weight equals its fp32 main param cast to bf16,
                   bitwise, at S before the save and at D after the load: a load that restores
                   one copy and not the other is a classic silent bug; not-run for fp32 (no split)
  refusal          (expect: refuse) the load raised one of `refuse_with`, with its message;
                   a silent load fails, and so does a refusal through an obscure exception
  optimizer-absent (save_optim: false) the job saved without its optimizer state and the load asks for
                   it (Megatron-Bridge #5706): the load must refuse with an error naming the optimizer
                   state; one that completes (fresh optimizer state under a resumed job) or crashes on a
                   bare KeyError fails (harness.judge.optimizer_absent)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .ranks.train_phase import TrainOut, phase_of, step_check, train_phase
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec, get_model
from harness.judge.checks import (
    ASYNC_FINALIZE,
    WEIGHTS_MATCH_MAIN_PARAMS,
    assembled,
    finalize_gate,
    knob_check,
    not_run_checks,
    refusal_check,
    state_check,
    weights_match_main_params,
)
from harness.models.training import (
    TrainOptions,
    cp_rule,
    knobs_reached,
    state_kinds,
    untrainable,
    workaround_notes,
)
from harness.judge.chunk_metadata import DP_SLICES, EXPERT_CHUNKS, metadata_checks
from harness.judge.optimizer_absent import OPTIMIZER_ABSENT, optimizer_absent_check
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of


@dataclass(frozen=True)
class Options(TrainOptions):
    steps: int = 2
    refuse_with: tuple[str, ...] = ("CheckpointingException",)
    #: false: the save leaves the optimizer state out (Megatron-LM --no-save-optim, Bridge
    #: CheckpointConfig.save_optim) while the load still asks for it: check optimizer-absent only
    save_optim: bool = True
    #: true: judge the saved torch_dist `.metadata` too (harness.judge.chunk_metadata: expert-chunks for
    #: an MoE model, dp-slices for dp_reshardable; docs/user-reports.md, Megatron-LM #7162, vime #139)
    ckpt_metadata: bool = False


def refusal_meaning(spec: CaseSpec, opts: TrainOptions) -> str:
    """What a dp_reshardable refusal means: its optimizer state is one flat buffer per DDP bucket of
    each model chunk (keyed by chunk buffer index, sharded by DP rank), laid out by the TP/PP/EP/ETP/VPP split."""
    src, dst = spec.source, spec.target
    if opts.sharding == "dp_zero_gather_scatter":  # gathered on each DP group's rank 0, one object per TP x PP rank
        same = (src.tp, src.pp, src.ep, src.etp, src.vpp) == (dst.tp, dst.pp, dst.ep, dst.etp, dst.vpp)
        return "" if same else ("a dp_zero_gather_scatter optimizer checkpoint (deprecated upstream) holds one object per "
                                "TP/PP/EP rank's DP group: it can change DP only")
    if opts.sharding != "dp_reshardable":
        return ""
    layout = lambda t: (t.tp, t.pp, t.ep, t.etp)  # noqa: E731
    vpp = " and VPP" if src.vpp != dst.vpp else ""
    if layout(src) != layout(dst):
        return f"a dp_reshardable optimizer checkpoint can change DP only; a TP/PP/EP/ETP{vpp} change needs fully_reshardable"
    if vpp:
        return ("a dp_reshardable optimizer checkpoint can change DP only; a VPP change at the same PP regroups the layers "
                "into other model chunks, each with its own DDP buffers (what dp_reshardable saves), and needs fully_reshardable")
    return ""


def judge(src: str, dst: str, saved: list[TrainOut], loaded: list[TrainOut], dtype: str = "fp32") -> list[Check]:
    """The checks from both jobs' optimizer views. bf16: the optimizer state holds the fp32 main
    params (`optimizer.state.fp32_param.*`), compared bitwise like the moments, and the model
    weights compare as bf16 bytes."""
    opt_s, p_s = assembled(saved, "optimizer_shards", src)
    opt_d, p_d = assembled(loaded, "optimizer_shards", dst)
    w_s, q_s = assembled(saved, "model_shards", src)
    w_d, q_d = assembled(loaded, "model_shards", dst)
    return [
        knob_check("propagation", [(src, [o.propagation for o in saved]), (dst, [o.propagation for o in loaded])],
                   knobs_reached(o.propagation for o in (*saved, *loaded))),
        state_check("optimizer-state", opt_s, opt_d, src, dst, f"{len(opt_d)} optimizer tensors ({state_kinds(opt_d)}) equal",
                    problems=p_s + p_d),
        step_check(saved, loaded, src, dst),
        state_check("model-weights", w_s, w_d, src, dst, f"{len(w_d)} trained weights equal", problems=q_s + q_d),
        weights_match_main_params([(src, w_s, opt_s), (dst, w_d, opt_d)], dtype),
    ]


# --------------------------------------------------------------------------- the public steps
# What ReshardOptimizer.run runs, one world each; the golden corpus (harness.gate.golden) runs them
# too, on training checkpoints another environment wrote.


def save_step(env: RunEnv, result: CaseResult, model: ModelSpec, opts: TrainOptions, backend: BackendRef, topo: Topology,
              save_to: Path, steps: int) -> list[TrainOut]:
    """World "save" at `topo`: build the training job of `opts` (DDP, optimizer, sharding,
    workarounds), train `steps` steps, save model + optimizer through `backend` into `save_to`.
    Each rank's TrainOut: knob propagation, optimizer and model shards, the Adam step values."""
    return env.launch("save", train_phase, save_phase(model, opts, backend, topo, save_to, steps), topo)


def save_phase(model: ModelSpec, opts: TrainOptions, backend: BackendRef, topo: Topology, save_to: Path, steps: int):
    """What save_step's world runs (ReshardOptimizer.run hands it to RunEnv.launch_source)."""
    return phase_of(model, opts, backend, topo=topo, save_to=str(save_to), steps_before_save=steps,
                    save_optim=getattr(opts, "save_optim", True))


def load_step(env: RunEnv, result: CaseResult, model: ModelSpec, opts: TrainOptions, backend: BackendRef, topo: Topology,
              load_from: Path, first_step: int) -> list[TrainOut]:
    """World "load" at `topo`: build the same job fresh, load `load_from` through `backend` (the
    training then would go on at `first_step`). Each rank's TrainOut as loaded. A load that raises
    fails the world (harness.run.world.WorldError)."""
    return env.launch("load", train_phase,
                      phase_of(model, opts, backend, topo=topo, load_from=str(load_from), first_step=first_step), topo)


def absent_check(error: WorldError | None, loaded: list[TrainOut] | None, change: str):
    """optimizer-absent from the load world's outcome: its error (exception, message, the upstream
    frame it was raised in), or, when it completed, the Adam step values the job then held."""
    from harness.core.frames import raising_frame

    if error is None:
        return optimizer_absent_check(None, "", change, fresh=f"Adam step values after the load: {step_values(loaded or [])}")
    text = error.rank_traceback or str(error)
    exc_type, message = exception_of(text)
    return optimizer_absent_check(exc_type or None, message, change, str(raising_frame(text) or ""))


def step_values(outs: Sequence[TrainOut]) -> list[float]:
    """The distinct Adam step values the ranks of a world hold: as the load left them where the world
    loaded (what `step_check` judges, before the harness settled a never-loaded step)."""
    return sorted({x for o in outs for x in (o.steps_as_loaded or o.steps)["values"]})


def written_steps(values: Sequence[float]) -> list[TrainOut]:
    """A saved side for `step_check` from the step values a writer recorded (the golden corpus keeps
    them in its manifest)."""
    return [TrainOut([], [], [], steps={"values": list(values), "shared_step_tensors": 0})]


class ReshardOptimizer(Case):
    name = "reshard-optimizer"
    description = "model + optimizer checkpoint saved at S, loaded at D: optimizer state bitwise, step kept"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("propagation", "optimizer-state", "step", "model-weights", WEIGHTS_MATCH_MAIN_PARAMS, "refusal", OPTIMIZER_ABSENT,
              ASYNC_FINALIZE, EXPERT_CHUNKS, DP_SLICES)
    refusable = True
    finalizes_saves = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        if spec.expect != "refuse" and "refuse_with" in spec.opts:
            raise ValueError("option 'refuse_with' only means something with expect: refuse")
        if not opts.save_optim and spec.expect == "refuse":
            raise ValueError("option 'save_optim: false' judges the refusal itself (check optimizer-absent): drop expect: refuse")
        untrainable(spec)
        cp_rule(spec, opts)

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        src, dst = spec.source.id, spec.target.id
        model, backend = get_model(spec.model, "gpt"), ref_of(spec)
        result.notes += workaround_notes(opts, spec.source, spec.target)
        # the training at S and its save are the same for every target: once per run (harness.run.reuse)
        root, saved = env.launch_source("save", train_phase, lambda d: save_phase(
            model, opts, backend, spec.source, d / "ckpt", opts.steps), spec.source)
        ckpt = root / "ckpt"
        finalized = finalize_gate(get_backend(backend), saved, [str(ckpt)])
        if finalized is not None:
            result.checks.append(finalized)
            if finalized.failed:  # never load what was never completed
                result.checks += not_run_checks([c for c in self.checks if c not in (ASYNC_FINALIZE, "refusal")],
                                                "the checkpoint was never completed (async-finalize failed): nothing to load")
                return
        if opts.ckpt_metadata:  # read before any load: what the save wrote, whatever the load then does
            result.checks += metadata_checks(ckpt, model.num_moe_experts, opts.sharding)
        try:
            loaded = load_step(env, result, model, opts, backend, spec.target, ckpt, opts.steps)
            error = None
        except WorldError as exc:
            loaded, error = None, exc
        if not opts.save_optim:
            result.checks.append(absent_check(error, loaded, f"{src} -> {dst}"))
            result.checks += not_run_checks([c for c in self.checks if c not in (ASYNC_FINALIZE, "refusal", OPTIMIZER_ABSENT)],
                                            "saved with save_optim: false: only whether the load refuses is judged")
            return
        if spec.expect == "refuse":
            exc_type, message = exception_of(error.rank_traceback or str(error)) if error else (None, "")
            result.checks.append(refusal_check(exc_type, message, opts.refuse_with, f"{src} -> {dst}", refusal_meaning(spec, opts)))
            if loaded is None:
                return
        elif error is not None:
            raise error
        with env.timed("compare"):
            result.checks.extend(judge(src, dst, saved, loaded, opts.dtype))


CASE = ReshardOptimizer()
