"""Damage to a saved checkpoint, one named way per function (the corrupt-load case's axis).

Each function takes the directory of a good checkpoint, damages it in place, touches nothing
outside it, and returns a `Damage`: which files it hurt and the names (file names, tensor keys) a
clear refusal would mention, so a report can say whether the user was told what broke.

Layouts (measured, megatron-core 0.19.2 `torch_dist`): `.metadata` (torch DCP's pickled index:
every tensor's key, shape and byte range), `__<rank>_<n>.distcp` (each item a `torch.save` zip),
`metadata.json` (megatron-core's `{"sharded_backend": "torch_dist", ...}`), and NO `common.pt`:
since 0.19 the common state lives in the .distcp files (0.16 wrote one). HF exports: config.json,
model.safetensors (the tiny fixtures export one file), tokenizer files. HF PEFT adapters:
adapter_config.json + adapter_model.safetensors.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from harness.core.zoo import ModelSpec


@dataclass(frozen=True)
class Damage:
    kind: str
    files: tuple[str, ...]  # paths relative to the checkpoint directory that were cut, edited or removed
    names: tuple[str, ...]  # what a clear refusal names: any one of these in the message
    detail: str


class DamageError(RuntimeError):
    """The checkpoint lacks what this damage needs (e.g. no common.pt to delete)."""


def _files(d: Path, pattern: str) -> list[Path]:
    found = sorted(d.glob(pattern))
    if not found:
        raise DamageError(f"{d}: no {pattern} to damage (files: {sorted(p.name for p in d.iterdir())})")
    return found


def _largest(paths: list[Path]) -> Path:
    return max(paths, key=lambda p: (p.stat().st_size, p.name))


def _truncate(f: Path) -> int:
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    return size


def _remove(d: Path, name: str) -> Damage:
    f = d / name
    if not f.exists():
        raise DamageError(f"{d}: no {name} to delete (files: {sorted(p.name for p in d.iterdir())})")
    f.unlink()
    return Damage(f"missing-{name}", (name,), (name,), f"{name} deleted")


# --------------------------------------------------------------------------- torch_dist


def truncate_shard(d: Path) -> Damage:
    """The largest .distcp cut to half its size: a save killed while writing it."""
    f = _largest(_files(d, "*.distcp"))
    size = _truncate(f)
    return Damage("truncate-shard", (f.name,), (f.name,), f"{f.name} cut from {size} to {size // 2} bytes")


def missing_shard(d: Path) -> Damage:
    """The last .distcp deleted: one rank's shard file lost."""
    f = _files(d, "*.distcp")[-1]
    f.unlink()
    return Damage("missing-shard", (f.name,), (f.name,), f"{f.name} deleted")


def missing_metadata(d: Path) -> Damage:
    """.metadata deleted: torch DCP's index of every shard (written last, by the coordinator)."""
    return replace(_remove(d, ".metadata"), kind="missing-metadata")


def missing_metadata_json(d: Path) -> Damage:
    """metadata.json deleted: megatron-core's marker that names the sharded backend."""
    return replace(_remove(d, "metadata.json"), kind="missing-metadata-json")


def missing_common(d: Path) -> Damage:
    """common.pt deleted: the non-tensor state, in formats that write one (megatron-core < 0.19)."""
    return replace(_remove(d, "common.pt"), kind="missing-common")


