"""Parts of the golden corpus (harness.gate.golden) that need nothing of it: the writer's stored
references, the Bridge HF-export and PEFT-adapter artefacts, and what the training artefacts record
besides their references (an async save's finalize, the backend's own save records, the defaults a
release writes with, whether the backend's readers are installed here)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from harness.backends import BackendRef, get_backend, resolve
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.judge.checks import state_check
from harness.run.envelope import RunEnv

REFERENCE = "reference.safetensors"


def save_reference(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def split(ref: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in ref.items() if k.startswith(prefix)}


@contextmanager
def numpy_rng_arrays() -> Iterator[None]:
    """Let the weights_only screen (harness.judge.ckpt_content) read numpy's uint32 arrays: the RNG
    state a Megatron-Bridge or Megatron-FSDP training checkpoint saves (np.random.get_state()) is
    one, rebuilt by numpy._core.multiarray._reconstruct. Only numpy's array reconstruction and that
    dtype are added; any other global still refuses."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed the module numpy.core was
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        yield


# --------------------------------------------------------------------------- Bridge: HF export and PEFT adapter


def hf_make(a: Any, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from harness.cases.hf_roundtrip import save_step
    from harness.core.zoo import get_model
    from harness.models.hf import write_fixture

    model = get_model(a.model, "hf")
    write_fixture(model, d / "hf-source")
    save_step(env, result, model, d / "hf-source", a.source, resolve("bridge_hf"), dist_save=d / "ckpt", export_to=d / "hf-export")
    return {}


def hf_check(a: Any, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    """The reader builds without weights (from the writer's HF config) and loads the dist checkpoint."""
    from harness.cases.hf_roundtrip import load_step
    from harness.core.zoo import get_model

    mine = env.case_dir / "hf-export"
    load_step(env, result, get_model(a.model, "hf"), d / "hf-source", a.target, resolve("bridge_hf"), d / "ckpt", export_to=mine)
    hf = get_backend("bridge_hf")
    exported = hf.read_full(None, mine)
    result.checks += [
        state_check("export-equals-writer", hf.read_full(None, d / "hf-export"), exported, "writer's export", f"export@{a.target.id}",
                    f"{len(exported)} tensors exported from the writer's checkpoint equal the writer's own export"),
        state_check("export-bitwise", hf.read_full(None, d / "hf-source"), exported, "hf-source", f"export@{a.target.id}",
                    "the export equals the HF fixture"),
    ]


def _adapter():
    from harness.cases.peft_export import PeftOptions

    return PeftOptions().spec()


def peft_make(a: Any, env: RunEnv, result: CaseResult, d: Path) -> dict:
    from harness.cases.peft_export import save_step
    from harness.core.zoo import get_model
    from harness.models import peft_mapping
    from harness.models.hf import write_fixture

    model = get_model(a.model, "hf")
    write_fixture(model, d / "hf-source")
    outs = save_step(env, result, model, d / "hf-source", a.source, _adapter(), resolve("bridge_peft"),
                     adapter_save=d / "ckpt", export_to=d / "adapter")
    save_reference(d / REFERENCE, peft_mapping.gather([p for o in outs for p in o.pieces]))
    return {}


def peft_check(a: Any, env: RunEnv, result: CaseResult, d: Path, entry: dict) -> None:
    from harness.cases.peft_export import load_step, peft_load_problems
    from harness.core.zoo import get_model
    from harness.models import peft_mapping

    mine = env.case_dir / "adapter"
    outs = load_step(env, result, get_model(a.model, "hf"), d / "hf-source", a.target, _adapter(), resolve("bridge_peft"),
                     d / "ckpt", export_to=mine)
    peft = get_backend("bridge_peft")
    problems = peft_load_problems(d / "hf-source", d / "adapter")
    result.checks += [
        state_check("adapter-params", load_reference(d / REFERENCE), peft_mapping.gather([p for o in outs for p in o.pieces]),
                    "writer", a.target.id, "Megatron adapter parameters loaded from the writer's checkpoint equal the writer's"),
        state_check("adapter-export-equals-writer", peft.read_full(None, d / "adapter"), peft.read_full(None, mine),
                    "writer's adapter", f"adapter@{a.target.id}", "the adapter exported here equals the writer's, bitwise"),
        Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or "the writer's adapter loads into this peft",
              tolerance=EXACT),
    ]


# --------------------------------------------------------------------------- training artefacts: backends and records


def writer_ref(a: Any, entry: dict | None = None) -> BackendRef:
    """The backend that writes artefact `a` with the writer's options (a manifest entry's
    `backend_options` where the writer chose them when it ran: the release defaults)."""
    return resolve(a.backend, (entry or {}).get("backend_options", a.backend_options))


def reader_ref(a: Any, entry: dict | None = None) -> BackendRef:
    """The backend that reads it back: the writer's, with `a.read_options` where given (an async
    writer's checkpoint is read by a plain load)."""
    return writer_ref(a, entry) if a.read_options is None else resolve(a.backend, a.read_options)


def unavailable(a: Any, dist_backend: str = "auto") -> str | None:
    """Why this machine cannot write or read artefact `a` (harness.core.requires over `a.requires`,
    and each backend's own `unavailable`: verl_manager without verl, ray or tensordict), or None."""
    from harness.core.requires import unmet

    reasons = unmet(tuple(a.requires), max(a.source.world_size, a.target.world_size), dist_backend)
    for ref in dict.fromkeys((writer_ref(a), reader_ref(a))):
        why = get_backend(ref).unavailable()
        if why:
            reasons.append(why)
    return "; ".join(dict.fromkeys(reasons)) or None


def preload(a: Any) -> tuple[str, ...]:
    """The modules the parent imports before the artefact's worlds fork (harness.run.preload.warm)."""
    return tuple(dict.fromkeys(m for ref in (writer_ref(a), reader_ref(a)) for m in get_backend(ref).preload))


def written_records(a: Any, env: RunEnv, result: CaseResult, d: Path, outs: list, ref: BackendRef) -> dict:
    """What a training artefact's writer keeps beside its references: an async save's finalize
    (harness.judge.checks.finalize_gate: a save that never completed is not kept, it raises), and
    what the backend recorded of its saves (bridge_training: iteration, train state, RNG digests),
    which its `strategy_check` judges a load against."""
    from harness.judge.checks import finalize_gate

    extra: dict = {}
    finalized = finalize_gate(get_backend(ref), outs, [str(d / "ckpt")])
    if finalized is not None:
        if finalized.failed:
            raise RuntimeError(f"{a.name}: the async save never completed, nothing is kept: {finalized.detail}")
        result.checks.append(finalized)
        extra["finalized"] = finalized.detail
    saves = env.record.backend_events.get("save") or {}
    if any(saves.values()):
        extra["events"] = json.loads(json.dumps(saves, default=str))
    return extra


def complete_check(ref: BackendRef, directory: Path) -> Check | None:
    """`checkpoint-complete`: the checkpoint is complete by the reader's own rule (torch_dist: its
    metadata.json and .metadata; a root: the tracker names a finished iteration); None where the
    backend has no rule."""
    done = get_backend(ref).checkpoint_complete(directory)
    if done is None:
        return None
    return Check("checkpoint-complete", "passed" if done else "failed",
                 "complete by the reader's rule" if done else f"{directory.name}: not a complete checkpoint by the reader's rule "
                 "(a finalize never ran, or a file is missing): not loaded", tolerance=EXACT)


def backend_checks(a: Any, env: RunEnv, entry: dict, ref: BackendRef) -> list[Check]:
    """The reader backend's own checks (bridge_training: train-state, flops, rng-state) of this
    load against the writer's stored save records; only where the reader runs the writer's options
    (a check of the options asked would judge the writer's saves by the reader's options)."""
    saves = entry.get("events")
    if a.read_options is not None or not saves:
        return []
    events = {**{k: v for k, v in env.record.backend_events.items() if k != "save"}, "save": saves}
    got = get_backend(ref).strategy_check(events)
    return list(got) if isinstance(got, (list, tuple)) else [got] if got is not None else []


# --------------------------------------------------------------------------- what a release writes by default


def release_defaults() -> tuple[dict, dict, dict]:
    """(training options, bridge_training options, the defaults read) of a Megatron-Bridge job whose
    user set no checkpoint option: the installed release's CheckpointConfig() decides the
    distributed optimizer's format (dist_ckpt_optim_fully_reshardable, ..._mem_efficient), the
    fully-parallel save and the load strictness."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.training.config import CheckpointConfig

    c = CheckpointConfig()
    read = {k: getattr(c, k, None) for k in ("dist_ckpt_optim_fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient",
                                             "fully_parallel_save", "dist_ckpt_strictness", "async_save", "ckpt_format")}
    if read["ckpt_format"] != "torch_dist" or read["async_save"]:
        raise RuntimeError(f"CheckpointConfig() defaults to {read}: the defaults artefact writes a synchronous torch_dist save")
    fully = bool(read["dist_ckpt_optim_fully_reshardable"])
    options = {"sharding": "fully_reshardable" if fully else "dp_reshardable",
               "mem_efficient": bool(read["distrib_optim_fully_reshardable_mem_efficient"]) and fully}
    backend = {"fully_parallel_save": bool(read["fully_parallel_save"]), "dist_ckpt_strictness": read["dist_ckpt_strictness"]}
    return options, backend, read


def content_metadata(directory: Path) -> dict | None:
    """The content metadata a torch_dist checkpoint carries (megatron-core's load_content_metadata
    of the iteration its tracker names: the distributed optimizer's sharding type and the rest of
    what the writer passed), JSON-plain; None when the writer stored none."""
    from megatron.core import dist_checkpointing

    from harness.backends._megatron_lm import iteration_dir

    found = dist_checkpointing.load_content_metadata(checkpoint_dir=str(iteration_dir(directory)))
    return None if found is None else json.loads(json.dumps(found, sort_keys=True, default=str))


def content_metadata_check(written: dict | None, read: dict | None) -> Check:
    """`content-metadata`: what the reader reads as the checkpoint's content metadata is what the
    writer recorded it wrote (its default sharding type included); nothing recorded fails."""
    if not written:
        return Check("content-metadata", "failed", f"the writer recorded no content metadata (read here: {read})", tolerance=EXACT)
    if read != written:
        return Check("content-metadata", "failed", f"written {written}, read here {read}", tolerance=EXACT)
    return Check("content-metadata", "passed", f"distrib_optim_sharding_type {written.get('distrib_optim_sharding_type')!r} (the "
                 f"writer's default), as written: {written}", tolerance=EXACT)
