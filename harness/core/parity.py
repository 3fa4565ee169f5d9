"""Parity: the judge. Pure functions over plain tensors, no distributed state.

Bitwise means bitwise: tensors are compared as raw bytes (so -0.0 vs 0.0 and NaN payloads count),
dtypes and shapes must match, and every missing or extra key is reported. A tolerance is used
only where a case names one and says why.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

import torch

Index = tuple  # per dim: (start, stop) for a sliced dim, or an int for a prepended axis


@dataclass
class Shard:
    """One rank's piece of a global tensor, as checkpoint metadata places it."""

    key: str
    global_shape: tuple[int, ...]
    index: Index
    replica_id: int | tuple
    data: torch.Tensor

    def slices(self) -> tuple:
        return tuple(slice(*i) if isinstance(i, tuple) else i for i in self.index)


@dataclass
class Mismatch:
    key: str
    kind: str  # value | dtype | shape | missing | extra | coverage | replica | tolerance
    expected: str  # what the expected side is (e.g. "canonical", "tp2pp1dp1cp1")
    actual: str
    max_abs_diff: float | None = None
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        diff = "" if self.max_abs_diff is None else f" max|diff|={self.max_abs_diff:.3g}"
        return f"{self.kind}: {self.key} ({self.expected} vs {self.actual}){diff} {self.detail}".rstrip()


@dataclass(frozen=True)
class Tolerance:
    """How a check compares: `kind` "allclose" within atol/rtol (named by `why`), "bitwise" (tensor
    bytes), "exact" (values equal), "budget" (a memory budget), or "none" (nothing compared, e.g. an
    outcome). A value in results.json (`to_json`), read back by `from_json`, never a string to parse
    (results.json files written before this had one: `from_json` reads those too)."""

    atol: float
    rtol: float
    why: str
    kind: str = "allclose"

    @property
    def label(self) -> str:
        """What reports print: 'bitwise', 'exact', '-', 'budget' or 'atol=.. rtol=.. (why)'."""
        if self.kind == "allclose":
            return f"atol={self.atol:g} rtol={self.rtol:g} ({self.why})"
        return "-" if self.kind == "none" else self.kind

    @property
    def toleranced(self) -> bool:
        """A named tolerance (not bitwise/exact): how close a case ran to it is worth showing."""
        return self.kind == "allclose"

    def __str__(self) -> str:
        return self.label

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "atol": self.atol, "rtol": self.rtol, "why": self.why, "label": self.label}

    @classmethod
    def from_json(cls, value: Any) -> "Tolerance":
        """A results.json tolerance: the structured form, or the string older harness code wrote."""
        if isinstance(value, Tolerance):
            return value
        if isinstance(value, dict):
            return cls(float(value.get("atol") or 0.0), float(value.get("rtol") or 0.0), str(value.get("why") or ""),
                       str(value.get("kind") or "allclose"))
        text = str(value or "bitwise")
        if text in _LEGACY:
            return _LEGACY[text]
        m = _LEGACY_ALLCLOSE.match(text)
        if m:
            return cls(float(m["atol"]), float(m["rtol"]), m["why"] or "")
        return cls(0.0, 0.0, text, "unknown")


#: how far an fp32 implementation may sit off a reference whose own fp32 error against its fp64 forward is e:
#: |other - reference| <= |other - exact| + |reference - exact| ~ 2e (cases/hf_roundtrip.py: the measurements)
REFERENCE_ERROR_FACTOR = 2.0


def widened(tol: Tolerance, reference_error: float | None, whose: str = "transformers'") -> Tolerance:
    """`tol` with its atol max(tol.atol, REFERENCE_ERROR_FACTOR x `reference_error`), naming both (`whose`: the
    reference measured); `tol` itself where nothing was measured (None)."""
    if reference_error is None:
        return tol
    why = (f"{tol.why}; max(atol {tol.atol:g}, {REFERENCE_ERROR_FACTOR:g} x {whose} own fp32 error "
           f"{reference_error:.3g} vs its fp64 forward)")
    return Tolerance(atol=max(tol.atol, REFERENCE_ERROR_FACTOR * reference_error), rtol=tol.rtol, why=why)


