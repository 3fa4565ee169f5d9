"""export-integrity: is an HF artefact on disk complete and self-consistent? (issue 19, item 3)

Every silent export defect users met (notes/user-reports.md, B) left files that look fine one at a
time: a shard missing from the directory (Megatron-Bridge#4188), an index listing what ranks meant to
write rather than what they wrote (#4083), experts or `_extra_state` keys absent (verl#6842,
NeMo-RL#2124), a tied lm_head written or lost. So this check reads the files only (the index JSON and
every shard's safetensors header, never a tensor, never a model) and compares:

  layout   with `<weights>.index.json`: its weight_map against every shard's header both ways
           (an entry whose shard lacks the tensor, a tensor the index does not list or lists under
           another shard, a shard on disk the index never names, a named shard missing) and
           `metadata.total_size` against the headers' byte sizes; without one: exactly the one
           `<weights>` file, no stray shard
  source   every source tensor present with the source's shape and dtype, no extra key, except
           keys the caller names as expected (`allowed_missing`, `allowed_extra`)
  tied     config.json's `tie_word_embeddings`: untied needs `lm_head.weight`; tied writes none
           unless the source held one (transformers' save_pretrained drops the tied copy, and
           Megatron-Bridge 0.6.2 emits it exactly when the source has it: model_bridge.py
           stream_weights_megatron_to_hf, `emit_output_weight = tied_output_hf_name in expected_keys`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from harness.core.parity import EXACT, NOT_COMPARED, Mismatch
from harness.core.result import Check

NAME = "export-integrity"
MODEL_WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LM_HEAD = "lm_head.weight"
#: bytes per element of each safetensors dtype (the header's "dtype" strings)
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
_TORCH_TO_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says of one tensor."""

    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEMSIZE.get(self.dtype, 0)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass
class Artefact:
    """An HF weights directory as its files say: each safetensors file's header, the index if any,
    and what could not be read."""

    directory: Path
    weights: str  # model.safetensors | adapter_model.safetensors
    files: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)
    index: dict | None = None
    tied: bool | None = None  # config.json's tie_word_embeddings (None: no config.json or no such key)
    unreadable: list[Mismatch] = field(default_factory=list)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {k: v for f in self.files.values() for k, v in f.items()}


def header(path: Path) -> dict[str, TensorInfo]:
    """One safetensors file's tensors from its header (safe_open reads the header and maps the
    rest; no tensor is loaded)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        out = {}
        for k in f.keys():
            s = f.get_slice(k)
            out[k] = TensorInfo(s.get_dtype(), tuple(s.get_shape()))
        return out


def infos_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """The TensorInfo of tensors in memory (a derivation the harness computed), as a header says it."""
    return {k: TensorInfo(_TORCH_TO_ST.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in state.items()}


def read_artefact(directory: Path, weights: str = MODEL_WEIGHTS) -> Artefact:
    """Read `directory`'s top-level *.safetensors headers, `<weights>.index.json` and config.json."""
    directory = Path(directory)
    a = Artefact(directory, weights)
    for f in sorted(directory.glob("*.safetensors")):
        try:
            a.files[f.name] = header(f)
        except Exception as exc:  # a torn or foreign file: a finding about the artefact, not a harness error
            a.unreadable.append(Mismatch(f.name, "layout", "a safetensors file", "unreadable", detail=f"{f.name} unreadable: {type(exc).__name__}: {exc}"))
    index = directory / f"{weights}.index.json"
    if index.exists():
        try:
            a.index = json.loads(index.read_text())
        except ValueError as exc:
            a.unreadable.append(Mismatch(index.name, "index", "JSON", "unreadable", detail=f"{index.name} unreadable: {exc}"))
            a.index = {}
    config = directory / "config.json"
    if config.exists():
        tied = json.loads(config.read_text()).get("tie_word_embeddings")
        a.tied = tied if isinstance(tied, bool) else None
    return a


