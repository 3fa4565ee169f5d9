"""Named upstream defects of the peft-export (LoRA) cases of matrices/architectures.yaml: strict
xfails keyed "family" (every pair) or "family pair" (one pair), filled from the triage
(docs/architectures.md). Data only; harness.models.architectures writes them into the matrix."""

from __future__ import annotations

from typing import Any

LORA: dict[str, dict[str, Any]] = {}
