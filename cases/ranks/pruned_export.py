"""The worlds of case `pruned-export` (cases/pruned_export.py): a student trained from scratch and
saved by a Bridge training job, then exported as a user exports a pruned or from-scratch model:
AutoBridge.from_auto_config(checkpoint, teacher) -> load_megatron_model -> save_hf_pretrained."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.backends import BackendRef, get_backend
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec
from harness.models import bridge as mb


@dataclass(frozen=True)
class StudentSave:
    """World "save" at `topo`: the student's Bridge model from its own HF-shaped config without
    weights (the provider's init: a from-scratch or pruned-and-reinitialised job), megatron DDP and
    optimizer in `dtype` (bf16: Megatron-LM's --bf16 mixed precision), `steps` optimizer steps,
    saved through `backend` (bridge_training: Bridge's save_checkpoint, run_config.yaml included)."""

    student: HFModelSpec
    student_dir: str
    topo: Topology
    dtype: str
    steps: int
    backend: BackendRef
    save_to: str


def student_save(ctx: RankContext, p: StudentSave) -> None:
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from harness.models import training

    backend = get_backend(p.backend)
    cfg = training.TrainConfig(dtype=p.dtype, lr_schedule="warmup-cosine")
    bm = mb.build(p.student_dir, p.student, p.topo, load_weights=False, dtype=p.dtype,
                  ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False))
    config = bm.modules[0].config  # the provider itself: what save_checkpoint writes to run_config.yaml
    # the Bridge's own local (no Transformer-Engine) spec function, what a recipe without TE names; the
    # model was built from the same spec (harness.models.bridge.build: get_gpt_layer_local_spec, RMSNorm).
    # The built ModuleSpec object itself does not load back from run_config.yaml: its MLP partial's
    # MLPSubmodules is written without linear_fc1/linear_fc2 (load_model_config's instantiate: TypeError)
    config.transformer_layer_spec = local_layer_spec
    optimizer = get_megatron_optimizer(training.optimizer_config(cfg), bm.modules)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = bm.modules[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    job = training.TrainingJob(bm.modules, optimizer, training.build_scheduler(optimizer, cfg), sharding="fully_reshardable",
                               bridge=bm, seed=p.student.seed)
    training.train_steps(job.chunks, optimizer, p.student, 0, p.steps, job.scheduler)
    job.step = p.steps
    with track("save"):
        backend.save_training(ctx, job, Path(p.save_to))


@dataclass(frozen=True)
class AutoExport:
    """World "export" at `topo`: the user's flow on the training checkpoint root `checkpoint` with
    the teacher's HF directory `teacher_dir` as the reference: from_auto_config, then the two calls
    AutoBridge.export_ckpt makes (load_megatron_model, save_hf_pretrained) inside the world's process
    group (export_ckpt opens one of its own, which a world already has). Past TP/PP 1 the load gets
    `mp_overrides` (load_megatron_model resets both to 1 otherwise). Returns Megatron's logits of
    the loaded model at `topo` (None off the rank that holds them) as loaded and with the training hooks
    cleared, what the as-loaded forward raised, and the hooks."""

    student: HFModelSpec
    checkpoint: str
    teacher_dir: str
    topo: Topology
    export_to: str


def auto_export(ctx: RankContext, p: AutoExport) -> "ExportOut":
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    from harness.models.parallel import seed_model_parallel

    seed_model_parallel(p.student.seed)
    with track("export"):
        bridge = AutoBridge.from_auto_config(p.checkpoint, p.teacher_dir)
        overrides: dict[str, Any] = {}
        if p.topo.tp > 1 or p.topo.pp > 1:
            overrides = {"tensor_model_parallel_size": p.topo.tp, "pipeline_model_parallel_size": p.topo.pp}
        model = bridge.load_megatron_model(p.checkpoint, mp_overrides=overrides or None, wrap_with_ddp=False)
        built = (model[0].config.tensor_model_parallel_size, model[0].config.pipeline_model_parallel_size)
        if built != (p.topo.tp, p.topo.pp):
            raise RuntimeError(f"load_megatron_model built TP/PP {built}, the world is {p.topo.id}")
        try:  # the loaded model as load_megatron_model returns it, through megatron-core's forward-only schedule
            as_loaded, forward_error = mb.megatron_logits(mb.BridgeModel(bridge, model), p.student, ctx.device), ""
        except Exception as exc:  # noqa: BLE001 - what the user's evaluation meets: the loaded-forward check names it
            as_loaded, forward_error = None, f"{type(exc).__name__}: {exc}"
        hooks = training_hooks(model[0].config)
        logits = mb.megatron_logits(mb.BridgeModel(bridge, model), p.student, ctx.device)
        bridge.save_hf_pretrained(model, p.export_to, show_progress=False)
    return ExportOut(logits, hooks, as_loaded, forward_error)


#: the training loop's hooks on a model config (Bridge's setup.py:565-578 sets them, as Megatron-LM does)
TRAINING_HOOKS = ("no_sync_func", "grad_scale_func", "finalize_model_grads_func")


@dataclass
class ExportOut:
    logits: torch.Tensor | None
    #: the saved job's training hooks the loaded model's config carried (run_config.yaml records them), by name
    hooks: dict[str, str]
    #: the logits of the model as loaded (before the hooks are cleared), and what that forward raised
    as_loaded: torch.Tensor | None = None
    forward_error: str = ""


def training_hooks(config: Any) -> dict[str, str]:
    """Clear the training loop's hooks a loaded config carries and say which it held: the saved
    job's (bound methods of its DDP and optimizer, written to run_config.yaml as their functions)
    come back unbound, and megatron-core's forward schedule calls no_sync_func() (TypeError: no
    self). An evaluation forward runs without them, as a fresh inference config does."""
    held = {}
    for name in TRAINING_HOOKS:
        value = getattr(config, name, None)
        if value is not None:
            held[name] = getattr(value, "__qualname__", type(value).__name__)
            setattr(config, name, None)
    return held
