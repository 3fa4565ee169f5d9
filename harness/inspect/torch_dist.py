"""A torch DCP checkpoint directory (megatron-core `torch_dist`, Megatron-FSDP `fsdp_dtensor`) from
its metadata: `.metadata` (torch DCP's pickled index: every item's key, global shape, dtype, chunks
and the byte range of each chunk in a `.distcp` file), `metadata.json` (megatron-core's backend
record) and the common state (megatron-core's `common_state` object item: content metadata, the
optimizer's sharding type, Megatron-LM's `args`, iteration). Tensor data is never read.

Pickles: `.metadata` is read with the allowlist unpickler of harness.judge.ckpt_content (torch DCP's
record classes, torch dtypes and torch.Size only: nothing of a user's can run), so inspect needs no
flag for it; a `.metadata` naming any other global is refused (exit 2) unless --allow-unpickle, then
torch's own FileSystemReader reads it. The common state (megatron-core >= 0.19: its object item;
before: common.pt) is read with torch.load(weights_only=True) plus the stdlib record classes
Megatron-LM's `args` are made of (RECORD_GLOBALS); what that still refuses (a class of the user's,
a Megatron-LM enum) is left unread, with a note, unless --allow-unpickle."""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import re
import types
from collections import defaultdict
from math import prod
from pathlib import Path
from typing import Any

from harness.inspect.part import FSDP_DTENSOR, TORCH_DIST, InspectInputError, Part

METADATA, BACKEND_JSON = ".metadata", "metadata.json"
COMMON = "common_state"
_DISTCP = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: what the common state may say, copied into the report when present
#: stdlib record classes the common state holds (Megatron-LM's args): attribute bags that run no code when
#: rebuilt, allowed here as megatron-core allows them once imported (megatron/core/safe_globals.py), so the
#: answer does not depend on whether megatron-core was imported first
RECORD_GLOBALS = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath)
_COMMON_FIELDS = ("iteration", "checkpoint_version", "content_metadata", "num_floating_point_operations_so_far")


def is_dcp_dir(d: Path) -> bool:
    return (d / METADATA).is_file() or any(d.glob("*.distcp")) or _backend(d) is not None


def _backend(d: Path) -> str | None:
    try:
        return json.loads((d / BACKEND_JSON).read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None


def read_metadata(d: Path, allow_unpickle: bool) -> Any:
    """torch DCP's Metadata of `d` (allowlist unpickler; torch's reader with `allow_unpickle`)."""
    from harness.judge.ckpt_content import UntrustedPickle, load_metadata

    try:
        return load_metadata(d / METADATA)
    except UntrustedPickle as exc:
        if not exc.reason.startswith("UnpicklingError: global"):
            raise ValueError(f"{d / METADATA}: not a torch DCP metadata file ({exc.reason})") from None
        if not allow_unpickle:
            raise InspectInputError(f"{d / METADATA}: names a global outside torch DCP's records ({exc.reason}); "
                                    "inspect does not unpickle a user's file: pass --allow-unpickle "
                                    "only if you trust who wrote it") from None
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(d)).read_metadata()


def inspect_dir(d: Path, allow_unpickle: bool = False) -> Part:
    part = Part(d, TORCH_DIST)
    backend_json = d / BACKEND_JSON
    if backend_json.is_file():
        try:
            part.info["metadata.json"] = json.loads(backend_json.read_text())
        except ValueError as exc:
            part.findings.append(f"{BACKEND_JSON}: not JSON ({exc})")
    else:
        part.findings.append(f"no {BACKEND_JSON}: megatron-core cannot tell the sharded backend (its load refuses the directory)")
    if (part.info.get("metadata.json") or {}).get("sharded_backend") == FSDP_DTENSOR:
        part.format = FSDP_DTENSOR
    files = sorted(p.name for p in d.glob("*.distcp"))
    writers = sorted({int(m.group(1)) for f in files if (m := _DISTCP.match(f))})
    part.info["files"] = {"distcp": len(files), "writer_ranks": len(writers)}
    if not (d / METADATA).is_file():
        part.findings.append(f"no {METADATA}: torch DCP's index of every shard is missing (a save that did not finish, "
                             "or a lost file): nothing can load")
        return part
    try:
        md = read_metadata(d, allow_unpickle)
    except ValueError as exc:
        if isinstance(exc, InspectInputError):
            raise
        part.findings.append(str(exc))
        return part
    _describe(part, md)
    if any(k.startswith("model.module.") for k in part.tensors) and part.format == TORCH_DIST:
        part.format = FSDP_DTENSOR  # Megatron-FSDP's keys (model.module.decoder.layers.<i>...), whatever metadata.json says
    part.findings += file_problems(d, md) + coverage_problems(part.tensors)
    _common(part, d, md, allow_unpickle)
    return part