def layout_problems(a: Artefact, sharded_ok: bool = True) -> list[Mismatch]:
    """The files against each other: the index against every header both ways and its total_size,
    or, without an index, exactly one `<weights>` file. `sharded_ok` False (a PEFT adapter, which
    peft reads from one file only): an index is a problem too."""
    out = list(a.unreadable)
    index_name = f"{a.weights}.index.json"
    if a.index is None:
        stray = sorted(f for f in a.files if f != a.weights)
        if a.weights not in a.files and not any(m.key == a.weights for m in a.unreadable):
            out.append(Mismatch(a.weights, "layout", f"{a.weights} or {index_name}", "neither",
                                detail=f"no {a.weights} and no index in {a.directory.name}"))
        out += [Mismatch(f, "layout", f"only {a.weights}", "a stray shard", detail=f"{f} on disk without an index naming it")
                for f in stray]
        return out
    if not sharded_ok:
        out.append(Mismatch(index_name, "layout", f"one {a.weights}", "an index", detail=f"{index_name}: a sharded adapter peft does not read"))
    weight_map = a.index.get("weight_map")
    if not isinstance(weight_map, dict):
        return out + [Mismatch(index_name, "index", "a weight_map", "none", detail=f"{index_name} has no weight_map")]
    named = set(weight_map.values())
    where: dict[str, list[str]] = {}
    for f, tensors in a.files.items():
        for k in tensors:
            where.setdefault(k, []).append(f)
    for shard in sorted(named - set(a.files) - {m.key for m in a.unreadable}):
        keys = sorted(k for k, s in weight_map.items() if s == shard)
        out.append(Mismatch(shard, "missing", index_name, "disk",
                            detail=f"the index names shard {shard} ({len(keys)} tensor(s), e.g. {keys[0]}), missing on disk"))
    for k, shard in sorted(weight_map.items()):
        if shard in a.files and k not in a.files[shard]:
            elsewhere = f" (it is in {', '.join(where[k])})" if k in where else ""
            out.append(Mismatch(k, "index", f"{index_name}: {k} -> {shard}", f"{shard} header",
                                detail=f"index entry {k} -> {shard}, but {shard} holds no {k}{elsewhere}"))
    for f in sorted(set(a.files) - named):
        keys = sorted(a.files[f])
        out.append(Mismatch(f, "index", index_name, "disk", detail=f"shard {f} on disk is named nowhere in the index: a loader never "
                            f"reads its {len(keys)} tensor(s) {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"))
    for k, files in sorted(where.items()):
        if len(files) > 1:
            out.append(Mismatch(k, "index", "one shard", ", ".join(files), detail=f"{k} is in {len(files)} shards: {', '.join(files)}"))
        for f in files:
            if f not in named:
                continue  # reported once, as a shard the index never names
            listed = weight_map.get(k)
            if listed is None:
                out.append(Mismatch(k, "index", index_name, f"{f} header", detail=f"{k} in {f} is not in the index"))
            elif listed != f:
                out.append(Mismatch(k, "index", f"{index_name}: {k} -> {listed}", f"{f} header",
                                    detail=f"{k} is in {f} but the index lists it under {listed}"))
    total = (a.index.get("metadata") or {}).get("total_size")
    actual = sum(t.nbytes for f in sorted(named & set(a.files)) for t in a.files[f].values())
    if total is None:
        out.append(Mismatch(index_name, "index", "metadata.total_size", "none", detail=f"{index_name} has no metadata.total_size"))
    elif total != actual:
        out.append(Mismatch(index_name, "index", f"total_size {total}", f"headers {actual}",
                            detail=f"metadata.total_size {total} != {actual} bytes in the shards' headers"))
    return out


def source_problems(a: Artefact, source: Mapping[str, TensorInfo], allowed_extra: Sequence[str] = (),
                    allowed_missing: Sequence[str] = (), source_label: str = "source") -> list[Mismatch]:
    """The export's tensors against the source's: each source key present with its shape and
    dtype, no other key; `allowed_*` name the keys the caller expects to differ. A tied lm_head is
    tied_problems' to judge."""
    got = a.tensors
    file_of = {k: f for f, ts in a.files.items() for k in ts}
    out = []
    for k in sorted(set(source) - set(got) - set(allowed_missing)):
        out.append(Mismatch(k, "missing", source_label, a.directory.name, detail=f"source tensor {k} ({source[k]}) is in no file of the export"))
    for k in sorted(set(got) - set(source) - set(allowed_extra)):
        if k == lm_head_key(got) and a.tied:
            continue
        out.append(Mismatch(k, "extra", source_label, a.directory.name, detail=f"{k} ({got[k]}, in {file_of[k]}) is not in the source"))
    for k in sorted(set(got) & set(source)):
        s, e = source[k], got[k]
        if s.shape != e.shape:
            out.append(Mismatch(k, "shape", source_label, a.directory.name, detail=f"{k} in {file_of[k]}: shape {list(e.shape)}, source {list(s.shape)}"))
        if s.dtype != e.dtype:
            out.append(Mismatch(k, "dtype", source_label, a.directory.name, detail=f"{k} in {file_of[k]}: dtype {e.dtype}, source {s.dtype}"))
    return out


