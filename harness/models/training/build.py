"""Build a training job as Megatron-LM does (DDP over the GPT chunks, megatron-core's optimizer and
LR scheduler) and read back what the built objects really use (`propagation`)."""

from __future__ import annotations

import operator
from typing import Any

import torch

from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.models.mcore import (
    TORCH_DTYPES,
    build_gpt,
    fill_canonical,
)
from harness.models.training.config import TrainConfig
from harness.models.training.views import layer_wise_leaves, leaf_optimizers


def build_training(spec: ModelSpec, topo: Topology, cfg: TrainConfig, seed_offset: int = 0, **config_overrides: Any):
    """(DDP-wrapped model chunks, optimizer) at this rank, weights = canonical (of seed + seed_offset).

    As Megatron-LM's `get_model` + `get_megatron_optimizer`: every chunk of `build_gpt` (one per
    virtual pipeline stage) in its own DistributedDataParallel with the one DDP config, bucketing
    off for every chunk but the first (megatron's default for the interleaved schedule), and one
    megatron optimizer over the chunk list.

    bf16 is built the way Megatron-LM's training setup builds it: DDP over Float16Module(GPTModel
    in bf16), and an OptimizerConfig with bf16=True and params_dtype bf16, so megatron's optimizer
    keeps fp32 main params (main_params_dtype's default) that it steps and copies down into the
    bf16 model params after each step. The main params start as the bf16 canonical weights upcast
    (what megatron does at optimizer build). `config_overrides` go to the TransformerConfig."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import get_megatron_optimizer

    weights = spec.with_seed(spec.seed + seed_offset) if seed_offset else spec
    chunks = build_gpt(spec, topo, cfg.dtype, cfg.layer_spec, **config_overrides)
    fill_canonical(chunks, weights)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        bucket_size=cfg.bucket_size or None,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
    )
    config = chunks[0].config
    layouts = layer_wise_layouts(chunks, ddp_config) if layer_wise(cfg) else [None] * len(chunks)
    ddp = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0, **({"full_param_layout": lay} if lay else {}))
           for i, (c, lay) in enumerate(zip(chunks, layouts))]
    optimizer = get_megatron_optimizer(optimizer_config(cfg), ddp)
    # What Megatron-LM's training loop wires up: without finalize_model_grads the schedule never
    # reduces gradients across DP (nor tied-embedding grads across PP stages).
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def layer_wise(cfg: TrainConfig) -> bool:
    """Megatron-LM's reading of `--optimizer muon --use-distributed-optimizer` (arguments.py, "emerging
    optimizer check"): the layer-wise distributed optimizer, with use_distributed_optimizer itself off
    in the OptimizerConfig and on in DDP's (reduce-scatter into shard-aligned buffers)."""
    return getattr(cfg, "optimizer_type", "adam") not in ("adam", "sgd") and cfg.use_distributed_optimizer


