"""What a training job is asked for: the DDP/optimizer knobs (TrainConfig), a case's training
options (TrainOptions), and the rules on which topologies and models can train."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from harness.compat import registry
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.models.mcore import (
    DType,
    LayerSpec,
)

GLOBAL_BATCH = 4  # sequences per step: divisible by every DP size the matrices use (1, 2, 4)


SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")


@dataclass(frozen=True)
class TrainConfig:
    """What a case asks of DDP and the optimizer; `propagation()` checks the built objects agree.

    `dtype` bf16 is Megatron-LM's `--bf16` mixed precision: bf16 params in a Float16Module, fp32
    main params (and Adam moments) in the optimizer, grads in bf16 unless grad_reduce_in_fp32."""

    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    #: Megatron-LM's --overlap-param-gather: after a step the distributed optimizer leaves the
    #: param all-gather to forward pre-hooks (bucket by bucket), so until the next forward the
    #: model params of other DP ranks' shards are stale; the job forces the sync before it
    #: saves or reads weights (`sync_params`, Megatron-LM's force_param_sync).
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = False
    lr: float = 1e-3
    weight_decay: float = 0.01
    dtype: DType = "fp32"
    #: Max params per DDP bucket; 0 = megatron-core's default (max(40M, 1M x DP): ONE bucket for
    #: the tiny zoo models). Real models have many buckets per rank, and the distributed optimizer
    #: shards each bucket across DP: a small size gives these models several (bucket-boundary bugs).
    #: megatron-core uses buckets only with overlap_grad_reduce, and only on the first PP stage.
    bucket_size: int = 0
    #: "none": no LR scheduler (the optimizer keeps `lr`: every case before issue 10, numbers
    #: unchanged); "warmup-cosine": a megatron-core OptimizerParamScheduler stepped after every
    #: optimizer step (build_scheduler), which a training checkpoint must carry.
    lr_schedule: Literal["none", "warmup-cosine"] = "none"
    #: local | te (harness.models.LayerSpec). A training case with te runs at CP 1 only: its
    #: batches are not split across CP ranks (`cp_rule`).
    layer_spec: LayerSpec = "local"
    #: megatron-core OptimizerConfig.optimizer: "adam" (Megatron-LM's default, AdamW-style decay) or
    #: "sgd" (momentum OptimizerConfig.sgd_momentum, 0.9): Megatron-LM #6920, resume parity beyond Adam
    #: (named optimizer_type: `optimizer` is convert's own option, a weights-only source when false)
    optimizer_type: Literal["adam", "sgd", "muon", "lion"] = "adam"
    #: Muon only (OptimizerConfig.muon_*): how Newton-Schulz treats a TP-sharded matrix. Megatron-LM's
    #: default "duplicated" orthogonalises the whole matrix (TP-invariant); Core's own default
    #: "blockwise" orthogonalises each shard, so its update depends on TP by design.
    muon_tp_mode: Literal["duplicated", "distributed", "blockwise"] = "duplicated"
    #: torch's float32 matmul precision inside Newton-Schulz (Core's and Megatron-LM's default "medium"
    #: lets matmuls run in bf16 where the hardware offers it)
    muon_fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    #: (beta1, beta2) of Adam (OptimizerConfig.adam_beta1/2); () megatron-core's (0.9, 0.999). [0, 0]:
    #: the moments a checkpoint holds are the last step's gradient and its square (the resume next-step check)
    betas: tuple[float, ...] = ()


def cp_rule(spec, opts: TrainConfig) -> None:
    """Raise ValueError for layer_spec te with CP>1 in a training case: the TE model would run ring
    attention over the CP group while every CP rank feeds the whole sequence (the training batches
    are split by DP only). reshard-weights' forward splits its batch and runs TE at CP>1."""
    if opts.layer_spec == "te" and max(spec.source.cp, spec.target.cp) > 1:
        raise ValueError("layer_spec 'te' with cp > 1: the training cases do not split their batches across CP ranks "
                         "(reshard-weights checks a TE CP forward)")


