"""What a directory is: one artefact (torch_dist / fsdp_dtensor, HF safetensors, PEFT adapter) or a
layout that holds several (a golden corpus, a Megatron-LM or Bridge training dir, a verl checkpoint
dir), and the records such a layout keeps (the corpus manifest, Bridge's run_config.yaml, the
trackers), checked against what is on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.inspect import hf, torch_dist
from harness.inspect.part import InspectInputError, Inspection, Part

MANIFEST, TRACKER, RUN_CONFIG = "manifest.json", "latest_checkpointed_iteration.txt", "run_config.yaml"
_MAX_DEPTH = 5


def leaf(d: Path, allow_unpickle: bool) -> Part | None:
    """`d` read as one artefact, or None when it is none."""
    if torch_dist.is_dcp_dir(d):
        return torch_dist.inspect_dir(d, allow_unpickle)
    if hf.is_adapter_dir(d):
        return hf.inspect_adapter(d)
    if hf.is_model_dir(d):
        return hf.inspect_model(d)
    return None


def parts_under(d: Path, allow_unpickle: bool, depth: int = 0) -> list[Part]:
    """Every artefact at or under `d` (a found artefact's own subfolders are not searched), and each
    loose safetensors file of the folders between."""
    found = leaf(d, allow_unpickle)
    if found is not None:
        return [found]
    out = [hf.inspect_file(f) for f in sorted(d.glob("*.safetensors"))]
    if depth < _MAX_DEPTH:
        for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
            out += parts_under(sub, allow_unpickle, depth + 1)
    return out


def inspect(path: Path, allow_unpickle: bool = False) -> Inspection:
    """The directory `path` as inspect reports it; InspectInputError when it holds no checkpoint."""
    path = Path(path)
    if not path.exists():
        raise InspectInputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".safetensors":
            part = hf.inspect_file(path)
            return Inspection(path.parent, part.format, parts=[part])
        if path.name in (".metadata", "metadata.json") or path.suffix == ".distcp":
            path = path.parent
        else:
            raise InspectInputError(f"{path}: a file, not a checkpoint directory (give the folder that holds it)")
    parts = parts_under(path, allow_unpickle)
    ins = Inspection(path, _layout(path, parts), parts=parts)
    if ins.layout == "golden corpus":
        _corpus(ins)
    elif (found := corpus_manifest(path)) is not None:
        _in_corpus(ins, *found)
    elif ins.layout in ("Megatron-LM training dir", "Bridge training dir", "verl checkpoint dir"):
        _tracked(ins)
    if not parts and not ins.findings:
        listing = sorted(p.name for p in path.iterdir())[:12]
        raise InspectInputError(f"{path}: no checkpoint here (no .metadata/.distcp/metadata.json, no *.safetensors, "
                                f"no adapter_config.json within {_MAX_DEPTH} levels; it holds {listing or 'nothing'})")
    return ins


def _layout(d: Path, parts: list[Part]) -> str:
    if (d / MANIFEST).is_file():
        return "golden corpus"
    if list(d.glob("global_step_*")):
        return "verl checkpoint dir"
    if (d / "latest_train_state.pt").is_file() or list(d.glob(f"iter_*/{RUN_CONFIG}")) or (d / RUN_CONFIG).is_file():
        return "Bridge training dir"
    if (d / TRACKER).is_file() or list(d.glob("iter_*")):
        return "Megatron-LM training dir"
    if len(parts) == 1 and parts[0].path == d:
        return parts[0].format
    return "directory"


def corpus_manifest(d: Path) -> tuple[Path, dict] | None:
    """The golden corpus manifest of `d` or of a folder above it (its root and content)."""
    for root in (d, *d.parents):
        f = root / MANIFEST
        if f.is_file():
            try:
                manifest = json.loads(f.read_text())
            except (OSError, ValueError):
                return None
            if isinstance(manifest, dict) and isinstance(manifest.get("artefacts"), dict):
                return root, manifest
    return None


def manifest_entry(d: Path) -> tuple[Path, str, dict] | None:
    """The corpus manifest's entry for the artefact `d` lies in: (corpus root, artefact name, entry)."""
    found = corpus_manifest(d)
    if found is None:
        return None
    root, manifest = found
    rel = d.relative_to(root).parts
    entry = manifest["artefacts"].get(rel[0]) if rel else None
    return (root, rel[0], entry) if entry else None


def _corpus(ins: Inspection) -> None:
    """The manifest's versions and artefacts, and every file it names present (sha256 is `golden
    check`'s: hashing reads the tensor data, which inspect never does)."""
    found = corpus_manifest(ins.root)
    if found is None:
        ins.findings.append(f"{MANIFEST}: unreadable or not a golden corpus manifest")
        return
    _, manifest = found
    ins.info.update(versions=manifest.get("versions"), environment=manifest.get("environment"), made=manifest.get("made"),
                    artefacts={n: {k: e.get(k) for k in ("model", "source", "target", "description", "error") if e.get(k)}
                               for n, e in manifest["artefacts"].items()})
    for name, entry in sorted(manifest["artefacts"].items()):
        missing = sorted(f for f in (entry.get("files") or {}) if not (ins.root / name / f).is_file())
        if missing:
            ins.findings.append(f"{name}: {len(missing)} file(s) the manifest names are missing: {', '.join(missing[:5])}")


def _in_corpus(ins: Inspection, root: Path, manifest: dict) -> None:
    """A folder inside a golden corpus: its artefact's manifest entry, and the files it names under the folder present."""
    rel = ins.root.relative_to(root)
    entry = manifest["artefacts"].get(rel.parts[0]) if rel.parts else None
    if not isinstance(entry, dict):
        return
    if ins.layout == "directory":
        ins.layout = "golden corpus artefact"
    ins.info["corpus_artefact"] = {"corpus": str(root), "artefact": rel.parts[0], "versions": manifest.get("versions"),
                                   **{k: entry[k] for k in ("model", "source", "target", "description") if k in entry}}
    inner = Path(*rel.parts[1:])
    named = [f for f in (entry.get("files") or {}) if Path(f).is_relative_to(inner)]
    missing = sorted(f for f in named if not (root / rel.parts[0] / f).is_file())
    if missing:
        ins.findings.append(f"{len(missing)} file(s) the corpus manifest names are missing: {', '.join(missing[:5])}")


def run_config(d: Path) -> dict | None:
    """Bridge's run_config.yaml of a checkpoint directory or of a folder above it (the `model` section is the provider's fields)."""
    import yaml

    for root in (d, *list(d.parents)[:3]):
        for f in (root / RUN_CONFIG, *sorted(root.glob(f"iter_*/{RUN_CONFIG}"))[-1:]):
            if f.is_file():
                try:
                    cfg = yaml.safe_load(f.read_text())
                except (OSError, yaml.YAMLError):
                    return None  # unsafe tags (Bridge writes `_target_` entries as plain keys) or torn: not a record
                return cfg if isinstance(cfg, dict) else None
    return None


def _tracked(ins: Inspection) -> None:
    """The tracker names an iteration (Megatron-LM, Bridge: iter_<N:07d>; verl: global_step_<N>) that is on disk."""
    tracker = ins.root / TRACKER
    if not tracker.is_file():
        ins.notes.append(f"no {TRACKER}: a resume does not know which save is the latest")
        return
    text = tracker.read_text().strip()
    ins.info["latest"] = text
    if not re.fullmatch(r"\d+|release", text):
        ins.findings.append(f"{TRACKER}: {text!r} is not an iteration number")
        return
    name = f"global_step_{text}" if ins.layout == "verl checkpoint dir" else ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (ins.root / name).is_dir():
        ins.findings.append(f"{TRACKER} names {name}, which is not on disk")
    cfg = run_config(ins.root)
    if cfg and isinstance(cfg.get("model"), dict):
        ins.info["run_config_model"] = {k: v for k, v in cfg["model"].items() if isinstance(v, (int, float, str, bool))}
