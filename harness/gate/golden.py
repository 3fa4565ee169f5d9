"""The golden corpus: the artefacts users keep on disk, written by one environment, read by another.

`ckpt-harness golden make --out DIR` writes, from the current environment, every kind of artefact a
training stack leaves behind: a model-only dist checkpoint, model + distributed optimizer in
dp_reshardable and fully_reshardable form, an adapter-only dist checkpoint with its HF PEFT
adapter, a Bridge model's dist checkpoint with its HF export, and the training checkpoints of each
client (Megatron-FSDP fsdp_dtensor, a Bridge pretrain checkpoint, verl's manager layout where verl
is installed, an async-saved dist checkpoint, and a Bridge save with the release's default
checkpoint options); plus DIR/manifest.json (versions, environment, topology, model, sha256 of
every file, what each writer recorded). `ckpt-harness golden check DIR` loads them in the current
environment, at another topology, and checks them against the canonical truth (model weights, HF
fixture) or against the writer's own references (trained optimizer state, adapter parameters,
export bytes, a Bridge save's train state and RNG), which the writer stores beside the artefact.
An artefact this machine cannot write or read (its backend's package is missing) is `not-run`
with the reason, on both sides, never dropped.

The bump gate (harness/gate/bump.py) runs `make` in one environment and `check` in the other, both ways:
baseline-written files read by the candidate (must load bit-exact), and candidate-written files read
by the baseline (a rollback: a refusal is allowed, but it must be a named exception, not a crash).
CI caches a corpus per baseline pin hash, so a bump PR checks the real files the previous pins wrote.

A corpus is a user's directory: `check` reads its pickles weights_only (ckpt_content.refuse_pickles)
before megatron-core's loader unpickles them in full; a refused file is exit 2 without --trust-pickles.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from harness.backends import get_backend, resolve
from harness.core import truth
from harness.core.parity import EXACT, NOT_COMPARED
from harness.core.result import CaseResult, Check
from harness.core.spec import XFail
from harness.core.topology import Topology
from harness.faults import coverage_hook
from harness.judge.checks import assembled, state_check
from harness.judge.ckpt_content import UntrustedPickle, read_objects, refuse_pickles
from harness.judge.status import apply_expected_failure
from harness.orchestration.runner import RunOptions, case_envelope
from harness.run.envelope import RunEnv
from harness.gate import golden_parts as parts
from harness.gate.golden_parts import REFERENCE, hf_check, hf_make, load_reference, peft_check, peft_make, save_reference, split
from harness.gate.rollback import rollback_refusal

MANIFEST = "manifest.json"
NOT_WRITTEN = "not written: the writer could not make this artefact"
NOT_RUN = "not_run"  # a manifest entry's key: why the writer's machine could not make it (its reason)
#: the artefacts a manifest without a `known` list was written by a harness that knew (before issue 44 item 7)
FIRST_FIVE = ("model-dist", "optim-dp_reshardable", "optim-fully_reshardable", "hf-export", "peft-adapter")
FORMAT = 1
#: The known defect the dp_reshardable artefact may show, decided from what the load and the files
#: show (`step_not_loaded_check`), never from a version string: the checkpoint holds the writer's Adam
#: step, the load leaves per-param steps unwritten (they keep the primed sentinel, training.never_loaded).
#: Seen with megatron-core 0.19.2 + torch Adam (the smoke matrix's strict xfail).
STEP_NOT_LOADED = XFail("dp_reshardable + torch Adam: the load leaves per-param Adam steps unwritten (they keep their pre-load "
                        "value) although the checkpoint holds the writer's step (megatron-core DistributedOptimizer, seen in "
                        "0.19.2)", checks=("step",))
_KNOWN = {STEP_NOT_LOADED.reason: STEP_NOT_LOADED}


class CorpusError(ValueError):
    """A corpus directory that cannot be checked (no manifest, wrong format): exit 2."""


class UntrustedCorpus(CorpusError):
    """A corpus holding a pickle that weights_only loading refuses, checked without --trust-pickles:
    nothing of it is loaded (exit 2)."""


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
    #: the backends that read it back (their `refusals` are the clean refusals of a rollback)
    readers: tuple[str, ...] = ("mcore_dist",)
    #: a training artefact's backend and the writer's options; the reader's (None: the writer's)
    backend: str = "mcore_dist"
    backend_options: dict = field(default_factory=dict)
    read_options: dict | None = None
    #: what the machine must have (harness.core.requires); unmet, or a backend unavailable: not-run
    requires: tuple[str, ...] = ()

    def case_id(self, direction: str = "") -> str:
        return f"golden[{self.name}@{self.source.id}->{self.target.id}{'-' + direction if direction else ''}]"

    def refusals(self) -> tuple[str, ...]:
        """The exception names with which a reader of this artefact may cleanly refuse it."""
        return tuple(dict.fromkeys(n for b in self.readers for n in get_backend(b).refusals))


# --------------------------------------------------------------------------- model-only dist checkpoint
# Every artefact is written and read through its case's public steps (cases/*: save_step, load_step,
# read_step): the corpus runs the worlds the matrix runs, on files another environment wrote.


def _model_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from harness.cases.reshard_weights import save_step
    from harness.core.zoo import get_model

    save_step(env, result, get_model(a.model, "gpt"), a.source, resolve("mcore_dist"), d / "ckpt")
    return {}


def _model_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from harness.cases.reshard_weights import load_step, read_step
    from harness.core.zoo import get_model

    model, path = get_model(a.model, "gpt"), resolve("mcore_dist")
    loaded = load_step(env, result, model, a.target, path, d / "ckpt")
    plain = read_step(env, result, path, [d / "ckpt"])[str(d / "ckpt")]
    full, problems = assembled(loaded, "shards", a.target.id)
    canonical = {k: truth.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in full.items()}
    result.checks += [
        state_check("checkpoint-canonical", canonical, plain, "canonical", "corpus checkpoint", f"{len(plain)} tensors equal canonical"),
        state_check("loaded-canonical", canonical, full, "canonical", a.target.id,
                    f"{len(full)} tensors loaded at {a.target.id} equal canonical", problems=problems),
    ]


# --------------------------------------------------------------------------- model + distributed optimizer


def _optim_opts(a: Artefact, entry: dict | None = None):
    """The training options: the artefact's, or those the writer chose when it ran (the manifest's)."""
    from harness.models.training import TrainOptions

    return TrainOptions(**(entry or {}).get("options", a.options))


def _optim_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path, chosen: dict | None = None) -> dict:
    """Train and save through the artefact's backend (cases/reshard_optimizer.py save_step); keep the
    writer's optimizer and weights as its references. `chosen`: options the writer chose as it ran."""
    from harness.cases.reshard_optimizer import save_step, step_values
    from harness.core.zoo import get_model

    opts, ref = _optim_opts(a, chosen), parts.writer_ref(a, chosen)
    outs = save_step(env, result, get_model(a.model, "gpt"), opts, ref, a.source, d / "ckpt", opts.steps)
    optimizer, p1 = assembled(outs, "optimizer_shards", a.source.id)
    weights, p2 = assembled(outs, "model_shards", a.source.id)
    if p1 or p2:
        raise RuntimeError(f"the writer's own state does not assemble: {(p1 + p2)[:3]}")
    save_reference(d / REFERENCE, {**{f"optimizer/{k}": v for k, v in optimizer.items()}, **{f"model/{k}": v for k, v in weights.items()}})
    return {"steps": step_values(outs), **parts.written_records(a, env, result, d, outs, ref), **(chosen or {})}


