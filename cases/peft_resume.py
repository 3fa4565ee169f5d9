"""peft-resume: a LoRA run's adapter-only training checkpoint, resumed at D on top of its base, then
exported as an HF PEFT adapter (issue 19: what a Megatron-Bridge LoRA finetune keeps on disk).

World "save" at S: the HF fixture's Bridge model (provider, base weights) with adapters (truth
values), the base frozen, megatron DDP + optimizer over the adapters; k steps; the job saved through
the case's backend (bridge_training writes what a LoRA recipe writes: `cfg.peft` set, the adapter
tensors and their optimizer state only, `pretrained_checkpoint` the HF base); the HF PEFT adapter
exported (bridge_peft) right after the save; k more steps (the uninterrupted run), exported again.
World "load" at D: the model built as the backend's client builds a resumed LoRA job, no HF weights
asked (bridge_training: Bridge's own PEFT pre-wrap hook loads the base from `pretrained_checkpoint`
and applies the adapters), other (decoy) adapters; the backend's load_training (Bridge: the
PEFT-resume path, adapters only); the adapter exported right after the load; k steps; exported again.

Checks:
  adapter-only       the checkpoint holds adapter tensors only (and at least one): no base key
  adapters-restored  the adapter exported right after the load equals the one exported at the save, bitwise
  base-restored      the base right after the load equals the base the save world trained over (the fixture), bitwise
  frozen-base        each job's base weights after its k steps equal those before them, bitwise
  losses, lr, grad-norm  the resumed steps against the uninterrupted run's (resume's rules)
  final-adapters     the two final adapter exports agree (bitwise at S == D, else RESUME_TOLERANCE)
  peft-load          peft loads the resumed job's final export over the HF fixture, as users do
  lora-targets-matched, lora-targets-asked  per target entry of the layout, the HF modules peft wraps
                     over the resumed job's final export equal those the saved job's Megatron LoRA
                     wrapped, and those the entry selects (cases.shared.lora_layout; peft-export's checks)
  export-integrity   every adapter export is one adapter_model.safetensors with the save-time export's keys, shapes, dtypes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ranks.bridge_job import BridgeJobOptions, base_shards, bridge_job
from .shared.lora_layout import megatron_units, targets_checks
from .shared.peft import PeftOptions, peft_load_problems, peft_wrapped
from .ranks.train_phase import TrainOut
from .shared.trajectory import grad_norm_tolerance, losses_of, resume_tolerances, schedule_checks, segment_losses
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of, resolve
from harness.core.context import RankContext
from harness.core.parity import EXACT, Shard
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import assembled, state_check
from harness.judge.hf_integrity import ADAPTER_WEIGHTS, Expected, export_integrity, source_infos
from harness.models import bridge as mb
from harness.models import peft_mapping
from harness.run.envelope import RunEnv

CHECKS = ("adapter-only", "adapters-restored", "base-restored", "frozen-base", "losses", "lr", "grad-norm", "final-adapters", "peft-load",
          "export-integrity", "lora-targets-matched", "lora-targets-asked")


@dataclass(frozen=True)
class Options(PeftOptions, BridgeJobOptions):
    def __post_init__(self) -> None:
        if self.dtype != "fp32":
            raise ValueError("peft-resume builds the Bridge model fp32 (harness.models.bridge)")


@dataclass(frozen=True)
class _Phase:
    model: HFModelSpec
    hf_dir: str
    topo: Topology
    adapter: mb.AdapterSpec
    opts: Options
    backend: BackendRef
    ckpt: str
    out: str
    load: bool


@dataclass
class _Out(TrainOut):
    base_before: list[Shard] = field(default_factory=list)
    base_after: list[Shard] = field(default_factory=list)
    pieces: list[dict] = field(default_factory=list)  # the save world's adapter tensors (harness.models.bridge.adapter_pieces)


def _rank(ctx: RankContext, p: _Phase) -> _Out:
    from harness.compat.registry import defaults
    from harness.models import training

    bm, job = bridge_job(p.model, p.hf_dir, p.topo, p.adapter, p.opts, decoy=p.load, backend=p.backend)
    backend, export = get_backend(p.backend), get_backend(resolve("bridge_peft"))
    out, k, out_dir = _Out([], [], []), p.opts.steps, Path(p.out)
    if p.load:
        training.load_training(ctx, backend, job, Path(p.ckpt), defaults("training"))
        export.save(ctx, bm, out_dir / "adapter@load")
    else:
        out.losses_before_save = training.train_steps(job.chunks, job.optimizer, p.model, 0, k, job.scheduler)
        job.step = k
        backend.save_training(ctx, job, Path(p.ckpt))
        export.save(ctx, bm, out_dir / "adapter@save")
        out.pieces = mb.adapter_pieces(bm, p.model)
    out.base_before = base_shards(job.chunks)
    out.losses_after = training.train_steps(job.chunks, job.optimizer, p.model, k, k, job.scheduler, trace=out.trace_after)
    out.base_after = base_shards(job.chunks)
    export.save(ctx, bm, out_dir / f"adapter@end-{'load' if p.load else 'save'}")
    return out


def checkpoint_keys(root: Path) -> list[str]:
    """The tensor keys a training checkpoint's torch DCP metadata lists (the iteration its tracker
    names), read without a process group or a load."""
    from torch.distributed.checkpoint import FileSystemReader

    from harness.backends._megatron_lm import iteration_dir

    return sorted(FileSystemReader(str(iteration_dir(root))).read_metadata().state_dict_metadata)


def adapter_only_check(keys: list[str]) -> Check:
    """The checkpoint's tensors: adapters (and their optimizer state) only."""
    model_keys = [k for k in keys if "/" not in k and not k.startswith("optimizer")]  # "/": sharded objects (RNG, common state)
    base = sorted(k for k in keys if "/" not in k and ".adapter." not in k)
    adapters = [k for k in model_keys if ".adapter." in k]
    if base or not adapters:
        why = f"{len(base)} base tensor(s), e.g. {base[:3]}" if base else "no adapter tensor"
        return Check("adapter-only", "failed", f"the LoRA checkpoint holds {why} ({len(keys)} tensors)", tolerance=EXACT)
    return Check("adapter-only", "passed", f"{len(adapters)} adapter tensors and their optimizer state, no base key", tolerance=EXACT)