def layer_wise_layouts(chunks, ddp_config) -> list:
    """Per chunk, the shard-aligned param layout Megatron-LM 0.19's `wrap_model_chunks_with_ddp` computes
    for the layer-wise optimizer (after tagging each param for buffer routing), from megatron-core's
    own LayerWiseDistributedOptimizer.compute_full_param_layout; DDP's config must then reduce-scatter."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    ddp_config.use_distributed_optimizer = True
    tag_params_for_buffer_routing(chunks)
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    edp = parallel_state.get_expert_data_parallel_world_size()
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    return [LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in c.parameters() if p.requires_grad], ddp_config.bucket_size if first_stage and i == 0 else None, dp,
        ddp_config, expert_data_parallel_world_size=edp) for i, c in enumerate(chunks)]


def optimizer_config(cfg: TrainConfig):
    """megatron-core's OptimizerConfig for `cfg`, as Megatron-LM builds it from its arguments (Adam,
    clip 1.0, bf16 flags with fp32 main params; the LR floor only where a scheduler reads it)."""
    from megatron.core.optimizer import OptimizerConfig

    betas = dict(adam_beta1=float(cfg.betas[0]), adam_beta2=float(cfg.betas[1])) if getattr(cfg, "betas", ()) else {}
    kind = getattr(cfg, "optimizer_type", "adam")
    muon = dict(muon_tp_mode=cfg.muon_tp_mode, muon_fp32_matmul_prec=cfg.muon_fp32_matmul_prec) if kind == "muon" else {}
    # named only when asked, as Megatron-LM's args do: a Core before the layer-wise optimizer (0.17) has no such field
    wise = dict(use_layer_wise_distributed_optimizer=True) if layer_wise(cfg) else {}
    return OptimizerConfig(
        optimizer=kind,
        **betas,
        **muon,
        **wise,
        lr=cfg.lr,
        # the param groups' floor, read by an OptimizerParamScheduler (None without one: unchanged)
        min_lr=cfg.lr / 100 if cfg.lr_schedule != "none" else None,
        weight_decay=cfg.weight_decay,
        use_distributed_optimizer=cfg.use_distributed_optimizer and not layer_wise(cfg),
        bf16=cfg.dtype == "bf16",
        fp16=False,
        params_dtype=TORCH_DTYPES[cfg.dtype],
        clip_grad=1.0,
        overlap_param_gather=cfg.overlap_param_gather,  # Megatron-LM sets both configs from one flag
    )


def build_scheduler(optimizer, cfg: TrainConfig):
    """The job's LR scheduler, or None for lr_schedule "none". "warmup-cosine" is what verl's
    get_megatron_optimizer_param_scheduler builds: megatron-core's OptimizerParamScheduler (here 2
    warmup steps from lr/10, cosine decay to lr/100 over 20 steps, constant weight decay), taking
    its state from a checkpoint when one is loaded (use_checkpoint_opt_param_scheduler)."""
    if cfg.lr_schedule == "none":
        return None
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr / 10, max_lr=cfg.lr, min_lr=cfg.lr / 100, lr_warmup_steps=2, lr_decay_steps=20,
        lr_decay_style="cosine", start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=20,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False,
    )


def built_dtype(ddp, optimizer) -> str:
    """The precision the built job really trains in: "bf16" when the model is a Float16Module
    holding only bf16 params and every optimizer has bf16 on and steps fp32 main params, "fp32"
    when model params, optimizer params and config are all fp32, else what was found (a mix is a
    knob that did not reach one of them)."""
    from megatron.core.transformer.module import Float16Module

    model_dtypes = {p.dtype for d in ddp for p in d.module.parameters()}
    inner = leaf_optimizers(optimizer)
    main_dtypes = {p.dtype for o in inner for g in o.optimizer.param_groups for p in g["params"]}
    flags = {bool(o.config.bf16) for o in inner}
    wrapped = all(isinstance(d.module, Float16Module) for d in ddp)
    if wrapped and model_dtypes == {torch.bfloat16} and main_dtypes <= {torch.float32} and flags == {True}:
        return "bf16"
    if not wrapped and model_dtypes == {torch.float32} and main_dtypes <= {torch.float32} and flags <= {False}:
        return "fp32"
    names = lambda ds: "/".join(sorted(str(d).removeprefix("torch.") for d in ds))  # noqa: E731
    return (f"model {'/'.join(sorted({type(d.module).__name__ for d in ddp}))} params {names(model_dtypes)}, optimizer params {names(main_dtypes)}, "
            f"optimizer bf16={sorted(flags)}")


def built_layer_spec(model) -> str:
    """"te" when any module of the built model is one of megatron-core's Transformer-Engine
    wrappers, else "local"."""
    return "te" if any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules()) else "local"


#: torch optimizer class -> the optimizer_type it is built for (Core picks torch AdamW on CPU, Apex's or
#: TE's FusedAdam on GPU)
_BUILT_AS = {"AdamW": "adam", "Adam": "adam", "FusedAdam": "adam", "SGD": "sgd", "Lion": "lion"}  # and *Muon: "muon"


def optimizer_built(asked: str, built: str) -> bool:
    """Whether the torch optimizers `built` ("AdamW+TensorParallelMuon") are what optimizer_type `asked`
    builds: adam and sgd alone; an emerging optimizer (muon, lion) steps the matrices and Adam the rest
    (embeddings, norms, biases: Core's default param overrides)."""
    kinds = {"muon" if name.endswith("Muon") else _BUILT_AS.get(name, name) for name in built.split("+")}
    if asked in ("adam", "sgd"):
        return kinds == {asked}
    return asked in kinds and kinds <= {asked, "adam"}


def propagation(ddp, optimizer, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Asked vs actually used, for every knob the case set (the class of verl PR #5775)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = leaf_optimizers(optimizer)
    sharded = {id(o) for o in layer_wise_leaves(optimizer)}  # DP-sharded by whole params

    def built(knob: str):  # one value for every chunk's DDP config, else the disagreement
        values = {getattr(d.ddp_config, knob) for d in ddp}
        return values.pop() if len(values) == 1 else f"chunks disagree: {sorted(values)}"

    actual = {
        "use_distributed_optimizer": (
            built("use_distributed_optimizer")
            and all(isinstance(o, DistributedOptimizer) or id(o) in sharded for o in inner)
            # layer-wise: Core gives the DistributedOptimizer beside it the chain's config, whose
            # use_distributed_optimizer Megatron-LM turned off (the classes say what shards)
            and (bool(sharded) or all(o.config.use_distributed_optimizer for o in inner))
        ),
        # the torch optimizers that step (Core picks torch AdamW for "adam"; Muon keeps Adam for the rest)
        "optimizer_type": "+".join(sorted({type(o.optimizer).__name__ for o in inner})),
        "layer_wise": bool(sharded),
        "overlap_grad_reduce": built("overlap_grad_reduce"),
        # the config flag and what it builds: forward pre-hooks that finish each bucket's all-gather
        "overlap_param_gather": built("overlap_param_gather") is True and ddp[0].use_forward_hook
        and len(ddp[0].remove_forward_pre_hook_handles) > 0 and all(o.config.overlap_param_gather for o in inner),
        "grad_reduce_in_fp32": built("grad_reduce_in_fp32")
        and all(b.grad_dtype == torch.float32 for d in ddp for b in d.buffers),
        "lr": inner[0].param_groups[0]["lr"] if inner else None,
        "dtype": built_dtype(ddp, optimizer),
        "layer_spec": built_layer_spec(ddp[0].module),
    }
    # The optimizer must also see DDP's setting (a mismatch reduce-scatters into an optimizer
    # that expects all-reduced grads, or the reverse).
    if built("use_distributed_optimizer") != any(isinstance(o, DistributedOptimizer) for o in inner):
        actual["use_distributed_optimizer"] = "ddp and optimizer disagree"
    asked = {
        "use_distributed_optimizer": cfg.use_distributed_optimizer,
        "optimizer_type": getattr(cfg, "optimizer_type", "adam"),
        "layer_wise": layer_wise(cfg),
        "overlap_grad_reduce": cfg.overlap_grad_reduce,
        "overlap_param_gather": cfg.overlap_param_gather,
        "grad_reduce_in_fp32": cfg.grad_reduce_in_fp32,
        "lr": cfg.lr,
        "dtype": cfg.dtype,
        "layer_spec": cfg.layer_spec,
    }
    same = {"optimizer_type": optimizer_built}  # knobs whose built value is not the asked one spelled alike
    rows = [{"knob": k, "asked": asked[k], "actual": actual[k], "ok": same.get(k, operator.eq)(asked[k], actual[k])} for k in asked]
    # Buckets: what the DDP module of the first chunk really built on this rank. megatron-core turns
    # bucketing off on every PP stage but the first (and Megatron-LM, as build_training, for every
    # chunk but the first), so a small bucket_size must give several buckets there only.
    from megatron.core import parallel_state

    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    first = ddp[0]
    buckets = sum(len(b.buckets) for b in first.buffers)
    if not cfg.bucket_size:
        rows.append({"knob": "bucket_size", "asked": "megatron default", "actual": first.bucket_size, "ok": True})
    elif first_stage:
        rows.append({"knob": "bucket_size", "asked": cfg.bucket_size, "actual": first.bucket_size, "ok": first.bucket_size == cfg.bucket_size})
        rows.append({"knob": "buckets", "asked": "several", "actual": buckets, "ok": buckets > 1})
    else:
        rows.append({"knob": "bucket_size", "asked": "none (PP stage > 0)", "actual": first.bucket_size, "ok": first.bucket_size is None})
    if cfg.bucket_size:
        later = [d.bucket_size for d in ddp[1:]]
        if later:
            rows.append({"knob": "bucket_size (chunks > 0)", "asked": "none", "actual": later, "ok": all(b is None for b in later)})
    return rows


def knobs_reached(rows_per_rank) -> str:
    """What a passed propagation check says: every knob the ranks' `propagation` rows checked."""
    knobs = dict.fromkeys(r["knob"] for rows in rows_per_rank for r in rows or ())
    return f"{', '.join(knobs)} reach DDP config, optimizer and model"
