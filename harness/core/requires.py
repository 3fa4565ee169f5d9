"""What a case needs of the machine, and why it cannot run here: the `not-run` status's one source.

A matrix entry declares `requires: [cuda, te, host-memory-gib>=64]`; a case derives more from its
options (`layer_spec: te` -> te, harness.run.envelope.Case.machine_requirements) and the run from its dist
backend (`--dist-backend nccl` -> nccl). Before a case launches anything the runner asks `unmet`;
every unmet need becomes a reason and the case is `not-run` with them, never silently skipped and
never counted green.

| name | met when |
|---|---|
| cuda | one CUDA device per rank of the case's largest world (NCCL refuses two ranks on one GPU; the harness gives each rank its own), and the run does not force `--dist-backend gloo` (gloo ranks hide their GPUs) |
| nccl | torch has NCCL, plus what `cuda` needs |
| te | `transformer_engine` is importable, plus what `cuda` needs (TE layers run on GPU only) |
| host-memory-gib>=N | the host has at least N GiB of memory (psutil total) |
| module:NAME | the Python module NAME (dotted) is installed: found on the path, never imported (a CUDA-only kernel such as `mamba_ssm` or `fla`, or the transformers package that would hold an architecture's modeling code) |

The probe asks the parent only what harness.run.world.choose_backend already asks (torch's
device_count) plus import specs and psutil: no CUDA context, so later forked gloo worlds stay safe.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache

NAMES = ("cuda", "nccl", "te")
_MEMORY = re.compile(r"^host-memory-gib>=(\d+(?:\.\d+)?)$")
_MODULE = re.compile(r"^module:([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
#: What each need brings with it.
_IMPLIES = {"nccl": ("cuda",), "te": ("cuda",)}


class RequirementError(ValueError):
    """A requirement name this module does not know."""


def parse(item: str) -> str:
    """A requirement as written in a matrix, checked; raises RequirementError naming the known ones."""
    if not isinstance(item, str) or not (item in NAMES or _MEMORY.match(item) or _MODULE.match(item)):
        raise RequirementError(f"unknown requirement {item!r}; known: {', '.join(NAMES)}, host-memory-gib>=N, module:NAME")
    return item


def closure(requires: tuple[str, ...] | frozenset[str]) -> tuple[str, ...]:
    """`requires` plus what each implies, sorted (te -> cuda)."""
    out = set(requires)
    for r in list(out):
        out.update(_IMPLIES.get(r, ()))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Machine:
    """What this host offers, as the requirements read it."""

    cuda_devices: int
    nccl: bool
    te_missing: str | None  # None when transformer_engine is importable, else why not
    host_memory_gib: float
    #: what torch's CUDA probe raised (a broken driver or runtime), said in the cuda reason; None when it answered
    cuda_error: str | None = None


@lru_cache(maxsize=1)
def probe() -> Machine:
    import psutil
    import torch

    cuda_error = None
    try:
        devices = torch.cuda.device_count()
    except RuntimeError as exc:  # torch's CUDA errors (a broken driver or runtime): no usable device, and why, in the reason
        devices, cuda_error = 0, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    import torch.distributed as dist

    nccl = bool(dist.is_available() and dist.is_nccl_available())
    te_missing = None if importlib.util.find_spec("transformer_engine") is not None else "No module named 'transformer_engine'"
    return Machine(devices, nccl, te_missing, psutil.virtual_memory().total / 2**30, cuda_error)


def unmet(requires: tuple[str, ...], ranks: int, dist_backend: str = "auto", machine: Machine | None = None) -> list[str]:
    """One reason per need of `requires` (closed over implications) this machine does not meet for a
    case whose largest world has `ranks` ranks; [] when the case can run."""
    m = machine or probe()
    reasons = []
    for r in closure(requires):
        if r == "cuda":
            if dist_backend == "gloo":
                reasons.append("needs CUDA ranks, but --dist-backend gloo runs every rank on CPU")
            elif m.cuda_devices < ranks:
                why = f" (torch.cuda.device_count raised {m.cuda_error})" if m.cuda_error else ""
                reasons.append(f"needs {ranks} CUDA device(s), one per rank; this machine has {m.cuda_devices}{why}")
        elif r == "nccl" and not m.nccl:
            reasons.append("needs NCCL; this torch build has none")
        elif r == "te" and m.te_missing:
            reasons.append(f"needs Transformer-Engine: {m.te_missing}")
        elif (mod := _MODULE.match(r)) and (missing := module_missing(mod.group(1))):
            reasons.append(f"needs the module {mod.group(1)}: {missing}")
        elif mem := _MEMORY.match(r):
            need = float(mem.group(1))
            if m.host_memory_gib < need:
                reasons.append(f"needs {need:g} GiB of host memory; this machine has {m.host_memory_gib:.1f} GiB")
    return reasons


def module_missing(name: str) -> str | None:
    """Why the dotted module `name` is not installed (None when it is), found on the path without
    importing it or its parents (a parent's import may touch CUDA)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return f"No module named {top!r}"
    import os

    where = list(spec.submodule_search_locations or [])
    for i, part in enumerate(rest):
        found = [d for d in where if os.path.isdir(os.path.join(d, part)) or os.path.isfile(os.path.join(d, part + ".py"))]
        if not found:
            return f"No module named {'.'.join([top, *rest[:i + 1]])!r}"
        where = [os.path.join(d, part) for d in found if os.path.isdir(os.path.join(d, part))]
    return None
