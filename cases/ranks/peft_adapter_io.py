"""The rank side of peft-adapter-io: one process builds a transformers + PEFT model, gives its adapters
seeded random values and saves them through the backend; another builds the base again and loads them.
Each returns what the parent judges (tensors and logits, small: the fixtures are tiny)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..shared.adapter_draw import draw, input_ids
from harness.backends import BackendRef, get_backend
from harness.core.context import RankContext

#: the adapters' names: the first is PEFT's default, a second one is saved beside it
ADAPTERS = ("default", "second")
BASE_STATE = "base-state.safetensors"


@dataclass(frozen=True)
class Phase:
    hf_dir: str
    out: str  # the adapters' directory
    opts: Any  # cases.peft_adapter_io.Options
    backend: BackendRef
    seed: int


def base_model(p: Phase, seed: int, load: bool = False) -> Any:
    """The fixture as transformers loads it, its vocabulary resized when the options say (the rows it
    adds are drawn from `seed`: another process draws others; `load_base: unresized` loads onto the
    fixture as shipped)."""
    from transformers import AutoModelForCausalLM

    from harness.models.hf import quiet_hf

    quiet_hf()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(p.hf_dir, dtype=torch.float32)
    if p.opts.resize_vocab and not (load and p.opts.load_base == "unresized"):
        model.resize_token_embeddings(p.opts.resize_vocab)
    return model


def lora_config(opts: Any, second: bool = False) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=opts.dim + (2 if second else 0), lora_alpha=opts.alpha, target_modules=list(opts.targets),
                      use_dora=opts.variant == "dora", use_rslora=opts.variant == "rslora",
                      modules_to_save=list(opts.modules_to_save) or None,
                      trainable_token_indices=list(opts.trainable_token_indices) or None)


def of_adapters(name: str, names: tuple[str, ...]) -> bool:
    """Whether parameter `name` belongs to one of the adapters `names`: a segment of it is the adapter's
    name (LoRA's A/B, DoRA's magnitude, a modules_to_save copy, a trainable-tokens delta)."""
    return not set(name.split(".")).isdisjoint(names)


def adapter_params(model: Any, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every parameter of the adapters `names` (of_adapters), detached copies."""
    return {n: t.detach().clone() for n, t in model.named_parameters() if of_adapters(n, names)}


@torch.no_grad()
def ungather(model: Any, names: tuple[str, ...], how: str) -> dict[str, tuple[int, ...]]:
    """Each LoRA A/B weight of the adapters left as rank 0 of an ungathered two-rank world holds it when
    save_pretrained runs without gathering: `zero3`, DeepSpeed ZeRO-3 keeps a parameter's partition in
    its ds_tensor and sets param.data to an empty tensor (partition_parameters.py, free_param); `fsdp`,
    FSDP1 with use_orig_params=True leaves each original parameter a 1-D view of its part of the rank's
    shard of the unit's FlatParameter, or an empty tensor where the shard holds none of it
    (_flat_param.py, _use_sharded_views). Returns each replaced parameter's new shape."""
    lora = [(n, t) for n, t in model.named_parameters() if of_adapters(n, names) and {"lora_A", "lora_B"} & set(n.split("."))]
    flat = torch.cat([t.detach().reshape(-1) for _, t in lora]) if lora else torch.empty(0)
    shard, offset, shapes = flat[:(flat.numel() + 1) // 2], 0, {}
    for n, t in lora:
        start, end = min(offset, shard.numel()), min(offset + t.numel(), shard.numel())
        offset += t.numel()
        t.data = shard[start:end] if how == "fsdp" and end > start else torch.empty(0, dtype=t.dtype)
        shapes[n] = tuple(t.shape)
    return shapes


def every_param(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the model by name, detached copies (the fixtures are tiny)."""
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def logits_of(model: Any, adapters: tuple[str, ...]) -> dict[str, torch.Tensor]:
    model.eval()
    ids = input_ids(model.get_input_embeddings().weight.shape[0])
    out = {}
    for a in adapters:
        model.set_adapter(a)
        out[a] = model(input_ids=ids).logits.float().clone()
    model.set_adapter(adapters[0])
    return out


def save_rank(ctx: RankContext, p: Phase) -> dict[str, Any]:
    """Build, draw the adapters, save them (and, with `base_state`, peft's base-model state dict)."""
    from peft import get_peft_model

    names = ADAPTERS[:p.opts.adapters]
    base = base_model(p, p.seed)
    plain = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, lora_config(p.opts))
    if len(names) > 1:
        model.add_adapter(names[1], lora_config(p.opts, second=True))
    draw(model, lambda n: of_adapters(n, names), p.seed)
    logits = logits_of(model, names)
    with model.disable_adapter():
        without = logits_of(model, names[:1])[names[0]]
    out, every = Path(p.out), every_param(model) if p.opts.load_base == "unresized" else None
    params = adapter_params(model, names)
    ungathered = ungather(model, names, p.opts.save_from) if p.opts.save_from != "gathered" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_backend(p.backend).save(ctx, model, out)
    base_state = None
    if p.opts.base_state:
        from peft.utils.save_and_load import get_base_model_state_dict
        from safetensors.torch import save_file

        base_state = {k: v.detach().clone().contiguous() for k, v in get_base_model_state_dict(model).items()}
        save_file(base_state, str(out / BASE_STATE))
    return {"params": params, "logits": logits, "without": without, "plain": plain, "every": every,
            "ungathered": ungathered, "base_state": base_state, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def load_rank(ctx: RankContext, p: Phase) -> dict[str, Any]:
    """A fresh base (its resized rows drawn anew), the adapters loaded through the backend as users load
    them; with `base_state`, the base's weights then disturbed and restored with peft's set_base_model_state_dict."""
    names = ADAPTERS[:p.opts.adapters]
    backend, out = get_backend(p.backend), Path(p.out)
    model = base_model(p, p.seed + 1, load=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = backend.load(ctx, model, out, names[0])
        for a in names[1:]:
            backend.load(ctx, model, out / a, a)
    params, logits = adapter_params(model, names), logits_of(model, names)
    restored = None
    if p.opts.base_state:
        from peft.utils.save_and_load import set_base_model_state_dict
        from safetensors.torch import load_file

        with torch.no_grad():
            for n, t in model.named_parameters():
                if n not in params:
                    t.add_(0.5)
        set_base_model_state_dict(model, load_file(str(out / BASE_STATE)))
        restored = logits_of(model, names)
    every = fresh = None
    if p.opts.load_base == "unresized":  # the loaded model, and one built the same way (same seed) that loads nothing
        from peft import PeftConfig, PeftModel

        every = every_param(model)
        fresh = every_param(PeftModel(base_model(p, p.seed + 1, load=True), PeftConfig.from_pretrained(str(out))))
    return {"params": params, "logits": logits, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "restored": restored, "every": every, "fresh": fresh}
