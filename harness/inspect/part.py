"""What inspect says of one artefact (a `Part`) and of the directory it was handed (an `Inspection`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TORCH_DIST, FSDP_DTENSOR, HF, PEFT, SAFETENSORS = "torch_dist", "fsdp_dtensor", "hf_safetensors", "peft_adapter", "safetensors"


class InspectInputError(ValueError):
    """Not a checkpoint, an unreadable record, a model or topology that cannot be built: exit 2."""


@dataclass
class Part:
    """One artefact on disk: its format, what its records say (`info`), integrity `findings` (each a
    problem a load would meet) and `notes` (what could not be read, and why)."""

    path: Path
    format: str
    info: dict[str, Any] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: torch_dist/fsdp_dtensor only: key -> (global shape, dtype, [(offsets, sizes), ...]); not in JSON
    tensors: dict[str, tuple] = field(default_factory=dict, repr=False)

    def to_json(self, root: Path) -> dict:
        return {"path": _rel(self.path, root), "format": self.format, "info": self.info,
                "findings": self.findings, "notes": self.notes}


@dataclass
class Inspection:
    root: Path
    layout: str  # "golden corpus", "Bridge training dir", "verl checkpoint dir", "Megatron-LM training dir", or the part's format
    info: dict[str, Any] = field(default_factory=dict)
    parts: list[Part] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # of the layout (a manifest's file missing, a tracker naming nothing)
    notes: list[str] = field(default_factory=list)

    @property
    def all_findings(self) -> list[str]:
        return self.findings + [f"{_rel(p.path, self.root)}: {f}" for p in self.parts for f in p.findings]

    def to_json(self) -> dict:
        return {"root": str(self.root), "layout": self.layout, "info": self.info, "findings": self.findings,
                "notes": self.notes, "parts": [p.to_json(self.root) for p in self.parts],
                "exit_code": 1 if self.all_findings else 0}


def _rel(path: Path, root: Path) -> str:
    try:
        rel = str(Path(path).relative_to(root))
    except ValueError:
        return str(path)
    return "." if rel == "." else rel
