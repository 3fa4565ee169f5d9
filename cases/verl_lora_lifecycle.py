"""verl-lora-lifecycle: one LoRA adapter from verl's save to its resume, re-save, merge and rollout
(issue 43 item 4; seed verl #5575: the HF PEFT adapter saved through Megatron-Bridge).

A verl LoRA job (provider path, verl's `peft_cls`; the base from the fixture at every build, as verl's
engine loads it; the adapters at known values, issue 43's "trained" adapter) is saved at S through
verl's manager with its HF tree (`hf_model`: Megatron-Bridge writes the PEFT adapter to
model/huggingface/adapter). A job at D (decoy adapters) resumes from it through the manager, records
Megatron+LoRA's logits and the adapter stream verl's rollout sync receives with `lora.merge: false`
(Megatron-Bridge `export_adapter_weights`), and saves again (step + 1) with its HF tree. Then verl's
model_merger merges D's checkpoint (case verl-merger's world, `ppN` for D's PP).

Every artefact is the same adapter:
  adapter-resaved   D's exported adapter (tensors and adapter_config.json) equals S's, bitwise
  adapter-stream    the rollout's adapter stream at D equals S's exported adapter, bitwise (names
                    without PEFT's `base_model.model.`, as vLLM's LoRA loader reads them)
  logits            transformers+PEFT on D's exported adapter equals Megatron+LoRA at D
                    (logits_tolerance), and moves the logits off the base's
  logits-resumed    Megatron+LoRA at D equals Megatron+LoRA at S (RESUME_TOLERANCE: a topology change
                    reorders fp32 reductions)
  ref-logits        Megatron at D inside verl's `disable_adapter()` (its reference policy of a LoRA job:
                    the engine's context is Bridge's PEFT.disable_adapter over the job's modules, verl
                    workers/engine/megatron/transformer_impl.py:1127-1128, engine_workers.py:425) equals
                    transformers on the base (logits_tolerance), off the adapter's logits: an adapter
                    that stays on makes the KL to the reference silently zero
  adapter-restored  Megatron at D after that context equals Megatron+LoRA before it, bitwise: an adapter
                    left off trains and rolls out the base
  merger-adapter    verl's model_merger on D's checkpoint writes the model and a PEFT adapter
                    (`<target>/lora_adapter`, base_model_merger.py save_lora_adapter) equal to S's,
                    its lora_alpha included
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .contract import Case
from .ranks.verl_merger import Merge, merger_rank
from harness.core.context import RankContext
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import state_check
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Options:
    adapter: Literal["lora", "canonical_lora"] = "lora"
    sharding: Literal["dp_reshardable", "fully_reshardable"] = "fully_reshardable"


@dataclass
class ResumeOut:
    step: int = 0
    logits: torch.Tensor | None = None  # Megatron+LoRA at D, on the rank that has them
    ref_logits: torch.Tensor | None = None  # inside verl's disable_adapter(): the reference policy
    restored_logits: torch.Tensor | None = None  # after it
    stream: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: the rollout's adapter stream


@dataclass(frozen=True)
class _Resume:
    phase: Any  # cases.ranks.verl_checkpoint.VerlPhase at D, load=True
    step: int  # the step it saves again at


def resume_rank(ctx: RankContext, r: _Resume) -> ResumeOut:
    """At D: a decoy LoRA job resumes through verl's manager, gives its logits and the rollout's adapter
    stream, and saves again at `r.step`, as verl's trainer would at its next save."""
    from .ranks.verl_checkpoint import build_job
    from harness.backends import get_backend
    from harness.models import bridge as mb
    from harness.models.training import load_training
    from harness.run.preload import warm

    p = r.phase
    backend = get_backend(p.backend)
    warm(modules=backend.preload)
    job = build_job(p, decoy=True)
    load_training(ctx, backend, job, Path(p.ckpt), p.opts.workarounds)
    out = ResumeOut(step=r.step)
    out.logits = mb.megatron_logits(job.bridge, p.model, ctx.device)
    with job.bridge.peft.disable_adapter(job.bridge.modules):  # what verl's Megatron engine's disable_adapter() returns
        out.ref_logits = mb.megatron_logits(job.bridge, p.model, ctx.device)
    out.restored_logits = mb.megatron_logits(job.bridge, p.model, ctx.device)
    for name, w in job.bridge.bridge.export_adapter_weights(job.bridge.modules, show_progress=False):  # every rank: collective
        if ctx.rank == 0:
            out.stream[name] = w.detach().cpu().clone()
    job.step = out.step
    backend.save_training(ctx, job, Path(p.ckpt))
    return out


def _read_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    weights = directory / "adapter_model.safetensors"
    tensors = load_file(str(weights)) if weights.exists() else {}
    config = json.loads((directory / "adapter_config.json").read_text()) if (directory / "adapter_config.json").exists() else {}
    return tensors, config


