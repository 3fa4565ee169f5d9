"""reshard-weights: save model weights at topology S, load at D, prove nothing changed.

Checks (each can fail on its own; see tests/test_parity.py for the corrupt-one-tensor proofs):
  source-canonical      the model built at S holds the canonical weights (guards the harness)
  checkpoint-canonical  the checkpoint's plain tensors equal the canonical ones, bitwise
  loaded-canonical      every tensor loaded at D, assembled to full shape, equals canonical
                        bitwise; nothing missing, extra, uncovered, or disagreeing between replicas
  resave-plain          Megatron-LM's own pattern: re-save at D, load_plain_tensors of both
                        checkpoints, exact equality
  logits                logits of a fixed batch at D equal those at S; bitwise when TP is
                        unchanged, else within LOGITS_TP_TOLERANCE; not run when CP>1 (a CP
                        forward needs Transformer-Engine attention)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness import models
from harness.backends import get_backend
from harness.case import Case, RunEnv, timed
from harness.matrix import CaseSpec
from harness.memory import track
from harness.models import ModelSpec
from harness.parity import Tolerance, assemble, compare_state, compare_tensors, max_abs_diff
from harness.result import CaseResult, Check
from harness.topology import Topology
from harness.world import RankContext

# A TP change splits row-parallel matmuls into partial sums reduced across ranks and splits the
# vocab-parallel output layer: fp32 results then differ in the last bits. Measured on the zoo:
# max |diff| ~1e-6 on logits of magnitude ~1; the bound leaves 10x headroom and stays far below
# any real weight corruption (a wrong shard moves logits by >1e-2).
LOGITS_TP_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="TP change reorders fp32 reductions")
CP_FORWARD_UNSUPPORTED = (
    "CP>1 forward not run: megatron-core's local DotProductAttention asserts "
    "context_parallel_size == 1 (only TEDotProductAttention supports CP, needs Transformer-Engine)"
)
DECOY_SEED_OFFSET = 9973  # the load-side model starts from other weights, so a no-op load fails


@dataclass(frozen=True)
class _Phase:
    model: ModelSpec
    topo: Topology
    backend: str
    load_from: str | None
    save_to: str | None
    logits: bool


def _rank_phase(ctx: RankContext, p: _Phase) -> dict[str, Any]:
    from harness import compat

    backend = get_backend(p.backend)
    models.init_parallel(p.topo)
    model = models.build_gpt(p.model, p.topo)
    memory = {}
    if p.load_from is None:
        models.fill_canonical(model, p.model)
    else:
        models.fill_canonical(model, p.model.with_seed(p.model.seed + DECOY_SEED_OFFSET))
        with track("load") as memory["load"]:
            backend.load(ctx, model, Path(p.load_from))
    shards = models.local_shards(model)
    out = {
        "shards": shards,
        "logits": models.forward_logits(model, models.fixed_batch(p.model), p.model.hidden_size, ctx.device) if p.logits else None,
        "compat": compat.installed(),
        "shard_bytes": sum(s.data.numel() * s.data.element_size() for s in shards),
    }
    if p.save_to is not None:
        with track("save") as memory["save"]:
            backend.save(ctx, model, Path(p.save_to))
    out["memory"] = {k: v.to_dict() for k, v in memory.items()}
    return out


def _rank_read(ctx: RankContext, arg: tuple[str, list[str]]) -> dict[str, dict[str, torch.Tensor]]:
    backend_name, dirs = arg
    backend = get_backend(backend_name)
    return {d: backend.read_full(ctx, Path(d)) for d in dirs}


def _logits_of(outs: list[dict[str, Any]]) -> tuple[torch.Tensor | None, bool]:
    """The logits, and whether every rank that produced logits (DP/CP replicas) agrees bitwise."""
    found = [o["logits"] for o in outs if o["logits"] is not None]
    if not found:
        return None, True
    return found[0], all(torch.equal(found[0].view(torch.uint8), f.view(torch.uint8)) for f in found[1:])


def record_memory(result: CaseResult, world: str, outs: list[dict[str, Any]]) -> None:
    """result.memory[phase][rank] for every tracked phase of this world ("save" world: save)."""
    for rank, o in enumerate(outs):
        for phase, m in o.get("memory", {}).items():
            key = phase if world == phase else f"{world}:{phase}"
            result.memory.setdefault(key, {})[str(rank)] = {**m, "shard_bytes": o.get("shard_bytes", 0)}


def state_check(name: str, mismatches: list, detail_ok: str, tolerance: str = "bitwise") -> Check:
    if mismatches:
        worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
        kinds = sorted({m.kind for m in mismatches})
        return Check(name, "failed", f"{len(mismatches)} mismatch(es): {', '.join(kinds)}", worst, tolerance, mismatches)
    return Check(name, "passed", detail_ok, 0.0 if tolerance == "bitwise" else None, tolerance)


class ReshardWeights(Case):
    name = "reshard-weights"
    description = "model weights saved at S, reloaded at D: bitwise, plus Megatron-LM's re-save check and logits"

    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        model = models.get_model(spec.model)
        src, dst = spec.source, spec.target
        ckpt_a, ckpt_b = env.case_dir / "ckpt-source", env.case_dir / "ckpt-resaved"
        logits_possible = src.cp == 1 and dst.cp == 1

        saved = env.launch(result, "save", _rank_phase, _Phase(model, src, spec.backend, None, str(ckpt_a), logits_possible), src.world_size)
        loaded = env.launch(
            result, "load", _rank_phase, _Phase(model, dst, spec.backend, str(ckpt_a), str(ckpt_b), logits_possible), dst.world_size
        )
        plain = env.launch(result, "read", _rank_read, (spec.backend, [str(ckpt_a), str(ckpt_b)]), 1)[0]
        result.compat_shims = saved[0]["compat"]
        record_memory(result, "save", saved)
        record_memory(result, "load", loaded)

        with timed(result, "compare"):
            src_full, src_problems = assemble((s for o in saved for s in o["shards"]), src.id)
            dst_full, dst_problems = assemble((s for o in loaded for s in o["shards"]), dst.id)
            canonical = {k: models.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in src_full.items()}
            result.checks.append(
                state_check(
                    "source-canonical",
                    src_problems + compare_state(canonical, src_full, "canonical", src.id),
                    f"{len(src_full)} tensors built at {src.id} equal canonical",
                )
            )
            result.checks.append(
                state_check(
                    "checkpoint-canonical",
                    compare_state(canonical, plain[str(ckpt_a)], "canonical", f"checkpoint@{src.id}"),
                    f"{len(plain[str(ckpt_a)])} tensors in the checkpoint equal canonical",
                )
            )
            result.checks.append(
                state_check(
                    "loaded-canonical",
                    dst_problems + compare_state(canonical, dst_full, "canonical", dst.id),
                    f"{len(dst_full)} tensors loaded at {dst.id} equal canonical, none missing or extra",
                )
            )
            result.checks.append(
                state_check(
                    "resave-plain",
                    compare_state(plain[str(ckpt_a)], plain[str(ckpt_b)], f"saved@{src.id}", f"resaved@{dst.id}"),
                    "load_plain_tensors(original) == load_plain_tensors(re-saved at target)",
                )
            )
            result.checks.append(self._logits_check(saved, loaded, src, dst, logits_possible))

    @staticmethod
    def _logits_check(saved, loaded, src: Topology, dst: Topology, possible: bool) -> Check:
        if not possible:
            return Check("logits", "not-run", CP_FORWARD_UNSUPPORTED, tolerance="-")
        ls, src_agree = _logits_of(saved)
        ld, dst_agree = _logits_of(loaded)
        if ls is None or ld is None:
            return Check("logits", "failed", "no rank returned logits")
        if not (src_agree and dst_agree):
            return Check("logits", "failed", "data-parallel replicas computed different logits")
        tol = None if src.tp == dst.tp else LOGITS_TP_TOLERANCE
        m = compare_tensors("logits", ls, ld, src.id, dst.id, tol)
        diff = max_abs_diff(ls, ld)
        label = "bitwise" if tol is None else str(tol)
        if m is None:
            return Check("logits", "passed", f"{tuple(ld.shape)} logits agree", diff, label)
        return Check("logits", "failed", str(m), diff, label, [m])


CASE = ReshardWeights()