def _describe(part: Part, md: Any) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    objects = []
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            part.tensors[key] = (tuple(item.size), str(item.properties.dtype).removeprefix("torch."),
                                 [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
        else:
            objects.append(key)
    storage_meta = getattr(md, "storage_meta", None)
    part.info["dcp"] = {"version": getattr(md, "version", None), "tensors": len(part.tensors), "objects": len(objects),
                        "modules": list(getattr(storage_meta, "modules", None) or [])}
    part.info["optimizer"] = optimizer_format(part.tensors, objects)
    part.info["topology"] = recorded_topology(part.tensors, part.info["files"]["writer_ranks"])
    part.info["parameters"] = sum(prod(s) for k, (s, _, _) in part.tensors.items() if not k.startswith("optimizer."))
    part.info["dtypes"] = sorted({dt for k, (_, dt, _) in part.tensors.items() if not k.startswith("optimizer.")})
    part.info["object_keys"] = sorted({k.split("/shard_")[0] for k in objects})[:20]


def optimizer_format(tensors: dict, objects: list[str]) -> str:
    keys = list(tensors) + objects
    if any(k.startswith("optimizer.distributed.") for k in keys):
        return "dp_reshardable"
    if any(k.startswith("optimizer.state.") for k in keys):
        return "fully_reshardable"
    if any(k.startswith("optimizer") for k in keys):
        return "other"
    return "none"


def recorded_topology(tensors: dict, writer_ranks: int) -> dict:
    """What the chunks say of the save's topology: the tensor-parallel split (row-parallel
    linear_proj's last axis, else the word embedding's rows) and the writer ranks (`.distcp` files).
    Layer-stacked keys are chunked per layer and experts per expert whatever pp and ep were, so
    neither is recorded here; Megatron-LM's args or Bridge's run_config.yaml say them."""
    out: dict[str, Any] = {"writer_ranks": writer_ranks}
    for key, axis in (("decoder.layers.self_attention.linear_proj.weight", -1), ("embedding.word_embeddings.weight", 0)):
        if key in tensors:
            out["tp"] = len({off[axis] for off, _ in tensors[key][2]})
            out["tp_from"] = key
            break
    return out


def file_problems(d: Path, md: Any) -> list[str]:
    """Every file the metadata names present and long enough for the byte ranges it names; every
    chunk of every item with a storage entry."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ends: dict[str, int] = defaultdict(int)
    items: dict[str, int] = defaultdict(int)
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
        items[info.relative_path] += 1
    out = []
    for name in sorted(ends):
        f = d / name
        if not f.is_file():
            out.append(f"{name}: named by {METADATA} ({items[name]} item(s)), missing on disk")
        elif f.stat().st_size < ends[name]:
            out.append(f"{name}: {f.stat().st_size} bytes, {METADATA} places data up to byte {ends[name]} (truncated)")
    for f in sorted(p.name for p in d.glob("*.distcp")):
        if f not in ends:
            out.append(f"{f}: on disk, named by no item of {METADATA} (a stray file: no load reads it)")
    stored = {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in md.storage_data}
    lost = []
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            lost += [f"{key} chunk at {tuple(c.offsets)}" for c in item.chunks if (key, tuple(c.offsets)) not in stored]
        elif (key, None) not in stored and not any(s[0] == key for s in stored):
            lost.append(key)
    if lost:
        out.append(f"{len(lost)} item(s) in {METADATA} with no byte range in any file: {', '.join(lost[:5])}")
    return out


def coverage_problems(tensors: dict) -> list[str]:
    """Per tensor: chunks inside the global shape, as many elements held as it has (torch DCP's chunks
    never overlap: fewer is a gap, a load leaves those elements unset; more is a duplicate chunk)."""
    out = []
    for key, (shape, _, chunks) in sorted(tensors.items()):
        outside = [o for o, s in chunks if len(o) != len(shape) or any(a < 0 or a + b > n for a, b, n in zip(o, s, shape))]
        if outside:
            out.append(f"{key}: {len(outside)} chunk(s) outside the global shape {list(shape)}, e.g. at {outside[0]}")
            continue
        held, total = sum(prod(s) for _, s in chunks), prod(shape)
        if held < total:
            out.append(f"{key}: gap: its chunks hold {held} of {total} elements{where_missing(shape, chunks)}")
        elif held > total:
            out.append(f"{key}: its chunks hold {held} elements of a {total}-element tensor (a chunk written twice)")
    return out


def where_missing(shape: tuple, chunks: list) -> str:
    """The first axis along which some index is in no chunk at all (e.g. an expert on axis 1)."""
    for axis, n in enumerate(shape):
        covered = set()
        for o, s in chunks:
            covered.update(range(o[axis], o[axis] + s[axis]))
        missing = sorted(set(range(n)) - covered)
        if missing and len(missing) < n:
            return f"; no chunk holds index {', '.join(map(str, missing[:8]))} on axis {axis}"
    return "" if chunks else "; no chunk at all"


def _common(part: Part, d: Path, md: Any, allow_unpickle: bool) -> None:
    """The common state's records (read from its own byte range, weights_only unless allowed)."""
    import torch

    from harness.judge.ckpt_content import UntrustedPickle, load_weights_only

    entries = [(i, s) for i, s in md.storage_data.items() if i.fqn.startswith(COMMON + "/")]
    try:
        if entries:  # megatron-core >= 0.19: an object item of the .distcp files
            index, info = entries[0]
            with open(d / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            if len(blob) != info.length or info.transform_descriptors:
                raise OSError(f"{len(blob)} of {info.length} bytes" if len(blob) != info.length else "transformed bytes")
            where, key = d / info.relative_path, index.fqn
        elif (d / "common.pt").is_file():  # older megatron-core: its own torch.save file
            blob, where, key = (d / "common.pt").read_bytes(), d / "common.pt", None
        else:
            return
        if allow_unpickle:
            value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        else:
            with torch.serialization.safe_globals(list(RECORD_GLOBALS)):
                value = load_weights_only(io.BytesIO(blob), where, key)
    except UntrustedPickle as exc:
        part.notes.append(f"common state not read: {exc.reason}; pass --allow-unpickle to read it (Megatron-LM's "
                          "args, the model's record, are in it), only if you trust who wrote it")
        return
    except (OSError, EOFError, RuntimeError) as exc:
        part.notes.append(f"common state not read: {type(exc).__name__}: {exc}")
        return
    common = value[0] if isinstance(value, list) and len(value) == 1 else value
    if not isinstance(common, dict):
        return
    part.info["common"] = {k: common[k] for k in _COMMON_FIELDS if k in common}
    sharding = (common.get("optimizer") or {}).get("param_state_sharding_type") if isinstance(common.get("optimizer"), dict) else None
    if sharding:
        part.info["common"]["optimizer_sharding_type"] = sharding
    args = common.get("args")
    if hasattr(args, "__dict__"):
        part.info["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
        part.info["topology"].update({k: part.info["args"][a] for k, a in (
            ("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
            ("ep", "expert_model_parallel_size"), ("world_size", "world_size")) if a in part.info["args"]})
        part.info["topology"]["from"] = "Megatron-LM args"