def resaved_check(first: tuple[dict, dict], again: tuple[dict, dict], src: str, dst: str) -> Check:
    """D's exported adapter against S's: every tensor bitwise, and the adapter_config.json fields a
    PEFT load reads (r, lora_alpha, target_modules, ...) the same."""
    (t1, c1), (t2, c2) = first, again
    tensors = state_check("adapter-resaved", t1, t2, f"adapter@{src}", f"adapter re-saved@{dst}",
                          f"{len(t1)} adapter tensors re-exported at {dst} equal those exported at {src}, bitwise", EXACT)
    changed = sorted(k for k in set(c1) | set(c2) if c1.get(k) != c2.get(k) and k != "base_model_name_or_path")
    if tensors.status == "passed" and not changed and c1:
        return tensors
    detail = "; ".join(([tensors.detail] if tensors.status != "passed" else [])
                       + ([f"adapter_config.json differs in {', '.join(changed)}: "
                           + ", ".join(f"{k} {c1.get(k)!r} -> {c2.get(k)!r}" for k in changed)] if changed else [])
                       + (["no adapter_config.json at S"] if not c1 else []))
    return Check("adapter-resaved", "failed", detail, tensors.max_abs_diff, EXACT, tensors.mismatches)


def stream_check(exported: dict[str, torch.Tensor], stream: dict[str, torch.Tensor], src: str, dst: str) -> Check:
    truth = {k.removeprefix(PEFT_PREFIX): v for k, v in exported.items()}
    return state_check("adapter-stream", truth, stream, f"adapter exported@{src}", f"rollout adapter stream@{dst}",
                       f"the rollout receives the {len(truth)} exported adapter tensors, bitwise", EXACT)


def resumed_logits_check(at_s: torch.Tensor | None, at_d: torch.Tensor | None, src: str, dst: str) -> Check:
    from .shared.trajectory import RESUME_TOLERANCE as tol
    from harness.core.parity import compare_tensors, max_abs_diff

    if at_s is None or at_d is None:
        return Check("logits-resumed", "failed", f"no Megatron+LoRA logits at {src if at_s is None else dst}", tolerance=EXACT)
    m = compare_tensors("logits", at_s, at_d, f"megatron+lora@{src}", f"megatron+lora@{dst} (resumed)", tol)
    return Check("logits-resumed", "failed" if m else "passed", str(m) if m else "the resumed job's logits equal the saved job's",
                 max_abs_diff(at_s, at_d), tol, [m] if m else [])


class VerlLoraLifecycle(Case):
    name = "verl-lora-lifecycle"
    description = "one verl LoRA adapter through save, resume, re-save, merge and rollout sync: the same adapter everywhere"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"manager"})
    checks = ("adapter-resaved", "adapter-stream", "logits", "logits-resumed", "ref-logits", "adapter-restored", "merger-adapter")

    def validate(self, spec: CaseSpec) -> Any:
        opts = super().validate(spec)
        if get_model(spec.model).num_experts:
            raise ValueError(f"case {self.name}: an MoE model ({spec.model}) is not built yet (its expert adapters' PEFT layout)")
        return opts

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from .ranks.verl_checkpoint import Options as VerlOptions, VerlPhase, verl_rank
        from .shared.peft import logits_check
        from harness.backends import ref_of
        from harness.backends.verl_manager import step_dir
        from harness.core import truth
        from harness.models.hf import hf_logits, write_fixture

        model: HFModelSpec = get_model(spec.model, "hf")
        hf_dir = Path(env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d)))
        ckpt = env.case_dir / "ckpt"
        phase = dict(model=model, opts=VerlOptions(steps=0, sharding=opts.sharding, adapter=opts.adapter), backend=ref_of(spec),
                     ckpt=str(ckpt), hf_dir=str(hf_dir))
        saved = env.launch("save", verl_rank, VerlPhase(topo=spec.source, load=False, **phase), spec.source)
        first_step = max(saved[0].saved_steps)
        resumed = env.launch("resume", resume_rank, _Resume(VerlPhase(topo=spec.target, load=True, **phase), first_step + 1), spec.target)
        again_step = first_step + 1
        merged_dir = env.case_dir / "merged"
        merged_dir.mkdir(parents=True, exist_ok=True)
        try:
            env.launch("merge", merger_rank, Merge(str(step_dir(ckpt, again_step)), str(merged_dir), model.tied), Topology(pp=spec.target.pp))
            merge_error = None
        except WorldError as exc:
            merge_error = exception_of(exc.rank_traceback or str(exc))
        with env.timed("compare"):
            src, dst = spec.source.id, spec.target.id
            first = _read_adapter(step_dir(ckpt, first_step) / "model" / "huggingface" / "adapter")
            again = _read_adapter(step_dir(ckpt, again_step) / "model" / "huggingface" / "adapter")
            result.checks.append(resaved_check(first, again, src, dst))
            result.checks.append(stream_check(first[0], resumed[0].stream, src, dst))
            ids = truth.fixed_input_ids(model)
            base = hf_logits(hf_dir, ids)  # transformers on the base: the adapter's effect and the reference policy
            at_s = next((o.logits for o in saved if o.logits is not None), None)
            at_d = next((o.logits for o in resumed if o.logits is not None), None)
            adapter_d = step_dir(ckpt, again_step) / "model" / "huggingface" / "adapter"
            if at_d is None or not again[0]:
                result.checks.append(Check("logits", "failed", "no Megatron+LoRA logits at D or no adapter re-exported", tolerance=EXACT))
            else:
                result.checks.append(logits_check(hf_logits(hf_dir, ids, adapter=adapter_d), base, at_d, dst))
            result.checks.append(resumed_logits_check(at_s, at_d, src, dst))
            at_d_ref = next((o.ref_logits for o in resumed if o.ref_logits is not None), None)
            at_d_after = next((o.restored_logits for o in resumed if o.restored_logits is not None), None)
            result.checks.extend(disabled_adapter_checks(base, at_d, at_d_ref, at_d_after, dst))
            result.checks.append(merger_adapter_check(first, merged_dir, merge_error, dst))