BITWISE = Tolerance(0.0, 0.0, "bitwise", "bitwise")
EXACT = Tolerance(0.0, 0.0, "exact", "exact")
NOT_COMPARED = Tolerance(0.0, 0.0, "nothing compared", "none")
BUDGET = Tolerance(0.0, 0.0, "memory budget", "budget")
_LEGACY = {"bitwise": BITWISE, "exact": EXACT, "-": NOT_COMPARED, "budget": BUDGET, "": BITWISE}
_LEGACY_ALLCLOSE = re.compile(r"^atol=(?P<atol>[0-9.eE+-]+) rtol=(?P<rtol>[0-9.eE+-]+)(?: \((?P<why>.*)\))?$", re.S)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("nan")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # reshape(-1): a 0-dim tensor (a checkpoint's scalar, e.g. a layer's scale) has no byte view of its own
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


def compare_tensors(
    key: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    expected_label: str,
    actual_label: str,
    tolerance: Tolerance | None = None,
) -> Mismatch | None:
    if expected.shape != actual.shape:
        return Mismatch(key, "shape", expected_label, actual_label, None, f"{tuple(expected.shape)} vs {tuple(actual.shape)}")
    if expected.dtype != actual.dtype:
        return Mismatch(key, "dtype", expected_label, actual_label, None, f"{expected.dtype} vs {actual.dtype}")
    if tolerance is None:
        if bitwise_equal(expected, actual):
            return None
        return Mismatch(key, "value", expected_label, actual_label, max_abs_diff(expected, actual), "not bitwise equal")
    if torch.allclose(actual.double(), expected.double(), atol=tolerance.atol, rtol=tolerance.rtol):
        return None
    return Mismatch(key, "tolerance", expected_label, actual_label, max_abs_diff(expected, actual), f"outside {tolerance}")


def compare_state(
    expected: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    expected_label: str,
    actual_label: str,
    tolerance: Tolerance | None = None,
) -> list[Mismatch]:
    """Every key of both sides, compared; missing = in expected only, extra = in actual only."""
    out: list[Mismatch] = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            out.append(Mismatch(key, "missing", expected_label, actual_label, None, f"absent from {actual_label}"))
        elif key not in expected:
            out.append(Mismatch(key, "extra", expected_label, actual_label, None, f"not in {expected_label}"))
        else:
            m = compare_tensors(key, expected[key], actual[key], expected_label, actual_label, tolerance)
            if m is not None:
                out.append(m)
    return out


def assemble(shards: Iterable[Shard], label: str) -> tuple[dict[str, torch.Tensor], list[Mismatch]]:
    """Full tensors from every rank's shards, checking that they tile each tensor and agree.

    coverage: an element no rank holds; replica: two ranks hold different bytes for the same
    element (e.g. DP replicas that diverged); shape: ranks disagree on the global shape.
    """
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    problems: list[Mismatch] = []
    # Main replicas first, so a replica is judged against the main copy it should equal.
    ordered = sorted(shards, key=lambda s: (s.key, _is_replica(s.replica_id)))
    for s in ordered:
        if s.key not in full:
            full[s.key] = torch.zeros(s.global_shape, dtype=s.data.dtype)
            covered[s.key] = torch.zeros(s.global_shape, dtype=torch.bool)
        elif tuple(full[s.key].shape) != tuple(s.global_shape):
            problems.append(
                Mismatch(s.key, "shape", label, label, None, f"ranks disagree on global shape: {tuple(full[s.key].shape)} vs {s.global_shape}")
            )
            continue
        region = full[s.key][s.slices()]
        seen = covered[s.key][s.slices()]
        data = s.data.reshape(region.shape)
        if seen.any():
            overlap_equal = torch.equal(region[seen].view(torch.uint8), data[seen].contiguous().view(torch.uint8))
            if not overlap_equal:
                problems.append(
                    Mismatch(
                        s.key, "replica", label, label, max_abs_diff(region[seen], data[seen]),
                        f"replica {s.replica_id} at {s.index} differs from the copy already held",
                    )
                )
        # Only elements no rank held yet: after a replica mismatch the main copy stays, so the
        # assembled tensor (compared against the truth next) is the main replica's, not the diverging one's.
        region[~seen] = data[~seen]
        covered[s.key][s.slices()] = True
    for key, mask in covered.items():
        if not bool(mask.all()):
            problems.append(
                Mismatch(key, "coverage", label, label, None, f"{int((~mask).sum())} of {mask.numel()} elements held by no rank")
            )
    return full, problems


def _is_replica(replica_id: int | tuple) -> bool:
    if isinstance(replica_id, int):
        return replica_id != 0
    return any(r != 0 for r in replica_id)