def lm_head_key(keys) -> str:
    """The output layer's key: `lm_head.weight`, or a VL model's under its language model
    (`language_model.lm_head.weight`: Mistral 3, MiniMax-M3 VL); `lm_head.weight` where none is held."""
    if LM_HEAD in keys:
        return LM_HEAD
    return next((k for k in keys if k.endswith("." + LM_HEAD)), LM_HEAD)


def tied_problems(a: Artefact, source: Mapping[str, TensorInfo] | None) -> list[Mismatch]:
    """lm_head.weight as the export's config.json says embeddings are (nothing to judge without
    a tie_word_embeddings there)."""
    head = lm_head_key(a.tensors)
    has = head in a.tensors
    if a.tied is False and not has:
        return [Mismatch(LM_HEAD, "tied", "untied (tie_word_embeddings false)", "absent",
                         detail=f"config.json says untied embeddings but no file of {a.directory.name} holds {LM_HEAD}")]
    if a.tied and has and (source is None or head not in source):
        return [Mismatch(head, "tied", "tied (tie_word_embeddings true)", "present",
                         detail=f"config.json says tied embeddings but {a.directory.name} holds {head}, which the source does not")]
    return []


@dataclass(frozen=True)
class Expected:
    """One HF artefact a case wrote and what it should hold: `source` the tensors (None: no source
    to compare with, layout and tie judged only), `allowed_*` the keys expected to differ from it."""

    label: str
    directory: Path
    source: Mapping[str, TensorInfo] | None
    weights: str = MODEL_WEIGHTS
    allowed_extra: tuple[str, ...] = ()
    allowed_missing: tuple[str, ...] = ()
    sharded_ok: bool = True  # False for a PEFT adapter: peft reads one adapter_model.safetensors


def problems_of(e: Expected) -> tuple[list[Mismatch], int]:
    """Every problem of one artefact (layout, source when given, tied) and how many tensors it holds."""
    a = read_artefact(e.directory, e.weights)
    problems = layout_problems(a, e.sharded_ok)
    if e.source is not None:
        problems += source_problems(a, e.source, e.allowed_extra, e.allowed_missing)
    return problems + tied_problems(a, e.source), len(a.tensors)


def source_infos(directory: Path) -> dict[str, TensorInfo]:
    """The tensors of an HF source directory (every top-level safetensors file), from the headers."""
    return read_artefact(directory).tensors


def export_integrity(artefacts: Sequence[Expected]) -> Check:
    """One export-integrity Check over a case's HF artefacts, every problem named with its
    artefact, file and key (all in `mismatches`, the first dozen in the detail)."""
    if not artefacts:
        return Check(NAME, "not-run", "no HF artefact written", tolerance=NOT_COMPARED)
    bad, seen = [], []
    for e in artefacts:
        problems, n = problems_of(e)
        bad += [(e.label, m) for m in problems]
        seen.append(f"{e.label}: {n} tensors, " + ("layout, source keys/shapes/dtypes and tie agree" if e.source is not None
                                                   else "layout agrees (no source to compare keys with)"))
    if bad:
        text = "; ".join(f"{label}: {m.detail or m}" for label, m in bad[:12])
        more = f"; ... and {len(bad) - 12} more" if len(bad) > 12 else ""
        labelled = [Mismatch(f"{label}/{m.key}", m.kind, m.expected, m.actual, m.max_abs_diff, m.detail) for label, m in bad]
        return Check(NAME, "failed", f"{len(bad)} problem(s): {text}{more}", tolerance=EXACT, mismatches=labelled)
    return Check(NAME, "passed", "; ".join(seen), tolerance=EXACT)
