"""weight-sync: what a rollout engine receives from verl's per-step weight sync (issue 43 item 3).

Every training step verl streams the actor's weights to its rollout engine (vLLM, SGLang) in HF
names. Its Megatron engine (verl/workers/engine/megatron/transformer_impl.py,
`get_per_tensor_param`) calls Megatron-Bridge's `export_hf_weights(module,
conversion_tasks=bridge.get_conversion_tasks(module))`, the tasks built once and reused. No
checkpoint is written: a wrong tensor there poisons every rollout, silently. "All ranks get full
tensors" (AutoBridge.export_hf_weights): each rank hands its engine the whole model.

World "sync" at S: the fixture's Bridge model (provider path, the fixture's weights, untrained) at
S's TP / PP / EP / VPP. Each rank runs the stream as verl does, twice (the second with the cached
tasks, as every step after the first), and records what it received: each tensor's name, shape,
dtype and a digest of its bytes. Its host memory during the first stream is the phase
`sync-stream` of the case's memory record (verl #6691's OOM is this path).

Option `adapter` (none | lora | canonical_lora; `dim`, `alpha`): a LoRA job, the adapters filled with
known values. verl sends it two ways: merged into the base (its default: the streams above), or, with
`lora.merge: false`, the base unmerged (`merge_adapter_weights=False`) and then the adapters alone
(`export_adapter_weights`); the case streams both.

Checks:
  sync-names     every rank receives every tensor of the HF fixture exactly once, and nothing else
  sync-values    every tensor received equals the truth on every rank: the fixture bitwise; with an
                 adapter, peft's merge_and_unload of the fixture and the harness's own derivation of
                 the adapter (MERGE_WEIGHTS_TOLERANCE), every rank bitwise what rank 0 received
  sync-repeat    the second stream, with the cached tasks, sends the same tensors as the first
  sync-unmerged  (adapter) the unmerged base equals the fixture bitwise, each tensor once
  sync-adapters  (adapter) the adapter stream equals the harness's derivation of the Megatron
                 adapters in PEFT's names, bitwise, each tensor once, the same on every rank
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .contract import Case
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import state_check
from harness.models import bridge as mb
from harness.run.envelope import RunEnv

Received = list[tuple[str, tuple[int, ...], str, str]]  # (name, shape, dtype, sha256 of the bytes), in stream order


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def describe(name: str, t: torch.Tensor) -> tuple[str, tuple[int, ...], str, str]:
    return name, tuple(t.shape), str(t.dtype).removeprefix("torch."), digest(t)


@dataclass(frozen=True)
class Options:
    adapter: Literal["none", "lora", "canonical_lora"] = "none"
    dim: int = 4
    alpha: int = 8


@dataclass(frozen=True)
class _Sync:
    model: HFModelSpec
    hf_dir: str
    topo: Topology
    adapter: mb.AdapterSpec | None = None


@dataclass
class SyncOut:
    first: Received
    again: Received
    unmerged: Received = field(default_factory=list)
    adapters: Received = field(default_factory=list)
    pieces: list[dict] = field(default_factory=list)  # this rank's Megatron adapter tensors (the derivation's input)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # rank 0: what it received, in full


def _rank(ctx: RankContext, p: _Sync) -> SyncOut:
    bm = mb.build(p.hf_dir, p.model, p.topo, load_weights=True, adapter=p.adapter)
    if p.adapter is not None:
        mb.fill_adapters(bm, p.model, p.adapter)
    tasks = bm.bridge.get_conversion_tasks(bm.modules)  # verl's _mbridge_export_tasks: built once, cached
    full: dict[str, dict[str, torch.Tensor]] = {}

    def stream(label: str, pairs) -> Received:
        got = []
        with track(label):
            for name, w in pairs:
                got.append(describe(name, w))
                if ctx.rank == 0:
                    full.setdefault(label, {})[name] = w.detach().cpu().clone()
        return got

    def hf(**kw):
        return bm.bridge.export_hf_weights(bm.modules, show_progress=False, conversion_tasks=tasks, **kw)

    out = SyncOut(stream("sync-stream", hf()), stream("sync-stream-again", hf()))
    if p.adapter is not None:
        out.unmerged = stream("sync-unmerged", hf(merge_adapter_weights=False))
        out.adapters = stream("sync-adapters", bm.bridge.export_adapter_weights(bm.modules, show_progress=False))
        out.pieces = mb.adapter_pieces(bm, p.model)
    out.tensors = {k: v for k, v in full.items() if k in ("sync-stream", "sync-adapters")}
    return out


def _once(received: Received, truth_names: set[str], r: int) -> list[str]:
    counts = Counter(n for n, *_ in received)
    out = []
    for what, names in (("missing", sorted(truth_names - set(counts))), ("not in the truth", sorted(set(counts) - truth_names)),
                        ("sent more than once", sorted(n for n, c in counts.items() if c > 1))):
        if names:
            out.append(f"rank {r}: {len(names)} {what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    return out


def _differ(received: Received, truth: dict[str, tuple], r: int, against: str) -> list[str]:
    wrong = sorted({n for n, *rest in received if n in truth and truth[n] != tuple(rest)})
    return [f"rank {r}: {len(wrong)} differ from {against}: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"] if wrong else []


def _check(name: str, bad: list[str], good: str) -> Check:
    return Check(name, "failed" if bad else "passed", "; ".join(bad) if bad else good, tolerance=EXACT)


def judge(truth: dict[str, tuple[tuple[int, ...], str, str]], ranks: list[SyncOut], src: str,
          merged_truth: dict[str, torch.Tensor] | None = None, adapter_truth: dict[str, torch.Tensor] | None = None) -> list[Check]:
    """Each rank's streams against the fixture ({name: (shape, dtype, digest)}); with an adapter, the
    merged stream against `merged_truth` (peft's merge) and the adapter stream against `adapter_truth`."""
    names = ["sync-names", "sync-values", "sync-repeat"] + (["sync-unmerged", "sync-adapters"] if adapter_truth is not None else [])
    if not truth or not ranks:
        return [Check(n, "failed", "nothing to compare: no fixture tensor or no rank", tolerance=EXACT) for n in names]
    n, name_bad, value_bad, repeat_bad, base_bad, adapter_bad = len(truth), [], [], [], [], []
    lead = {name: tuple(rest) for name, *rest in ranks[0].first}
    for r, out in enumerate(ranks):
        name_bad += _once(out.first, set(truth), r)
        value_bad += _differ(out.first, truth, r, "the fixture") if merged_truth is None else _differ(out.first, lead, r, "rank 0's")
        if out.first != out.again:
            repeat_bad.append(f"rank {r}: the second stream sent {len(out.again)} tensors, the first {len(out.first)}"
                              + ("" if len(out.first) != len(out.again) else f"; {sum(a != b for a, b in zip(out.first, out.again))} differ"))
        if adapter_truth is not None:
            base = unmerged_names(truth, adapter_truth)
            base_bad += _once(out.unmerged, set(base), r) + _differ(out.unmerged, base, r, "the fixture")
            adapter_bad += _once(out.adapters, set(adapter_truth), r) + _differ(
                out.adapters, {name: tuple(rest) for name, *rest in ranks[0].adapters}, r, "rank 0's")
    checks = [_check("sync-names", name_bad, f"each of {len(ranks)} rank(s) at {src} received the {n} fixture tensors once each")]
    if merged_truth is None:
        checks.append(_check("sync-values", value_bad, f"{n} tensors on each of {len(ranks)} rank(s) equal the fixture "
                             "(name, shape, dtype, bytes)"))
    else:
        from .shared.peft import merge_weights_tolerance

        merged = state_check("sync-values", merged_truth, ranks[0].tensors.get("sync-stream", {}), "peft merge_and_unload",
                             f"merged stream@{src} rank 0", f"the merged stream equals peft's merge_and_unload on rank 0, "
                             f"and every rank received rank 0's bytes", merge_weights_tolerance("fp32"))
        checks.append(merged if not value_bad else Check("sync-values", "failed", "; ".join(value_bad + [merged.detail]),
                                                          tolerance=merged.tolerance))
    checks.append(_check("sync-repeat", repeat_bad, "the second stream (cached conversion tasks) sent the same tensors as the first"))
    if adapter_truth is not None:
        checks.append(_check("sync-unmerged", base_bad, f"the unmerged base: the {n} fixture tensors, once each, bitwise, on every "
                             "rank, a wrapped module's under `.base_layer.`"))
        derived = state_check("sync-adapters", adapter_truth, ranks[0].tensors.get("sync-adapters", {}), "harness-derivation",
                              f"adapter stream@{src} rank 0", f"{len(adapter_truth)} adapter tensors equal the harness's derivation "
                              "(PEFT names), once each, the same on every rank")
        checks.append(derived if not adapter_bad else Check("sync-adapters", "failed", "; ".join(adapter_bad + [derived.detail]),
                                                            tolerance=EXACT))
    return checks


class WeightSync(Case):
    name = "weight-sync"
    description = "verl's per-step weight sync to the rollout engine: every HF tensor, once, bitwise, on every rank"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"hf_export", "read_plain"})  # the Bridge's export (streamed, not saved); the fixture read back
    checks = ("sync-names", "sync-values", "sync-repeat", "sync-unmerged", "sync-adapters")

    def validate(self, spec: CaseSpec) -> Any:
        opts = super().validate(spec)
        if spec.source != spec.target:
            raise ValueError(f"case {self.name} streams at one topology: write the pair as 'S -> S', got "
                             f"{spec.source.id} -> {spec.target.id}")
        if opts.adapter != "none" and get_model(spec.model).num_experts:
            raise ValueError(f"case {self.name}: option adapter on an MoE model ({spec.model}) is not built yet "
                             "(its truth needs the expert adapters' PEFT layout)")
        return opts

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.backends import get_backend, resolve
        from harness.models.hf import write_fixture

        model = get_model(spec.model, "hf")
        hf_dir = env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d))
        adapter = None
        if opts.adapter != "none":
            from .shared.peft import PeftOptions

            adapter = PeftOptions(adapter=opts.adapter, dim=opts.dim, alpha=opts.alpha).spec(model)
        ranks = env.launch("sync", _rank, _Sync(model, str(hf_dir), spec.source, adapter), spec.source)
        with env.timed("compare"):
            fixture = get_backend(resolve("bridge_hf")).read_full(None, hf_dir)
            truth = {k: describe(k, v)[1:] for k, v in fixture.items()}
            merged = derived = None
            if adapter is not None:
                derived, merged = adapter_truths(model, opts, ranks, Path(hf_dir), env.case_dir / "derived-adapter")
            result.checks.extend(judge(truth, ranks, spec.source.id, merged, derived))


