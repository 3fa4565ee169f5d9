"""bridge-hf-interop: a trained Megatron-Bridge model's training checkpoint -> HF export -> HF import
gives back the same weights (issue 19: the on-disk forms a Bridge user moves between).

World "save" at S: the HF fixture's Bridge model (provider path, fixture weights), the whole model
trained k steps (megatron DDP + optimizer), saved through the case's training backend
(bridge_training: Bridge's save_checkpoint), then exported as an HF checkpoint (bridge_hf,
`save_hf_pretrained`): `hf@save`.
World "load" at D: the same model from the provider's own init (other weights), the training
checkpoint loaded through the backend, exported again: `hf@load`.
World "import" at D: a model built from `hf@load` (AutoBridge `load_hf_weights`: the HF import),
exported once more: `hf@import`.

Checks:
  export-after-load  hf@load equals hf@save, bitwise: the checkpoint carried every trained weight to D
  hf-import          hf@import equals hf@load, bitwise: importing the export loses nothing
  trained            hf@save differs from the fixture (the k steps moved the weights: a check that
                     compares untrained weights would prove little)
  export-integrity   each export's files against the fixture's keys, shapes and dtypes (docs/export-integrity.md)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .ranks.bridge_job import BridgeJobOptions as Options
from .ranks.bridge_job import bridge_job
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of, resolve
from harness.core.context import RankContext
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import state_check
from harness.judge.hf_integrity import Expected, export_integrity, source_infos
from harness.models import bridge as mb
from harness.run.envelope import RunEnv

TAGS = ("save", "load", "import")


@dataclass(frozen=True)
class _Phase:
    model: HFModelSpec
    hf_dir: str
    topo: Topology
    opts: Options
    backend: BackendRef
    ckpt: str
    out: str
    role: str  # save | load | import


def _rank(ctx: RankContext, p: _Phase) -> None:
    from harness.compat.registry import defaults
    from harness.models import training

    export, out = get_backend(resolve("bridge_hf")), Path(p.out)
    if p.role == "import":  # the HF import: a model built from the export's weights
        bm = mb.build(str(out / "hf@load"), p.model, p.topo, load_weights=True)
        export.save(ctx, bm, out / "hf@import")
        return
    o = p.opts
    bm, job = bridge_job(p.model, p.hf_dir, p.topo, None, o, decoy=p.role == "load", backend=p.backend)
    backend = get_backend(p.backend)
    if p.role == "save":
        training.train_steps(job.chunks, job.optimizer, p.model, 0, o.steps, job.scheduler)
        job.step = o.steps
        backend.save_training(ctx, job, Path(p.ckpt))
    else:
        training.load_training(ctx, backend, job, Path(p.ckpt), defaults("training"))
    export.save(ctx, bm, out / f"hf@{p.role}")


def judge(exports: dict, fixture: dict, integrity: Check, src: str, dst: str) -> list[Check]:
    moved = sorted(k for k in fixture if k in exports["save"] and not fixture[k].equal(exports["save"][k]))
    trained = Check("trained", "passed" if moved else "failed",
                    f"{len(moved)} of {len(fixture)} tensors moved by training" if moved
                    else "the export at the save equals the untrained fixture: nothing was trained", tolerance=EXACT)
    return [
        state_check("export-after-load", exports["save"], exports["load"], f"hf@save@{src}", f"hf@load@{dst}",
                    f"{len(exports['load'])} trained tensors exported at {dst} after the load equal the export at {src}"),
        state_check("hf-import", exports["load"], exports["import"], f"hf@load@{dst}", f"hf@import@{dst}",
                    f"{len(exports['import'])} tensors of a model imported from that export, exported again, equal it"),
        trained,
        integrity,
    ]


class BridgeHfInterop(Case):
    name = "bridge-hf-interop"
    description = "a trained Bridge model's training checkpoint -> HF export -> HF import: the same weights"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"training_state"})
    checks = ("export-after-load", "hf-import", "trained", "export-integrity")

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        if opts.steps < 1:
            raise ValueError("option steps: at least 1 (untrained weights would prove little)")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.models.hf import write_fixture

        model = get_model(spec.model, "hf")
        hf_dir, ckpt, out = env.case_dir / "hf-source", env.case_dir / "ckpt", env.case_dir / "exports"
        with env.timed("fixture"):
            write_fixture(model, hf_dir)
        phase = dict(model=model, hf_dir=str(hf_dir), opts=opts, backend=ref_of(spec), ckpt=str(ckpt), out=str(out))
        env.launch("save", _rank, _Phase(topo=spec.source, role="save", **phase), spec.source)
        env.launch("load", _rank, _Phase(topo=spec.target, role="load", **phase), spec.target)
        env.launch("import", _rank, _Phase(topo=spec.target, role="import", **phase), spec.target)
        with env.timed("compare"):
            hf = get_backend(resolve("bridge_hf"))
            exports = {t: hf.read_full(None, out / f"hf@{t}") for t in TAGS}
            infos = source_infos(hf_dir)
            integrity = export_integrity([Expected(f"hf@{t}", out / f"hf@{t}", infos) for t in TAGS])
            result.checks.extend(judge(exports, hf.read_full(None, hf_dir), integrity, spec.source.id, spec.target.id))


CASE = BridgeHfInterop()
