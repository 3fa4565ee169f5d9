"""The rank side of peft-tp-load. One process makes the adapter: the fixture in transformers, LoRA on the
targets, every adapter tensor drawn at random (seeded: each holds values no other has), logits with and
without it, saved through the backend. Then each rank of a tensor-parallel world loads the base with
transformers' own TP (`from_pretrained(..., tp_plan="auto")`, the serving path under torchrun), the adapter
with PeftModel.from_pretrained, and saves it back with save_pretrained (peft gathers the shards); each
returns its adapter shards, logits, the base's TP plan and what the load and the save warned of.
Self-contained (peft-adapter-io's rank module grows with that case's options)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..shared.adapter_draw import draw, input_ids
from harness.backends import BackendRef, get_backend
from harness.core.context import RankContext

#: the adapter directory the TP world saves back into, one per rank (every rank gathers, none shares a file)
RESAVED = "resaved-rank{rank}"


@dataclass(frozen=True)
class MakePhase:
    hf_dir: str
    out: str  # the adapter's directory
    targets: tuple[str, ...]
    dim: int
    alpha: int
    backend: BackendRef
    seed: int


@dataclass(frozen=True)
class TpPhase:
    hf_dir: str
    adapter: str  # the adapter the single-process world saved
    out: str  # where each rank saves it back (RESAVED)
    backend: BackendRef


@torch.no_grad()
def logits_on(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for `ids`, on the CPU (a GPU world's ranks compute on their device)."""
    model.eval()
    device = next(model.parameters()).device
    return model(input_ids=ids.to(device)).logits.float().cpu().clone()


def adapter_params(model: Any) -> dict[str, torch.Tensor]:
    """The default adapter's LoRA tensors by parameter name, detached CPU copies."""
    return {n: t.detach().cpu().clone() for n, t in model.named_parameters() if ".lora_" in n and ".default." in n}


def make_rank(ctx: RankContext, p: MakePhase) -> dict[str, Any]:
    """The adapter made and saved by one process; its tensors and logits (with it and without) are the truth."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from harness.models.hf import quiet_hf

    quiet_hf()
    base = AutoModelForCausalLM.from_pretrained(p.hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=p.dim, lora_alpha=p.alpha, target_modules=list(p.targets)))
    draw(model, lambda n: ".lora_" in n, p.seed)
    ids = input_ids(model.get_input_embeddings().weight.shape[0])
    logits = logits_on(model, ids)
    with model.disable_adapter():
        without = logits_on(model, ids)
    get_backend(p.backend).save(ctx, model, Path(p.out))
    return {"params": adapter_params(model), "logits": logits, "without": without}


def tp_load_rank(ctx: RankContext, p: TpPhase) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from harness.models.hf import quiet_hf

    quiet_hf()
    backend = get_backend(p.backend)
    base = AutoModelForCausalLM.from_pretrained(p.hf_dir, tp_plan="auto", dtype=torch.float32)
    plan = dict(getattr(base, "_tp_plan", None) or {})  # transformers' resolved plan: module pattern -> style
    with warnings.catch_warnings(record=True) as loaded:
        warnings.simplefilter("always")
        model = backend.load(ctx, base, Path(p.adapter))
    shards = adapter_params(model)
    logits = logits_on(model, input_ids(model.get_input_embeddings().weight.shape[0]))
    with warnings.catch_warnings(record=True) as saved:
        warnings.simplefilter("always")
        backend.save(ctx, model, Path(p.out) / RESAVED.format(rank=ctx.rank))
    return {"plan": plan, "tp_size": getattr(base, "_tp_size", None), "shards": shards, "logits": logits,
            "load_warnings": [f"{w.category.__name__}: {w.message}" for w in loaded],
            "save_warnings": [f"{w.category.__name__}: {w.message}" for w in saved]}
