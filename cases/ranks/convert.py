"""The worlds of case `convert` (cases/convert.py): a weights-only source save, upstream's converter
run in a rank, the Bridge's export of the converted checkpoint, and a load through a target backend.
The training save with optimizer state is cases/ranks/train_phase.py's, shared with reshard-optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.backends import BackendRef, get_backend
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import Shard
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, ModelSpec
from harness.models import mcore as models


@dataclass(frozen=True)
class WeightsSave:
    """A model-only torch_dist checkpoint (what `--no-save-optim` or a pretrained release holds):
    the canonical weights at `topo`, saved through `backend`."""

    model: ModelSpec
    topo: Topology
    backend: BackendRef
    save_to: str


def weights_save(ctx: RankContext, p: WeightsSave) -> int:
    model = models.build_gpt(p.model, p.topo)
    models.fill_canonical(model, p.model)
    with track("save"):
        get_backend(p.backend).save(ctx, model, Path(p.save_to))
    return sum(s.data.numel() for s in models.local_shards(model))


@dataclass(frozen=True)
class Conversion:
    """Upstream's converter script at `tool_path` (`tool_origin` says which), run with `argv`."""

    tool_path: str
    tool_origin: str
    argv: tuple[str, ...]
    workarounds: tuple[str, ...]


def convert(ctx: RankContext, p: Conversion) -> None:
    """Every rank runs the command, as `torchrun --nproc_per_node N checkpoint_inspector.py ARGV`
    does; the converter shards each tensor over the world and destroys the process group at the
    end (the world's body allows that)."""
    from harness.compat import megatron_lm as mlm

    module = mlm.load(mlm.Tool(p.tool_path, p.tool_origin))
    with track("convert"):
        mlm.run_command(module, p.argv, p.workarounds)


@dataclass(frozen=True)
class HFExport:
    """Megatron-Bridge's export of the Megatron checkpoint `checkpoint` with a bridge built from the
    HF fixture `hf_dir`: AutoBridge.load_megatron_model then save_hf_pretrained, the two calls
    AutoBridge.export_ckpt makes inside a process group of its own (a harness world already has
    one, so export_ckpt itself cannot run in it). First, the reference: the fixture's Bridge model
    with the torch_dist source's weights loaded through `backend`, exported the same way."""

    model: HFModelSpec
    hf_dir: str
    checkpoint: str
    export_to: str
    reference_from: str
    reference_to: str
    backend: BackendRef


def hf_export(ctx: RankContext, p: HFExport) -> None:
    from harness.models import bridge as mb

    reference = mb.build(p.hf_dir, p.model, Topology(), load_weights=False)
    with track("reference"):
        get_backend(p.backend).load(ctx, reference.modules, Path(p.reference_from))
        reference.bridge.save_hf_pretrained(reference.modules, p.reference_to, show_progress=False)
    with track("export"):
        model = reference.bridge.load_megatron_model(p.checkpoint, wrap_with_ddp=False)
        reference.bridge.save_hf_pretrained(model, p.export_to, show_progress=False)


@dataclass(frozen=True)
class TargetLoad:
    """Load the converted checkpoint through backend `backend` into the model built at `topo` (other
    weights first, so the load must overwrite each) and return the loaded weights."""

    model: ModelSpec
    topo: Topology
    backend: BackendRef
    load_from: str


def target_load(ctx: RankContext, p: TargetLoad) -> list[Shard]:
    backend = get_backend(p.backend)
    build = backend.builder()  # the backend's own model (mcore_fsdp: Megatron-FSDP), as reshard-weights builds it
    model = build.build_model(p.model, p.topo, "fp32", "local", p.model.with_seed(p.model.seed + truth.DECOY_SEED_OFFSET))
    with track("load"):
        backend.load(ctx, model, Path(p.load_from))
    return build.model_shards(model)
