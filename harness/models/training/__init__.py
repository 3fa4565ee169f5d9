"""Training jobs for the optimizer and resume cases: megatron DDP + megatron optimizer (Adam),
split along its seams: config, build, loop, views (the phase that drives a backend is
cases/ranks/train_phase.py, above the backends).

Data is synthetic and topology-independent: step s uses a global batch of GLOBAL_BATCH sequences
(harness.core.truth.train_batch); each DP rank takes its contiguous slice, one sequence per
micro-batch, so every topology trains on exactly the same samples and the same global-mean loss.
"""

from __future__ import annotations

from harness.models.training.build import (
    build_scheduler,
    build_training,
    built_dtype,
    built_layer_spec,
    knobs_reached,
    optimizer_config,
    propagation,
)
from harness.models.training.config import (
    GLOBAL_BATCH,
    SHARDING_TYPES,
    TrainConfig,
    TrainOptions,
    cp_rule,
    untrainable,
    untrainable_reason,
    workaround_notes,
)
from harness.models.training.loop import (
    PRIMED_STEP,
    load_pretrained,
    load_training,
    never_loaded,
    prime_optimizer_state,
    restart,
    stepped_once_state,
    sync_params,
    train_steps,
    unshare_adam_step,
)
from harness.models.training.views import (
    TrainingJob,
    adam_steps,
    fresh_view,
    leaf_optimizers,
    main_params_view,
    optimizer_view,
    rank_state_bytes,
    state_kinds,
    scheduler_view,
    sharded_state,
)

__all__ = [
    "GLOBAL_BATCH",
    "PRIMED_STEP",
    "SHARDING_TYPES",
    "TrainConfig",
    "TrainOptions",
    "TrainingJob",
    "adam_steps",
    "build_scheduler",
    "build_training",
    "built_dtype",
    "built_layer_spec",
    "cp_rule",
    "fresh_view",
    "knobs_reached",
    "leaf_optimizers",
    "load_pretrained",
    "load_training",
    "main_params_view",
    "never_loaded",
    "optimizer_config",
    "optimizer_view",
    "prime_optimizer_state",
    "propagation",
    "rank_state_bytes",
    "restart",
    "scheduler_view",
    "sharded_state",
    "state_kinds",
    "stepped_once_state",
    "sync_params",
    "train_steps",
    "unshare_adam_step",
    "untrainable",
    "untrainable_reason",
    "workaround_notes",
]
