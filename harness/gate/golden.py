"""The golden corpus: the artefacts users keep on disk, written by one environment, read by another.

`ckpt-harness golden make --out DIR` writes, from the current environment, every kind of artefact a
training stack leaves behind: a model-only dist checkpoint, model + distributed optimizer in
dp_reshardable and fully_reshardable form, an adapter-only dist checkpoint with its HF PEFT
adapter, and a Bridge model's dist checkpoint with its HF export; plus DIR/manifest.json (versions,
environment, topology, model, sha256 of every file). `ckpt-harness golden check DIR` loads them in
the current environment, at another topology, and checks them against the canonical truth (model
weights, HF fixture) or against the writer's own references (trained optimizer state, adapter
parameters, export bytes), which the writer stores beside the artefact.

The bump gate (harness/gate/bump.py) runs `make` in one environment and `check` in the other, both ways:
baseline-written files read by the candidate (must load bit-exact), and candidate-written files read
by the baseline (a rollback: a refusal is allowed, but it must be a named exception, not a crash).
CI caches a corpus per baseline pin hash, so a bump PR checks the real files the previous pins wrote.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from harness.backends import get_backend, resolve
from harness.core import truth
from harness.core.result import CaseResult, Check
from harness.core.topology import Topology
from harness.judge.checks import assembled, refusal_check, state_check
from harness.orchestration.runner import RunOptions, error_text
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, WorldTimeout, exception_of

MANIFEST = "manifest.json"
REFERENCE = "reference.safetensors"
NOT_WRITTEN = "not written: the writer could not make this artefact"
FORMAT = 1


class CorpusError(ValueError):
    """A corpus directory that cannot be checked (no manifest, wrong format): exit 2."""


@dataclass(frozen=True)
class Artefact:
    name: str
    model: str
    source: Topology
    target: Topology
    description: str
    make: Callable[["Artefact", RunEnv, CaseResult, Path], dict]
    check: Callable[["Artefact", RunEnv, CaseResult, Path, dict], None]
    options: dict = field(default_factory=dict)  # the case options the artefact is written with

    def case_id(self, direction: str = "") -> str:
        return f"golden[{self.name}@{self.source.id}->{self.target.id}{'-' + direction if direction else ''}]"


def _save_reference(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _load_reference(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _split(ref: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in ref.items() if k.startswith(prefix)}


# --------------------------------------------------------------------------- model-only dist checkpoint


def _model_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from cases.reshard_weights import _Phase, _rank_phase
    from harness.core.zoo import get_model

    env.launch(result, "save", _rank_phase, _Phase(get_model(a.model, "gpt"), a.source, resolve("mcore_dist"), None, str(d / "ckpt"), False),
               a.source)
    return {}


def _model_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from cases.reshard_weights import _Phase, _rank_phase, _rank_read
    from harness.core.zoo import get_model

    model, path = get_model(a.model, "gpt"), resolve("mcore_dist")
    loaded = env.launch(result, "load", _rank_phase, _Phase(model, a.target, path, str(d / "ckpt"), None, False), a.target)
    plain = env.launch(result, "read", _rank_read, (path, [str(d / "ckpt")]), None)[0][str(d / "ckpt")]
    full, problems = assembled(loaded, "shards", a.target.id)
    canonical = {k: truth.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in full.items()}
    result.checks += [
        state_check("checkpoint-canonical", canonical, plain, "canonical", "corpus checkpoint", f"{len(plain)} tensors equal canonical"),
        state_check("loaded-canonical", canonical, full, "canonical", a.target.id,
                    f"{len(full)} tensors loaded at {a.target.id} equal canonical", problems=problems),
    ]


# --------------------------------------------------------------------------- model + distributed optimizer


def _optim_opts(a: Artefact):
    from harness.models.training import TrainOptions

    return TrainOptions(**a.options)


def _optim_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from cases._train_phase import phase_of, train_phase
    from harness.core.zoo import get_model

    opts = _optim_opts(a)
    outs = env.launch(result, "save", train_phase, phase_of(
        get_model(a.model, "gpt"), opts, resolve("mcore_dist"), topo=a.source, save_to=str(d / "ckpt"), steps_before_save=opts.steps), a.source)
    optimizer, p1 = assembled(outs, "optimizer_shards", a.source.id)
    weights, p2 = assembled(outs, "model_shards", a.source.id)
    if p1 or p2:
        raise RuntimeError(f"the writer's own state does not assemble: {(p1 + p2)[:3]}")
    _save_reference(d / REFERENCE, {**{f"optimizer/{k}": v for k, v in optimizer.items()}, **{f"model/{k}": v for k, v in weights.items()}})
    return {"steps": sorted({x for o in outs for x in o.steps["values"]})}


def _optim_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from cases._train_phase import TrainOut, phase_of, train_phase
    from cases.reshard_optimizer import step_check
    from harness.core.zoo import get_model

    opts = _optim_opts(a)
    result.notes += [f"workarounds applied: {', '.join(opts.workarounds)}"]
    loaded = env.launch(result, "load", train_phase, phase_of(
        get_model(a.model, "gpt"), opts, resolve("mcore_dist"), topo=a.target, load_from=str(d / "ckpt"), first_step=opts.steps), a.target)
    ref = _load_reference(d / REFERENCE)
    optimizer, p1 = assembled(loaded, "optimizer_shards", a.target.id)
    weights, p2 = assembled(loaded, "model_shards", a.target.id)
    result.checks += [
        state_check("optimizer-state", _split(ref, "optimizer/"), optimizer, "writer", a.target.id,
                    f"{len(optimizer)} optimizer tensors equal what the writer held", problems=p1),
        state_check("model-weights", _split(ref, "model/"), weights, "writer", a.target.id, f"{len(weights)} weights equal", problems=p2),
    ]
    if opts.sharding == "dp_reshardable":
        result.checks.append(Check("step", "not-run", "dp_reshardable + torch Adam resets the Adam step on load (megatron-core "
                                   "0.19.2; the smoke matrix shows it as a strict xfail), so the step is not compared", tolerance="-"))
    else:
        written = TrainOut([], [], [], steps={"values": entry["steps"], "shared_step_tensors": 0})
        result.checks.append(step_check([written], loaded, "writer", a.target.id))


# --------------------------------------------------------------------------- Bridge: HF export and PEFT adapter


def _hf_phase(a: Artefact, d: Path, topo: Topology, load_weights: bool, **kw):
    """The writer builds from the HF fixture; the reader builds without weights and loads the dist checkpoint."""
    from cases.hf_roundtrip import DdpKnobs, _Phase
    from harness.core.zoo import get_model

    return _Phase(get_model(a.model, "hf"), str(d / "hf-source"), topo, load_weights, DdpKnobs(),
                  export_backend=resolve("bridge_hf"), dist_backend=resolve("mcore_dist"), **kw)


def _hf_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from cases.hf_roundtrip import _rank
    from harness.core.zoo import get_model
    from harness.models.hf import write_fixture

    write_fixture(get_model(a.model, "hf"), d / "hf-source")
    env.launch(result, "save", _rank, _hf_phase(a, d, a.source, True, dist_save=str(d / "ckpt"), export_to=str(d / "hf-export")), a.source)
    return {}


def _hf_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from cases.hf_roundtrip import _rank

    mine = env.case_dir / "hf-export"
    env.launch(result, "load", _rank, _hf_phase(a, d, a.target, False, dist_load=str(d / "ckpt"), export_to=str(mine)), a.target)
    hf = get_backend("bridge_hf")
    exported = hf.read_full(None, mine)
    result.checks += [
        state_check("export-equals-writer", hf.read_full(None, d / "hf-export"), exported, "writer's export", f"export@{a.target.id}",
                    f"{len(exported)} tensors exported from the writer's checkpoint equal the writer's own export"),
        state_check("export-bitwise", hf.read_full(None, d / "hf-source"), exported, "hf-source", f"export@{a.target.id}",
                    "the export equals the HF fixture"),
    ]


def _peft_phase(a: Artefact, d: Path, topo: Topology, fill: bool, **kw):
    from cases.peft_export import PeftOptions, _Phase
    from harness.core.zoo import get_model

    return _Phase(get_model(a.model, "hf"), str(d / "hf-source"), topo, PeftOptions().spec(), fill,
                  export_backend=resolve("bridge_peft"), dist_backend=resolve("mcore_dist"), merge_backend=resolve("bridge_hf"), **kw)


def _peft_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from cases.peft_export import _rank
    from harness.core.zoo import get_model
    from harness.models import peft_mapping
    from harness.models.hf import write_fixture

    write_fixture(get_model(a.model, "hf"), d / "hf-source")
    outs = env.launch(result, "save", _rank, _peft_phase(a, d, a.source, True, adapter_save=str(d / "ckpt"), export_to=str(d / "adapter")),
                      a.source)
    _save_reference(d / REFERENCE, peft_mapping.gather([p for o in outs for p in o.pieces]))
    return {}


def _peft_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from cases.peft_export import _peft_load_problems, _rank
    from harness.models import peft_mapping

    mine = env.case_dir / "adapter"
    outs = env.launch(result, "load", _rank, _peft_phase(a, d, a.target, False, adapter_load=str(d / "ckpt"), export_to=str(mine)), a.target)
    peft = get_backend("bridge_peft")
    problems = _peft_load_problems(d / "hf-source", d / "adapter")
    result.checks += [
        state_check("adapter-params", _load_reference(d / REFERENCE), peft_mapping.gather([p for o in outs for p in o.pieces]),
                    "writer", a.target.id, "Megatron adapter parameters loaded from the writer's checkpoint equal the writer's"),
        state_check("adapter-export-equals-writer", peft.read_full(None, d / "adapter"), peft.read_full(None, mine),
                    "writer's adapter", f"adapter@{a.target.id}", "the adapter exported here equals the writer's, bitwise"),
        Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or "the writer's adapter loads into this peft",
              tolerance="exact"),
    ]


ARTEFACTS: tuple[Artefact, ...] = (
    Artefact("model-dist", "gpt-gqa", Topology(tp=2), Topology(pp=2), "model-only torch_dist checkpoint", _model_make, _model_check),
    Artefact("optim-dp_reshardable", "gpt-gqa", Topology(dp=2), Topology(), "model + distributed optimizer, dp_reshardable",
             _optim_make, _optim_check, {"sharding": "dp_reshardable"}),
    Artefact("optim-fully_reshardable", "gpt-gqa", Topology(dp=2), Topology(tp=2), "model + distributed optimizer, fully_reshardable",
             _optim_make, _optim_check, {"sharding": "fully_reshardable"}),
    Artefact("hf-export", "hf-llama", Topology(tp=2), Topology(pp=2), "Bridge model dist checkpoint + its HF export", _hf_make, _hf_check),
    Artefact("peft-adapter", "hf-llama", Topology(tp=2), Topology(pp=2), "adapter-only dist checkpoint + its HF PEFT adapter (LoRA)",
             _peft_make, _peft_check),
)


# --------------------------------------------------------------------------- make and check


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): _sha256(p) for p in sorted(d.rglob("*")) if p.is_file()}


def _selected(k: str | None) -> list[Artefact]:
    return [a for a in ARTEFACTS if not k or all(w in a.case_id() for w in k.split())]


def _env(scratch: Path, options: RunOptions) -> RunEnv:
    return RunEnv(scratch, options.dist_backend, 600.0, options.launcher, options.torchrun_template, options.start_method,
                  tuple(options.rank_hooks))


def make(out: Path, options: RunOptions | None = None, k: str | None = None) -> list[CaseResult]:
    """Write the corpus into `out` (which must not exist yet: a corpus is never overwritten)."""
    from harness.report import results as report
    from harness.run.preload import warm

    options = options or RunOptions()
    if out.exists():
        raise CorpusError(f"{out}: exists; a corpus is written once, into a new directory")
    out.mkdir(parents=True)
    manifest = {"format": FORMAT, "versions": report.versions(), "environment": (report.environment() or {}).get("key"),
                "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "artefacts": {}}
    results = []
    for a in _selected(k):
        result = CaseResult(a.case_id("make"), "golden-make", a.model, a.name, a.source.id, a.target.id)
        d = out / a.name
        d.mkdir()
        with tempfile.TemporaryDirectory(prefix="ckpt-harness-golden-") as scratch:
            try:
                warm(bridge=a.model.startswith("hf-"))
                extra = a.make(a, _env(Path(scratch), options), result, d)
                files = _files(d)
                manifest["artefacts"][a.name] = {"model": a.model, "source": a.source.id, "target": a.target.id,
                                                 "description": a.description, "files": files, **extra}
                result.checks.append(Check("written", "passed", f"{len(files)} files", tolerance="-"))
                result.status = "passed"
            except Exception as exc:  # one artefact failing to write must not lose the others
                result.status, result.error = "error", error_text(exc)
                manifest["artefacts"][a.name] = {"model": a.model, "source": a.source.id, "target": a.target.id,
                                                 "description": a.description, "files": {}, "error": result.error}
        results.append(result)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return results


def read_manifest(corpus: Path) -> dict:
    try:
        manifest = json.loads((corpus / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{corpus}: not a golden corpus ({MANIFEST}: {exc})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("artefacts"), dict):
        raise CorpusError(f"{corpus}/{MANIFEST}: format {manifest.get('format')!r}, this harness reads format {FORMAT}")
    return manifest


def check(corpus: Path, options: RunOptions | None = None, k: str | None = None, allow_refusal: bool = False,
          direction: str = "") -> list[CaseResult]:
    """Load every artefact of the corpus here, at its target topology, and judge it.

    allow_refusal (a rollback: an older stack reading newer files): a load that raises a named
    exception passes as a clean refusal, with the exception quoted; a crash or a hang does not."""
    from harness.run.preload import warm

    options = options or RunOptions()
    manifest = read_manifest(corpus)
    results = []
    for a in _selected(k):
        result = CaseResult(a.case_id(direction), "golden", a.model, a.name, a.source.id, a.target.id,
                            notes=[f"written by {_versions_line(manifest['versions'])}"])
        entry = manifest["artefacts"].get(a.name)
        start = time.perf_counter()
        if entry is None:
            result.status, result.error = "error", f"{corpus}: the corpus has no {a.name!r} artefact (made with -k?)"
            results.append(result)
            continue
        if "error" in entry:
            result.status = "error"
            result.error = f"{NOT_WRITTEN}: {entry['error'].strip().splitlines()[0]}"
            results.append(result)
            continue
        changed = sorted(f for f, sha in entry["files"].items() if not (corpus / a.name / f).is_file() or _sha256(corpus / a.name / f) != sha)
        if changed:
            result.checks.append(Check("corpus-integrity", "failed", f"{len(changed)} file(s) differ from the manifest: {changed[:5]}"))
            result.status = "failed"
            results.append(result)
            continue
        with tempfile.TemporaryDirectory(prefix="ckpt-harness-golden-") as scratch:
            try:
                warm(bridge=a.model.startswith("hf-"))
                a.check(a, _env(Path(scratch), options), result, corpus / a.name, entry)
                result.status = "failed" if result.failed_checks else "passed"
            except WorldError as exc:
                exc_type, message = exception_of(exc.rank_traceback or "")
                if allow_refusal and exc_type and not isinstance(exc, WorldTimeout):
                    result.checks.append(refusal_check(exc_type, message, [exc_type], f"{a.source.id} -> {a.target.id}",
                                                       "an older stack refuses files a newer one wrote"))
                    result.status = "passed"
                else:
                    result.status, result.error = "error", error_text(exc)
            except Exception as exc:
                result.status, result.error = "error", error_text(exc)
        result.phases["total"] = round(time.perf_counter() - start, 3)
        results.append(result)
    return results


def _versions_line(v: dict) -> str:
    return ", ".join(f"{k} {v.get(k)}" for k in ("megatron-core", "megatron-bridge", "torch", "transformers", "peft"))
