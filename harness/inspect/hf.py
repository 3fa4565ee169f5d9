"""HF directories from their headers and JSON: a safetensors model (config.json, model.safetensors or
shards + index), a PEFT adapter (adapter_config.json + adapter_model.safetensors), a loose
safetensors file. Integrity is harness.judge.hf_integrity's (headers only: the index against every
header both ways, total_size, a shard missing or stray, a key in two shards, an unreadable or torn
header, the tie of lm_head), plus, for an adapter, its config against its tensors."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.inspect.part import HF, PEFT, SAFETENSORS, Part
from harness.judge import hf_integrity as hfi

ADAPTER_CONFIG = "adapter_config.json"
_CONFIG_FIELDS = ("model_type", "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "vocab_size", "num_experts", "tie_word_embeddings",
                  "dtype", "torch_dtype", "transformers_version")
_ADAPTER_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "base_model_name_or_path", "task_type",
                   "use_dora", "use_rslora", "modules_to_save", "peft_version", "revision")
_LORA = re.compile(r"^(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def is_adapter_dir(d: Path) -> bool:
    return (d / ADAPTER_CONFIG).is_file() or (d / hfi.ADAPTER_WEIGHTS).is_file()


def is_model_dir(d: Path) -> bool:
    names = {p.name for p in d.glob("*.safetensors")}
    return (hfi.MODEL_WEIGHTS in names or (d / f"{hfi.MODEL_WEIGHTS}.index.json").is_file()
            or any(n.startswith("model-") for n in names) or ((d / "config.json").is_file() and bool(names)))


def _json(part: Part, f: Path) -> dict | None:
    try:
        value = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        part.findings.append(f"{f.name}: not readable as JSON ({exc})")
        return None
    if not isinstance(value, dict):
        part.findings.append(f"{f.name}: a JSON object expected, got {type(value).__name__}")
        return None
    return value


def _tensors(part: Part, a: hfi.Artefact) -> None:
    part.info["files"] = {f: len(t) for f, t in a.files.items()}
    part.info["tensors"] = len(a.tensors)
    part.info["dtypes"] = sorted({t.dtype for t in a.tensors.values()})
    part.info["bytes"] = sum(t.nbytes for t in a.tensors.values())
    for f in sorted(a.files):
        size, expected = _data_end(a.directory / f)
        if expected is not None and size != expected:
            part.findings.append(f"{f}: {size} bytes on disk, its header places data up to byte {expected}")


def _data_end(path: Path) -> tuple[int, int | None]:
    """(file size, where the header says the data ends): the 8-byte length, the JSON header, the data."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        return size, 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return size, None  # unreadable: read_artefact already reported it


def inspect_model(d: Path) -> Part:
    part = Part(d, HF)
    config = d / "config.json"
    if config.is_file():
        cfg = _json(part, config)
        if cfg is not None:
            part.info["config"] = {k: cfg[k] for k in _CONFIG_FIELDS if k in cfg}
    else:
        part.notes.append("no config.json: a loader needs the model's config beside the weights")
    a = hfi.read_artefact(d)
    _tensors(part, a)
    part.findings += [m.detail or str(m) for m in hfi.layout_problems(a) + hfi.tied_problems(a, None)]
    return part


def inspect_file(f: Path) -> Part:
    """One loose safetensors file (a reference, a consolidated export): its header only."""
    part = Part(f, SAFETENSORS)
    try:
        tensors = hfi.header(f)
    except Exception as exc:  # a torn or foreign file
        part.findings.append(f"{f.name} unreadable: {type(exc).__name__}: {exc}")
        return part
    size, expected = _data_end(f)
    part.info.update(tensors=len(tensors), dtypes=sorted({t.dtype for t in tensors.values()}))
    if expected is not None and size != expected:
        part.findings.append(f"{f.name}: {size} bytes on disk, its header places data up to byte {expected}")
    return part


def inspect_adapter(d: Path) -> Part:
    part = Part(d, PEFT)
    cfg = _json(part, d / ADAPTER_CONFIG) if (d / ADAPTER_CONFIG).is_file() else None
    if not (d / ADAPTER_CONFIG).is_file():
        part.findings.append(f"no {ADAPTER_CONFIG}: peft cannot load the adapter")
    if cfg is not None:
        part.info["adapter_config"] = {k: cfg[k] for k in _ADAPTER_FIELDS if k in cfg}
    a = hfi.read_artefact(d, hfi.ADAPTER_WEIGHTS)
    _tensors(part, a)
    part.findings += [m.detail or str(m) for m in hfi.layout_problems(a, sharded_ok=False)]
    if cfg is not None and a.tensors:
        part.findings += adapter_problems(cfg, a.tensors)
    return part


def adapter_problems(cfg: dict, tensors: dict) -> list[str]:
    """adapter_config.json against the tensors: each LoRA A's rows (B's columns) equal `r` (or the
    module's rank_pattern entry), and the modules holding LoRA tensors are the target_modules."""
    out = []
    r, pattern = cfg.get("r"), cfg.get("rank_pattern") or {}
    modules: set[str] = set()
    for key, info in sorted(tensors.items()):
        m = _LORA.match(key)
        if not m:
            continue
        module = m.group(1).rsplit(".", 1)[-1]
        modules.add(module)
        want = next((v for k, v in pattern.items() if m.group(1).endswith(k)), r)
        got = info.shape[0] if m.group(2) == "lora_A" else info.shape[-1]
        if isinstance(want, int) and len(info.shape) == 2 and got != want:
            out.append(f"{key}: rank {got}, adapter_config.json says r {want}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and modules:
        for module in sorted(modules - set(targets)):
            out.append(f"adapter_model.safetensors holds LoRA tensors of {module}, which target_modules {sorted(targets)} "
                       "does not name (peft ignores them)")
        for module in sorted(set(targets) - modules):
            out.append(f"target_modules names {module}, no LoRA tensor of it is in adapter_model.safetensors")
    return out[:20] + ([f"... {len(out) - 20} more"] if len(out) > 20 else [])