def checkpoint_steps(directory: Path, trust_pickles: bool = False) -> list[float]:
    """The Adam step values a megatron-core torch_dist checkpoint holds, read from its files (no
    model, no process group): every `step` in the optimizer's saved objects (the DistributedOptimizer
    keeps torch Adam's per-param step in its param groups). [] when it holds none. The directory is a
    corpus (a user's): read with weights_only unless `trust_pickles` (then in full, as torch DCP does)."""
    if not trust_pickles:
        with parts.numpy_rng_arrays():
            objects = read_objects(directory)
        objects = {k: v for k, v in objects.items() if k.startswith("optimizer")}
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        meta = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        objects = {k: None for k, v in meta.items() if isinstance(v, BytesStorageMetadata) and k.startswith("optimizer")}
        if objects:
            dcp.load(objects, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    steps: set[float] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            for key, value in x.items():
                if key == "step" and isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
                    steps.add(float(value))
                else:
                    walk(value)
        elif isinstance(x, (list, tuple)):
            for value in x:
                walk(value)

    walk(list(objects.values()))
    return sorted(steps)


def step_not_loaded_check(step: Check, written: list[float], loaded: list[float], held: list[float]) -> tuple[Check, XFail | None]:
    """The step check of a corpus load, read against what the files hold: per-param steps (some or
    all) still at the primed sentinel where the checkpoint holds the writer's step is the known
    defect (STEP_NOT_LOADED: the check stays failed, named, and the artefact is an expected failure);
    a restored step passes and says the defect does not show; any other failure (a step reset to 0
    included: the load wrote a wrong step) stays a plain failure."""
    from harness.models.training import never_loaded

    if not step.failed:
        return Check(step.name, step.status, f"{step.detail}; the step is restored (the known dp_reshardable unloaded step "
                     "does not show here)", tolerance=step.tolerance), None
    unwritten = {x for x in loaded if never_loaded(x)}
    if written and unwritten and set(loaded) <= unwritten | set(written) and held == written:
        return Check(step.name, "failed", f"{step.detail}; the checkpoint holds step {held}: known defect: {STEP_NOT_LOADED.reason}",
                     tolerance=step.tolerance), STEP_NOT_LOADED
    return Check(step.name, "failed", f"{step.detail}; the checkpoint holds step(s) {held or 'none'}", tolerance=step.tolerance), None


def _optim_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from harness.cases.reshard_optimizer import (
        load_step,
        step_check,
        step_values,
        written_steps,
    )
    from harness.core.zoo import get_model

    from harness.backends._megatron_lm import iteration_dir

    opts, reader = _optim_opts(a, entry), parts.reader_ref(a, entry)
    result.notes += [f"workarounds applied: {', '.join(opts.workarounds)}"]
    complete = parts.complete_check(reader, d / "ckpt")
    if complete is not None:
        result.checks.append(complete)
        if complete.failed:  # never load what is not a finished checkpoint
            return
    loaded = load_step(env, result, get_model(a.model, "gpt"), opts, reader, a.target, d / "ckpt", opts.steps)
    ref = load_reference(d / REFERENCE)
    optimizer, p1 = assembled(loaded, "optimizer_shards", a.target.id)
    weights, p2 = assembled(loaded, "model_shards", a.target.id)
    result.checks += [
        state_check("optimizer-state", split(ref, "optimizer/"), optimizer, "writer", a.target.id,
                    f"{len(optimizer)} optimizer tensors equal what the writer held", problems=p1),
        state_check("model-weights", split(ref, "model/"), weights, "writer", a.target.id, f"{len(weights)} weights equal", problems=p2),
    ]
    step = step_check(written_steps(entry["steps"]), loaded, "writer", a.target.id)
    if opts.sharding == "dp_reshardable":
        held = checkpoint_steps(iteration_dir(d / "ckpt"), entry.get("trust_pickles", False)) if step.failed else list(entry["steps"])
        step, known = step_not_loaded_check(step, list(entry["steps"]), step_values(loaded), held)
        if known is not None:
            result.xfail_reason = known.reason
    result.checks.append(step)
    result.checks += parts.backend_checks(a, env, entry, reader)


def _defaults_make(a: Artefact, env: RunEnv, result: CaseResult, d: Path) -> dict:
    """A Bridge training save with no checkpoint option set: the installed release's CheckpointConfig
    defaults choose the optimizer format (parts.release_defaults); the manifest records them and the
    content metadata the checkpoint then carries (its distrib_optim_sharding_type)."""
    options, backend_options, read = parts.release_defaults()
    extra = _optim_make(a, env, result, d, {"options": options, "backend_options": backend_options})
    return {**extra, "defaults": read, "content_metadata": parts.content_metadata(d / "ckpt")}


def _defaults_check(a: Artefact, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    result.checks.append(parts.content_metadata_check(entry.get("content_metadata"), parts.content_metadata(d / "ckpt")))
    _optim_check(a, env, result, d, entry)


ARTEFACTS: tuple[Artefact, ...] = (
    Artefact("model-dist", "gpt-gqa", Topology(tp=2), Topology(pp=2), "model-only torch_dist checkpoint", _model_make, _model_check),
    Artefact("optim-dp_reshardable", "gpt-gqa", Topology(dp=2), Topology(), "model + distributed optimizer, dp_reshardable",
             _optim_make, _optim_check, {"sharding": "dp_reshardable"}),
    Artefact("optim-fully_reshardable", "gpt-gqa", Topology(dp=2), Topology(tp=2), "model + distributed optimizer, fully_reshardable",
             _optim_make, _optim_check, {"sharding": "fully_reshardable"}),
    Artefact("hf-export", "hf-llama", Topology(tp=2), Topology(pp=2), "Bridge model dist checkpoint + its HF export", hf_make, hf_check,
             readers=("mcore_dist", "bridge_hf")),
    Artefact("peft-adapter", "hf-llama", Topology(tp=2), Topology(pp=2), "adapter-only dist checkpoint + its HF PEFT adapter (LoRA)",
             peft_make, peft_check, readers=("mcore_dist", "bridge_peft", "bridge_hf")),
    # the training checkpoints users keep, each through its backend as the matrices run it (cases/reshard_optimizer.py steps)
    Artefact("fsdp-dtensor", "gpt-gqa", Topology(dp=2), Topology(), "Megatron-FSDP fsdp_dtensor training checkpoint (model + optimizer)",
             _optim_make, _optim_check, {"sharding": "dp_reshardable"}, readers=("mcore_fsdp",), backend="mcore_fsdp"),
    Artefact("bridge-pretrain", "gpt-gqa", Topology(dp=2), Topology(), "Megatron-Bridge training checkpoint as pretrain leaves it "
             "(iter_N/, train_state.pt, tracker: model, optimizer, scheduler, RNG, train state)", _optim_make, _optim_check,
             {"sharding": "fully_reshardable"}, readers=("bridge_training",), backend="bridge_training"),
    Artefact("verl-manager", "gpt-gqa", Topology(dp=2), Topology(), "verl MegatronCheckpointManager layout (global_step_N/actor, "
             "tracker, ckpt_contents.json)", _optim_make, _optim_check, {"sharding": "fully_reshardable"},
             readers=("verl_manager",), backend="verl_manager", requires=("module:verl",)),
    Artefact("optim-async", "gpt-gqa", Topology(dp=2), Topology(tp=2), "model + distributed optimizer saved async (mcore writer), "
             "finalized", _optim_make, _optim_check, {"sharding": "fully_reshardable"}, backend_options={"async_save": "mcore"},
             read_options={}),
    Artefact("release-defaults", "gpt-gqa", Topology(dp=2), Topology(), "Bridge training checkpoint with no checkpoint option set "
             "(the release's default optimizer format)", _defaults_make, _defaults_check, readers=("bridge_training",),
             backend="bridge_training"),
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


def _selected(k: str | None, ids: list[str] | None = None, direction: str = "") -> list[Artefact]:
    """The artefacts whose id holds every word of `k` and, with `ids`, is one of them (`--id`)."""
    return [a for a in ARTEFACTS if (not k or all(w in a.case_id() for w in k.split()))
            and (ids is None or a.case_id(direction) in ids)]


def make(out: Path, options: RunOptions | None = None, k: str | None = None, ids: list[str] | None = None) -> list[CaseResult]:
    """Write the corpus into `out` (which must not exist yet: a corpus is never overwritten); `ids`:
    only the artefacts of these check ids (`golden make --id`)."""
    from harness.report import results as report
    from harness.run.preload import warm

    options = options or RunOptions()
    if out.exists():
        raise CorpusError(f"{out}: exists; a corpus is written once, into a new directory")
    out.mkdir(parents=True)
    manifest = {"format": FORMAT, "versions": report.versions(), "environment": (report.environment() or {}).get("key"),
                "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "known": [a.name for a in ARTEFACTS], "artefacts": {}}
    results = []
    for a in _selected(k, ids):
        coverage_hook.case(a.case_id())  # a mutation campaign's measured write only: this artefact's lines, under its check's id
        result = CaseResult(a.case_id("make"), "golden-make", a.model, a.name, a.source.id, a.target.id)
        d = out / a.name
        d.mkdir()
        entry = {"model": a.model, "source": a.source.id, "target": a.target.id, "description": a.description}
        why = parts.unavailable(a, options.dist_backend)
        if why is not None:  # recorded with its reason, never dropped: the reader says not-run too
            result.status, result.not_run_reason = "not-run", why
            manifest["artefacts"][a.name] = {**entry, "files": {}, NOT_RUN: why}
            results.append(result)
            continue
        written: dict = {}
        with case_envelope(result, options) as env:  # one artefact failing to write must not lose the others
            warm(bridge=a.model.startswith("hf-"), modules=parts.preload(a))
            extra = a.make(a, env, result, d)
            written = {"files": _files(d), **extra}
            result.checks.append(Check("written", "passed", f"{len(written['files'])} files", tolerance=NOT_COMPARED))
        manifest["artefacts"][a.name] = {**entry, **written} if result.status == "passed" else {**entry, "files": {}, "error": result.error}
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


def screen(corpus: Path, names: list[str]) -> int:
    """Read every pickle of the named artefact directories with weights_only semantics (the corpus
    is a user's directory, and the loaders after this unpickle in full); UntrustedCorpus names the
    first file (and DCP item) refused and the opt-in flag. Returns the number of pickles read."""
    n = 0
    for name in names:
        try:
            with parts.numpy_rng_arrays():  # a training checkpoint's RNG state (np.random.get_state)
                n += refuse_pickles(corpus / name) if (corpus / name).is_dir() else 0
        except UntrustedPickle as exc:
            raise UntrustedCorpus(f"golden check: {exc}") from None
    return n


def check(corpus: Path, options: RunOptions | None = None, k: str | None = None, allow_refusal: bool = False,
          direction: str = "", trust_pickles: bool = False, ids: list[str] | None = None) -> list[CaseResult]:
    """Load every artefact of the corpus here, at its target topology, and judge it.

    Before anything loads, every pickle of the selected artefacts is read with weights_only
    semantics (`screen`): a file that would need full unpickling raises UntrustedCorpus unless
    `trust_pickles` (the CLI's --trust-pickles), since megatron-core's loader unpickles in full.

    allow_refusal (a rollback: an older stack reading newer files): a load that raises one of the
    exceptions its readers name (Artefact.refusals: megatron-core's CheckpointingException, the
    format errors of each backend) passes as a clean refusal, with the exception quoted; any other
    exception (an AttributeError or KeyError inside the older stack) fails, naming the frame that
    raised it; a hang or a rank that died without a Python exception is an error."""
    from harness.run.preload import warm

    options = options or RunOptions()
    manifest = read_manifest(corpus)
    changed = {a.name: sorted(f for f, sha in entry["files"].items()
                              if not (corpus / a.name / f).is_file() or _sha256(corpus / a.name / f) != sha)
               for a in _selected(k, ids, direction) if (entry := manifest["artefacts"].get(a.name)) is not None and not {"error", NOT_RUN} & set(entry)}
    if not trust_pickles:  # only what will load: a file that differs from the manifest fails its artefact unread
        screen(corpus, [name for name, files in changed.items() if not files])
    results = []
    for a in _selected(k, ids, direction):
        result = CaseResult(a.case_id(direction), "golden", a.model, a.name, a.source.id, a.target.id,
                            notes=[f"written by {_versions_line(manifest['versions'])}"])
        entry = manifest["artefacts"].get(a.name)
        if entry is None and a.name not in manifest.get("known", FIRST_FIVE):  # a corpus older than the artefact
            result.status = "not-run"
            result.not_run_reason = f"{corpus}: written by a harness that did not know the {a.name!r} artefact (a corpus made before it)"
            results.append(result)
            continue
        if entry is None:
            result.status, result.error = "error", f"{corpus}: the corpus has no {a.name!r} artefact (made with -k?)"
            results.append(result)
            continue
        if "error" in entry:
            result.status = "error"
            result.error = f"{NOT_WRITTEN}: {entry['error'].strip().splitlines()[0]}"
            results.append(result)
            continue
        why = f"{NOT_WRITTEN}: {entry[NOT_RUN]}" if NOT_RUN in entry else parts.unavailable(a, options.dist_backend)
        if why is not None:
            result.status, result.not_run_reason = "not-run", why
            results.append(result)
            continue
        if changed[a.name]:
            result.checks.append(Check("corpus-integrity", "failed",
                                       f"{len(changed[a.name])} file(s) differ from the manifest: {changed[a.name][:5]}"))
            result.status = "failed"
            results.append(result)
            continue
        coverage_hook.case(result.id)  # a mutation campaign's measured corpus check only: this artefact's lines
        with case_envelope(result, options) as env:
            warm(bridge=a.model.startswith("hf-"), modules=parts.preload(a))
            try:
                a.check(a, env, result, corpus / a.name, {**entry, "trust_pickles": trust_pickles})
            except Exception as exc:
                refusal = rollback_refusal(exc, a.refusals(), f"{a.source.id} -> {a.target.id}") if allow_refusal else None
                if refusal is None:
                    raise  # the envelope reports it as the artefact's error
                result.checks.append(refusal)
        # the check names the known defect it meets (result.xfail_reason) while it runs: applied after it
        apply_expected_failure(_KNOWN.get(result.xfail_reason or ""), result)
        results.append(result)
    return results


def _versions_line(v: dict) -> str:
    return ", ".join(f"{k} {v.get(k)}" for k in ("megatron-core", "megatron-bridge", "torch", "transformers", "peft"))
