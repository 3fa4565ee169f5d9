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

Checks:
  sync-names   every rank receives every tensor of the HF fixture exactly once, and nothing else
  sync-values  every tensor received equals the fixture's, bitwise (name, shape, dtype and bytes)
  sync-repeat  the second stream, with the cached tasks, sends the same tensors as the first
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from .contract import Case
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.models import bridge as mb
from harness.run.envelope import RunEnv

Received = list[tuple[str, tuple[int, ...], str, str]]  # (name, shape, dtype, sha256 of the bytes), in stream order


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def describe(name: str, t: torch.Tensor) -> tuple[str, tuple[int, ...], str, str]:
    return name, tuple(t.shape), str(t.dtype).removeprefix("torch."), digest(t)


@dataclass(frozen=True)
class _Sync:
    model: HFModelSpec
    hf_dir: str
    topo: Topology


def _rank(ctx: RankContext, p: _Sync) -> tuple[Received, Received]:
    bm = mb.build(p.hf_dir, p.model, p.topo, load_weights=True)
    tasks = bm.bridge.get_conversion_tasks(bm.modules)  # verl's _mbridge_export_tasks: built once, cached
    streams = []
    for n in range(2):
        with track("sync-stream" if n == 0 else "sync-stream-again"):
            streams.append([describe(name, w) for name, w in
                            bm.bridge.export_hf_weights(bm.modules, show_progress=False, conversion_tasks=tasks)])
    return streams[0], streams[1]


def judge(truth: dict[str, tuple[tuple[int, ...], str, str]], ranks: list[tuple[Received, Received]], src: str) -> list[Check]:
    """Each rank's streams against the fixture ({name: (shape, dtype, digest)})."""
    if not truth or not ranks:
        return [Check(n, "failed", "nothing to compare: no fixture tensor or no rank", tolerance=EXACT)
                for n in ("sync-names", "sync-values", "sync-repeat")]
    name_bad, value_bad, repeat_bad = [], [], []
    for r, (first, again) in enumerate(ranks):
        counts = Counter(n for n, *_ in first)
        missing = sorted(set(truth) - set(counts))
        extra = sorted(set(counts) - set(truth))
        twice = sorted(n for n, c in counts.items() if c > 1)
        for what, names in (("missing", missing), ("not in the fixture", extra), ("sent more than once", twice)):
            if names:
                name_bad.append(f"rank {r}: {len(names)} {what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
        wrong = sorted({n for n, shape, dtype, sha in first if n in truth and truth[n] != (shape, dtype, sha)})
        if wrong:
            value_bad.append(f"rank {r}: {len(wrong)} differ from the fixture: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
        if first != again:
            repeat_bad.append(f"rank {r}: the second stream sent {len(again)} tensors, the first {len(first)}"
                              + ("" if len(first) != len(again) else f"; {sum(a != b for a, b in zip(first, again))} differ"))
    n = len(truth)
    return [
        Check("sync-names", "failed" if name_bad else "passed", "; ".join(name_bad) if name_bad else
              f"each of {len(ranks)} rank(s) at {src} received the {n} fixture tensors once each", tolerance=EXACT),
        Check("sync-values", "failed" if value_bad else "passed", "; ".join(value_bad) if value_bad else
              f"{n} tensors on each of {len(ranks)} rank(s) equal the fixture (name, shape, dtype, bytes)", tolerance=EXACT),
        Check("sync-repeat", "failed" if repeat_bad else "passed", "; ".join(repeat_bad) if repeat_bad else
              "the second stream (cached conversion tasks) sent the same tensors as the first", tolerance=EXACT),
    ]


class WeightSync(Case):
    name = "weight-sync"
    description = "verl's per-step weight sync to the rollout engine: every HF tensor, once, bitwise, on every rank"
    model_kind = "hf"
    needs = frozenset({"hf_export", "read_plain"})  # the Bridge's export (streamed, not saved); the fixture read back
    checks = ("sync-names", "sync-values", "sync-repeat")

    def validate(self, spec: CaseSpec) -> Any:
        opts = super().validate(spec)
        if spec.source != spec.target:
            raise ValueError(f"case {self.name} streams at one topology: write the pair as 'S -> S', got "
                             f"{spec.source.id} -> {spec.target.id}")
        return opts

    def run(self, spec: CaseSpec, opts: Any, env: RunEnv, result: CaseResult) -> None:
        from harness.backends import get_backend, resolve
        from harness.models.hf import write_fixture

        model = get_model(spec.model, "hf")
        hf_dir = env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d))
        ranks = env.launch("sync", _rank, _Sync(model, str(hf_dir), spec.source), spec.source)
        with env.timed("compare"):
            fixture = get_backend(resolve("bridge_hf")).read_full(None, hf_dir)
            truth = {k: describe(k, v)[1:] for k, v in fixture.items()}
            result.checks.extend(judge(truth, ranks, spec.source.id))


CASE = WeightSync()
