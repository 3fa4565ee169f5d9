"""Reading safetensors directories: the plain reader of the HF backends (no model, no Bridge)."""

from __future__ import annotations

from pathlib import Path

import torch


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `directory`, by HF key."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in out:
                raise ValueError(f"{directory}: key {k} appears in two safetensors files")
            out[k] = v
    return out