def _data_range(blob: bytes) -> tuple[int, int]:
    """(start, length) of the tensor bytes inside one torch.save zip: its `data/0` record."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    header = blob[info.header_offset : info.header_offset + 30]
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_byte(d: Path) -> Damage:
    """One byte inverted in the middle of the tensor data of the largest item of the largest
    .distcp (found through .metadata's byte ranges and the item's zip record): bad disk or copy."""
    from torch.distributed.checkpoint import FileSystemReader

    f = _largest(_files(d, "*.distcp"))
    items = [(idx, s) for idx, s in FileSystemReader(str(d)).read_metadata().storage_data.items() if s.relative_path == f.name]
    idx, info = max(items, key=lambda kv: (kv[1].length, kv[1].offset))
    with open(f, "r+b") as fh:
        fh.seek(info.offset)
        start, length = _data_range(fh.read(info.length))
        pos = info.offset + start + length // 2
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ 0xFF]))
    return Damage("flip-byte", (f.name,), (f.name, idx.fqn),
                  f"byte {pos} of {f.name} (in the data of {idx.fqn} at offset {tuple(idx.offset)}) inverted")


def empty_dir(d: Path) -> Damage:
    """Every file removed, the directory kept: a save that died before writing anything."""
    gone = sorted(p.name for p in d.iterdir())
    for p in d.iterdir():
        p.unlink()
    return Damage("empty-dir", tuple(gone), (d.name,), f"all {len(gone)} files removed, {d.name}/ kept")


#: A checkpoint of a different model: the change applied to the model under test before the save.
#: other-tied and other-bias change which keys exist: megatron-core's key check (strict) refuses them, not
#: torch DCP's shape check.
OTHER_MODEL: dict[str, Callable[[ModelSpec], dict[str, Any]]] = {
    "other-hidden": lambda m: {"hidden_size": 2 * m.hidden_size, "ffn_hidden_size": 4 * m.hidden_size},
    "other-layers": lambda m: {"num_layers": 2 * m.num_layers},
    "other-vocab": lambda m: {"vocab_size": 2 * m.vocab_size},
    "other-groups": lambda m: {"num_query_groups": m.num_attention_heads if m.num_query_groups != m.num_attention_heads
                               else m.num_attention_heads // 2},
    "other-tied": lambda m: {"tied_embeddings": not m.tied_embeddings},
    "other-bias": lambda m: {"add_bias_linear": not m.add_bias_linear},
}


def other_model(spec: ModelSpec, kind: str) -> ModelSpec:
    """The model a foreign checkpoint holds: `spec` with one dimension changed (OTHER_MODEL) and
    other weights (seed + 1: another model is trained separately; with the same seed the truth of
    a longer vocabulary starts with the shorter one's rows, which would hide a prefix load)."""
    return replace(spec, name=f"{spec.name}/{kind}", seed=spec.seed + 1, **OTHER_MODEL[kind](spec))


def foreign(d: Path, kind: str, saved: ModelSpec, expected: ModelSpec) -> Damage:
    """Nothing to damage: the record of a checkpoint of another model (every tensor key of the
    checkpoint counts as a name: a clear refusal says which tensor does not fit)."""
    from torch.distributed.checkpoint import FileSystemReader

    changed = {k: (getattr(expected, k), v) for k, v in OTHER_MODEL[kind](expected).items()}
    keys = tuple(sorted(FileSystemReader(str(d)).read_metadata().state_dict_metadata))
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    if "tied_embeddings" in changed:  # the output layer is the key one side lacks
        keys += ("output_layer.weight",)
    return Damage(kind, (), keys, f"a checkpoint of another model ({what})")


# --------------------------------------------------------------------------- HF artefacts


def truncate_safetensors(d: Path) -> Damage:
    """The largest .safetensors cut to half its size."""
    f = _largest(_files(d, "*.safetensors"))
    size = _truncate(f)
    return Damage("truncate-safetensors", (f.name,), (f.name,), f"{f.name} cut from {size} to {size // 2} bytes")


INDEX = "model.safetensors.index.json"


def split_export(d: Path) -> dict[str, str]:
    """A single-file export rewritten as two shards plus model.safetensors.index.json, the layout
    save_pretrained writes past max_shard_size (the tiny fixtures fit in one file); same tensors,
    same bytes. Returns the index's weight_map."""
    from safetensors.torch import load_file, save_file

    single = d / "model.safetensors"
    state = load_file(str(single))
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(halves, 1):
        name = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        save_file({k: state[k] for k in part}, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    size = sum(t.numel() * t.element_size() for t in state.values())
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    single.unlink()
    return weight_map


def missing_indexed_shard(d: Path) -> Damage:
    """The last shard named in model.safetensors.index.json deleted (a single-file export is
    first split into two shards with an index, split_export)."""
    index = d / INDEX
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else split_export(d)
    name = sorted(set(weight_map.values()))[-1]
    (d / name).unlink()
    lost = sorted(k for k, v in weight_map.items() if v == name)
    return Damage("missing-indexed-shard", (name,), (name, *lost), f"{name} ({len(lost)} tensors) named in {INDEX} deleted")


def adapter_no_config(d: Path) -> Damage:
    """adapter_config.json deleted from an HF PEFT adapter directory."""
    return replace(_remove(d, "adapter_config.json"), kind="adapter-no-config")


def _edit_config(d: Path, edit: Callable[[dict], str]) -> str:
    f = d / "adapter_config.json"
    cfg = json.loads(f.read_text())
    what = edit(cfg)
    f.write_text(json.dumps(cfg, indent=2))
    return what


def adapter_config_mismatch(d: Path) -> Damage:
    """adapter_config.json's `r` doubled: it disagrees with the shapes of every lora tensor."""
    def edit(cfg: dict) -> str:
        old, cfg["r"] = cfg["r"], 2 * cfg["r"]
        return f"r {old} -> {cfg['r']}"

    return Damage("adapter-config-mismatch", ("adapter_config.json",), ("lora_A", "lora_B"),
                  f"adapter_config.json {_edit_config(d, edit)}, the tensors keep the old rank")


def adapter_config_targets(d: Path) -> Damage:
    """adapter_config.json's target_modules loses down_proj, whose lora tensors stay in the file."""
    def edit(cfg: dict) -> str:
        cfg["target_modules"] = sorted(set(cfg["target_modules"]) - {"down_proj"})
        return "target_modules without down_proj"

    return Damage("adapter-config-targets", ("adapter_config.json",), ("down_proj",),
                  f"adapter_config.json {_edit_config(d, edit)}, adapter_model.safetensors still holds its lora tensors")


#: Every damage kind that changes a saved directory (the other-* kinds change the saved model instead).
FUNCTIONS: dict[str, Callable[[Path], Damage]] = {
    "truncate-shard": truncate_shard,
    "missing-shard": missing_shard,
    "missing-metadata": missing_metadata,
    "missing-metadata-json": missing_metadata_json,
    "missing-common": missing_common,
    "flip-byte": flip_byte,
    "empty-dir": empty_dir,
    "truncate-safetensors": truncate_safetensors,
    "missing-indexed-shard": missing_indexed_shard,
    "adapter-no-config": adapter_no_config,
    "adapter-config-mismatch": adapter_config_mismatch,
    "adapter-config-targets": adapter_config_targets,
}