def adapter_truths(model: HFModelSpec, opts: Options, ranks: list[SyncOut], hf_dir: Path, where: Path
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the adapter as the harness derives it from the Megatron pieces, in the names the stream uses:
    PEFT's without its `base_model.model.` prefix, which vLLM's LoRA loader strips too; peft's
    merge_and_unload of the fixture with that adapter, written and loaded as users load one)."""
    import json

    from safetensors.torch import save_file

    from .shared.peft import PeftOptions, hf_target_modules, peft_views
    from harness.models import peft_mapping

    derived = peft_mapping.to_hf_peft(peft_mapping.gather([p for o in ranks for p in o.pieces], model.gated), model,
                                      peft_mapping.TEXT)
    where.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in derived.items()}, str(where / "adapter_model.safetensors"))  # fused q/k/v share lora_A
    (where / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(hf_dir), "r": opts.dim,
        "lora_alpha": opts.alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": hf_target_modules(model, PeftOptions(adapter=opts.adapter, dim=opts.dim, alpha=opts.alpha))}))
    views = peft_views(hf_dir, where, torch.zeros(1, 1, dtype=torch.long))
    merged = views.merged
    if model.tied:  # the HF model's state dict lists the tied lm_head; the stream sends it once, as safetensors store it
        merged = {k: v for k, v in merged.items() if k != "lm_head.weight"}
    return {k.removeprefix("base_model.model."): v for k, v in derived.items()}, merged


def unmerged_names(truth: dict[str, Any], adapter: dict[str, Any]) -> dict[str, Any]:
    """The fixture's tensors under the names the unmerged stream gives them: a module the adapter wraps
    keeps its base weight as `<module>.base_layer.weight`, the LoRA wrapper's name vLLM loads
    (verl's SGLang rollout strips it again, sglang_rollout._strip_lora_base_layer)."""
    wrapped = {k.rsplit(".lora_", 1)[0] for k in adapter}
    out = {}
    for name, v in truth.items():
        module, _, leaf = name.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module in wrapped else name] = v
    return out


CASE = WeightSync()