def disabled_adapter_checks(hf_base: torch.Tensor, lora: torch.Tensor | None, ref: torch.Tensor | None,
                            after: torch.Tensor | None, dst: str) -> list[Check]:
    """ref-logits (verl's reference policy, the adapter disabled, against transformers on the base) and
    adapter-restored (the adapter back after the context, bitwise)."""
    from .shared.peft import MEASURED_SCALE, MIN_ADAPTER_EFFECT, logits_tolerance
    from harness.core.parity import compare_tensors, max_abs_diff

    if lora is None or ref is None or after is None:
        missing = "no Megatron logits at D " + ("with the adapter" if lora is None else "inside disable_adapter()" if ref is None
                                                  else "after disable_adapter()")
        return [Check("ref-logits", "failed", missing, tolerance=EXACT), Check("adapter-restored", "failed", missing, tolerance=EXACT)]
    tol = logits_tolerance("fp32", MEASURED_SCALE)
    m = compare_tensors("logits", hf_base, ref, "transformers (base)", f"megatron@{dst} in disable_adapter()", tol)
    off = max_abs_diff(ref, lora)
    if off < MIN_ADAPTER_EFFECT:
        ref_check = Check("ref-logits", "failed", f"disable_adapter() left the logits within {off:.2e} of the adapter's: the "
                          "adapter stayed on, the reference policy is the actor", off, tol)
    else:
        ref_check = Check("ref-logits", "failed" if m else "passed",
                          str(m) if m else f"the base's logits inside disable_adapter(), {off:.3f} off the adapter's",
                          max_abs_diff(hf_base, ref), tol, [m] if m else [])
    back = compare_tensors("logits", lora, after, f"megatron+lora@{dst}", f"megatron@{dst} after disable_adapter()", EXACT)
    restored = Check("adapter-restored", "failed" if back else "passed",
                     str(back) if back else "the adapter's logits again after disable_adapter(), bitwise",
                     max_abs_diff(lora, after), EXACT, [back] if back else [])
    return [ref_check, restored]


def merger_adapter_check(first: tuple[dict, dict], merged_dir: Path, error: tuple[str | None, str] | None, dst: str) -> Check:
    """The merger's adapter against S's export: tensors bitwise (PEFT names), r and lora_alpha."""
    if error is not None:
        exc_type, message = error
        first_line = (message.splitlines() or [""])[0][:300]
        return Check("merger-adapter", "failed", f"verl's model_merger did not merge the LoRA checkpoint at {dst}: {exc_type}: {first_line}",
                     tolerance=EXACT)
    tensors, config = _read_adapter(merged_dir / "lora_adapter")
    if not tensors:
        return Check("merger-adapter", "failed", "the merger wrote no adapter (lora_adapter/adapter_model.safetensors)", tolerance=EXACT)
    check = state_check("merger-adapter", first[0], tensors, "adapter exported@S", f"merger adapter@{dst}",
                        f"the merger's {len(tensors)} adapter tensors equal the exported adapter, bitwise", EXACT)
    wrong = [f"{k} {first[1].get(k)!r} -> {config.get(k)!r}" for k in ("r", "lora_alpha") if first[1].get(k) != config.get(k)]
    if wrong:
        return Check("merger-adapter", "failed", "; ".join(([check.detail] if check.status != "passed" else []) + wrong), tolerance=EXACT)
    return check


CASE = VerlLoraLifecycle()