def judge(k: int, src: str, dst: str, ckpt_keys: list[str], saved: list[_Out], loaded: list[_Out], exports: dict[str, Any],
          peft_problems: list[str], integrity: Check) -> list[Check]:
    loss_tol, weight_tol = resume_tolerances(src, dst, "fp32")
    frozen, before = [], {}
    for side, label, outs in (("save", f"save@{src}", saved), ("load", f"load@{dst}", loaded)):
        before[side] = assembled(outs, "base_before", label)
        after, p2 = assembled(outs, "base_after", label)
        frozen.append(state_check("frozen-base", before[side][0], after, f"base before@{label}", f"base after {k} steps@{label}",
                                  f"{len(after)} base tensors unchanged by training", problems=before[side][1] + p2))
    frozen_check = next((c for c in frozen if c.failed), frozen[-1])
    (base_saved, q1), (base_loaded, q2) = before["save"], before["load"]
    base_check = state_check("base-restored", base_saved, base_loaded, f"base@save@{src}", f"base after the load@{dst}",
                             f"{len(base_loaded)} base tensors at {dst} (from pretrained_checkpoint) equal the base saved against",
                             problems=q1 + q2)
    return [
        adapter_only_check(ckpt_keys),
        state_check("adapters-restored", exports["save"], exports["load"], f"adapter-export@save@{src}", f"adapter-export@load@{dst}",
                    f"{len(exports['load'])} adapter tensors exported right after the load equal the export at the save"),
        base_check,
        frozen_check,
        segment_losses(k, k, losses_of(saved), losses_of(loaded), src, dst, "losses", loss_tol),
        *schedule_checks(k, k, saved, loaded, src, dst, grad_norm_tolerance(src, dst, "fp32")),
        state_check("final-adapters", exports["end-save"], exports["end-load"], f"uninterrupted@{src}", f"resumed@{dst}",
                    f"{len(exports['end-load'])} adapter tensors after {2 * k} steps agree", weight_tol),
        Check("peft-load", "failed" if peft_problems else "passed",
              "; ".join(peft_problems) or "peft loads the resumed job's export over the fixture: no missing or unexpected key", tolerance=EXACT),
        integrity,
    ]


class PeftResume(Case):
    name = "peft-resume"
    description = "a LoRA run's adapter-only training checkpoint saved at S, resumed at D over its base, exported for peft"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"training_state", "peft_training"})
    checks = CHECKS

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        opts.validate_layout(get_model(spec.model, "hf"), (spec.source, spec.target))

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.models.hf import write_fixture

        model, ref = get_model(spec.model, "hf"), ref_of(spec)
        hf_dir, ckpt, out = env.case_dir / "hf-source", env.case_dir / "ckpt", env.case_dir / "exports"
        with env.timed("fixture"):
            write_fixture(model, hf_dir)
        phase = dict(model=model, hf_dir=str(hf_dir), adapter=opts.spec(model), opts=opts, backend=ref, ckpt=str(ckpt), out=str(out))
        saved = env.launch("save", _rank, _Phase(topo=spec.source, load=False, **phase), spec.source)
        loaded = env.launch("load", _rank, _Phase(topo=spec.target, load=True, **phase), spec.target)
        with env.timed("compare"):
            peft = get_backend(resolve("bridge_peft"))
            exports = {tag: peft.read_full(None, out / f"adapter@{tag}") for tag in ("save", "load", "end-save", "end-load")}
            reference = source_infos(out / "adapter@save")
            integrity = export_integrity([Expected(f"adapter@{tag}", out / f"adapter@{tag}", reference, weights=ADAPTER_WEIGHTS,
                                                   sharded_ok=False) for tag in ("save", "load", "end-save", "end-load")])
            keys = checkpoint_keys(ckpt)
            result.checks.extend(judge(opts.steps, spec.source.id, spec.target.id, keys, saved, loaded, exports,
                                       peft_load_problems(hf_dir, out / "adapter@end-load"), integrity))
            derived = peft_mapping.to_hf_peft(peft_mapping.gather([p for o in saved for p in o.pieces], model.gated), model)
            result.checks.extend(targets_checks(model, opts.entries(model), megatron_units(derived),
                                                peft_wrapped(hf_dir, out / "adapter@end-load")))


CASE = PeftResume()
