"""HF PEFT's own adapter format: `PeftModel.save_pretrained` writes adapter_config.json and
adapter_model.safetensors (or adapter_model.bin) per adapter, `PeftModel.from_pretrained` /
`load_adapter` read them back into a transformers model. What users of the Megatron stacks meet
once an adapter leaves Megatron: verl saves its FSDP LoRA adapters this way, a Bridge export is
re-saved this way after loading, and an adapter trained with transformers + PEFT is handed to them.

Options (matrix `backend_options`):
  format             "safetensors" (peft's default) or "bin" (`safe_serialization=False`: the torch.save
                     file older adapters ship as; read back with peft's weights_only load)
  low_cpu_mem_usage  the load builds the adapter on the meta device and assigns the file's tensors
                     (peft's low_cpu_mem_usage=True), instead of initialising and then copying
  source             "dir": the load reads the saved directory; "hub-cache": the saved adapters are laid
                     out as a Hub repository in a local Hugging Face cache and loaded by repository id
                     with HF_HUB_OFFLINE=1 (a compute node without internet: `from_pretrained(base,
                     "org/adapter", cache_dir=...)`, a second adapter by `subfolder=`)
  ignore_mismatched_sizes  the load passes peft's ignore_mismatched_sizes=True: a file tensor whose
                     shape is not the model's is left out of the load and warned of, not refused
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from harness.backends import Backend
from harness.core.context import RankContext

SAFETENSORS, BIN = "adapter_model.safetensors", "adapter_model.bin"
#: the repository id and revision a hub-cache load asks for
REPO, REVISION = "ckpt-harness/adapter", "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class Options:
    format: Literal["safetensors", "bin"] = "safetensors"
    low_cpu_mem_usage: bool = False
    source: Literal["dir", "hub-cache"] = "dir"
    ignore_mismatched_sizes: bool = False


class HfPeft(Backend):
    name = "hf_peft"
    capabilities = frozenset({"adapter_io", "read_plain"})
    Options = Options
    preload = ("peft",)
    refusals = ("SafetensorError", "PeftError", "UnpicklingError")

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """Every adapter of a PeftModel (the first in `directory`, the others in sub-directories named
        after them), with peft's defaults otherwise (save_embedding_layers="auto")."""
        model.save_pretrained(str(directory), safe_serialization=self.options.format == "safetensors")

    def load(self, ctx: RankContext, model: Any, directory: Path, adapter: str = "default") -> Any:
        """`model` (a transformers model) with the adapter at `directory` loaded as users do; given a
        PeftModel, `adapter` is added to it (`load_adapter`). Returns the PeftModel."""
        from peft import PeftModel

        kwargs: dict[str, Any] = {"adapter_name": adapter, "low_cpu_mem_usage": self.options.low_cpu_mem_usage}
        if self.options.ignore_mismatched_sizes:
            kwargs["ignore_mismatched_sizes"] = True
        hub = self.options.source == "hub-cache"
        where = str(directory)
        if hub:
            where, more = hub_cache(Path(directory))
            kwargs.update(more)
        with _offline() if hub else nullcontext():
            if isinstance(model, PeftModel):
                model.load_adapter(where, **kwargs)
                return model
            return PeftModel.from_pretrained(model, where, **kwargs)

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """The adapter file's tensors by key, read without peft: safetensors, or the .bin file with
        torch's weights-only unpickler (tensors only; the harness wrote it)."""
        directory = Path(directory)
        if (directory / SAFETENSORS).is_file():
            from safetensors.torch import load_file

            return load_file(str(directory / SAFETENSORS))
        if (directory / BIN).is_file():
            return torch.load(directory / BIN, map_location="cpu", weights_only=True)
        raise FileNotFoundError(f"{directory}: neither {SAFETENSORS} nor {BIN}")


def hub_cache(directory: Path) -> tuple[str, dict[str, Any]]:
    """The saved adapters as the Hub cache holds a downloaded repository (refs/main naming a snapshot
    that holds the files), beside them in `hub-cache/`; the repository is the directory that holds
    the first adapter, a second one is its `subfolder`. Returns (repository id, from_pretrained's
    cache_dir and subfolder)."""
    root = directory.parent if (directory.parent / "adapter_config.json").is_file() else directory
    cache = root.parent / "hub-cache"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    if not repo.is_dir():
        snapshot = repo / "snapshots" / REVISION
        shutil.copytree(root, snapshot)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(REVISION)
    return REPO, {"cache_dir": str(cache), **({"subfolder": directory.name} if root != directory else {})}


@contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 as a user's environment sets it: huggingface_hub reads the variable once, at
    import, into `constants.HF_HUB_OFFLINE`, which this process imported long before."""
    import huggingface_hub.constants as hub

    before = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = before


BACKEND = HfPeft()