@dataclass(frozen=True)
class TrainOptions(TrainConfig):
    """The options of every training case (matrix `options`/`axes`)."""

    min_steps: ClassVar[int] = 1  # a case that can save an untrained job lowers it
    #: the distributed optimizer's format; fully_sharded_model_space (megatron-core's default when a load passes no
    #: metadata, and what checkpoints of Core <= 0.13 hold) and dp_zero_gather_scatter are deprecated upstream
    #: but still read: a job resuming an old checkpoint uses them
    sharding: Literal["dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter"] = "dp_reshardable"
    mem_efficient: bool = False
    steps: int = 2
    workarounds: tuple[str, ...] = registry.defaults("training")

    def __post_init__(self) -> None:
        registry.check("training", self.workarounds, "workaround(s)")
        if self.steps < self.min_steps:
            raise ValueError(f"option 'steps' must be >= {self.min_steps}, got {self.steps}")
        if self.betas and (len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"option 'betas' must be two numbers in [0, 1), got {list(self.betas)}")
        if self.betas and self.optimizer_type != "adam":
            raise ValueError(f"option 'betas' is Adam's; optimizer_type {self.optimizer_type!r} has none")
        if self.bucket_size < 0:
            raise ValueError(f"option 'bucket_size' must be >= 0, got {self.bucket_size}")
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            # Megatron-LM arguments.py: '--overlap-param-gather only supported with distributed optimizer'
            # and 'Must use --overlap-param-gather with --overlap-grad-reduce'
            raise ValueError("option 'overlap_param_gather' needs use_distributed_optimizer: true and overlap_grad_reduce: true "
                             "(as Megatron-LM requires)")
        if self.bucket_size and not self.overlap_grad_reduce:
            # megatron-core's DDP sets bucket_size to None without overlap: the entry would not test buckets
            raise ValueError("option 'bucket_size' takes effect only with overlap_grad_reduce: true "
                             "(megatron-core's DDP drops it otherwise)")

    @property
    def config(self) -> TrainConfig:
        return TrainConfig(**{f.name: getattr(self, f.name) for f in fields(TrainConfig)})


def untrainable_reason(spec: ModelSpec, topo: Topology) -> str | None:
    """Why the training cases cannot train `spec` at `topo` (None: they can); matrix validation
    refuses such an entry with it. MoE with TP > 1: megatron-core 0.19.2 MoELayer.forward raises in
    training unless sequence_parallel is on (transformer/moe/moe_layer.py:629); the harness's
    local-spec build does not turn it on, and could not without Apex: the torch norms the local spec
    falls back to refuse sequence_parallel (transformer/torch_norm.py:50). Expert TP (etp) > 1
    under tp 1 trains. vpp: the interleaved schedule's micro-batch groups must fit the global batch."""
    if getattr(spec, "is_moe", False) and topo.tp > 1:
        return (f"{topo.id}: a MoE model trains at tp > 1 only with sequence parallelism (megatron-core MoELayer.forward "
                "raises otherwise), which the harness's local-spec build leaves off (its torch norms refuse it without "
                "Apex, torch_norm.py); train MoE at tp1 (ep, etp, dp, pp change freely) or reshard weights only")
    micro = GLOBAL_BATCH // topo.dp  # micro-batches per step and DP rank (one sequence each)
    if topo.vpp > 1 and (micro < topo.pp or micro % topo.pp):
        return (f"{topo.id}: the interleaved schedule needs a multiple of PP={topo.pp} micro-batches per step and DP rank "
                f"(megatron-core schedules.py:1133-1153, microbatch_group_size_per_vp_stage = PP); the harness trains "
                f"{GLOBAL_BATCH} sequences per step, {micro} per DP rank here")
    return None


def untrainable(case_spec) -> None:
    """Matrix validation of a training case: raise ValueError when its model cannot train at its
    source or target topology here (`untrainable_reason`)."""
    from harness.core.zoo import get_model

    model = get_model(case_spec.model)
    for topo in (case_spec.source, case_spec.target):
        why = untrainable_reason(model, topo)
        if why:
            raise ValueError(f"model {case_spec.model!r} cannot train here: {why}")


def workaround_notes(opts: TrainOptions, *topos: Topology) -> list[str]:
    """The result notes that say which defects this run stepped around, and why (the vpp p2p
    setting only where a topology of the case has vpp: elsewhere nothing differs)."""
    vpp = any(t.vpp > 1 for t in topos)
    return [f"workaround applied: {w}: {registry.get(w).why}" for w in opts.workarounds if vpp or registry.get(w).only_on != "vpp"]
