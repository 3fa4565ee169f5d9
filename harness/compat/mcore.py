"""megatron-core: its dist_checkpointing write-results queue (shims, any device), the defects a
training case steps around (records with switch 'training': the case option `workarounds`) and the
API fallbacks for older releases.

The training workarounds are applied only when a case's matrix entry lists them (`apply_workaround`
for the process-wide one, harness.models.training for the others); an entry with one switched off shows
the defect as a named strict xfail, so a workaround never hides what the harness must show. No
workaround is keyed on a version: the versions in the reasons say where the defect was read.
"""

from __future__ import annotations

import queue

import torch

from harness.compat._shim import ADAPTS, CALLER, HIDES, REQUIRE, Shim, note


def _filesystem_async():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def _spawn_queue_pending(device: torch.device) -> bool:
    """megatron-core still creates its write-results queue lazily (a module-level None that
    get_write_results_queue, `_get_write_results_queue` up to 0.15, fills with a spawn-mode Manager queue)."""
    fs = _filesystem_async()
    lazy = hasattr(fs, "get_write_results_queue") or hasattr(fs, "_get_write_results_queue")
    return lazy and getattr(fs, "_results_queue", False) is None


def _patch_results_queue() -> None:
    _filesystem_async()._results_queue = queue.Queue()


def _in_process_queue(device: torch.device) -> bool:
    """The write-results queue is one a forked writer cannot put to (the in-process one, or none yet)."""
    fs = _filesystem_async()
    return hasattr(fs, "_results_queue") and (fs._results_queue is None or isinstance(fs._results_queue, queue.Queue))


def _cross_process_results_queue() -> None:
    """mcore_dist async_save: the write runs in a child that megatron-core's TemporalAsyncCaller
    forks; its results must come back to the rank, which the in-process queue.Queue cannot do.
    A fork-context Manager queue (megatron's own get_write_results_queue, with mp_mode fork:
    spawn would re-import __main__ in every rank)."""
    _filesystem_async()._results_queue = fork_manager().Queue()


def _close_inherited_sockets() -> None:
    """In the forked Manager, before its server starts: the rank's sockets (its process group's
    gloo/NCCL connections) are not the Manager's; kept open, they outlive a killed rank and its
    peers wait on them until the world's timeout instead of failing at once. Its own listener is
    made after this, and the pipe it reports the address on is no socket."""
    import os
    import stat

    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                os.close(int(name))
        except OSError:
            pass  # the listing's own fd, already gone


def fork_manager():
    """A started fork-context multiprocessing Manager that holds none of the rank's sockets."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(_close_inherited_sockets)
    return manager


def _moe_utils():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


def _router_gemm_unbound(device: torch.device) -> bool:
    """moe_utils imported te_general_gemm inside its TE try-block and, without TE, never bound it:
    router_gating_linear's `if te_general_gemm is not None` raises NameError."""
    m = _moe_utils()
    return hasattr(m, "router_gating_linear") and not hasattr(m, "te_general_gemm")


def _bind_router_gemm() -> None:
    _moe_utils().te_general_gemm = None  # the value the module's own fallback branch expects


#: The on-demand shim every async save asks for (`require`): mcore_dist with `async_save: mcore`
#: and verl_manager with `async_save` (verl's saves go through the same megatron-core writer).
ASYNC_RESULTS_QUEUE = "mcore_dist async_save: cross-process write-results queue"

SHIMS: tuple[Shim, ...] = (
    Shim(
        name="in-process write-results queue",
        upstream="megatron.core.dist_checkpointing.strategies.filesystem_async",
        why="FileSystemWriterAsync's first save starts a spawn-mode multiprocessing Manager that "
        "re-imports __main__ (~5 s per rank); synchronous saves write from threads of the "
        "same process, so a queue.Queue serves",
        probe="filesystem_async has a lazy write-results queue getter (get_write_results_queue or "
        "_get_write_results_queue) and its module-level _results_queue is still None",
        retire_when="when filesystem_async no longer creates a module-level spawn Manager queue on first save",
        kind=ADAPTS,
        apply=_patch_results_queue,
        needed=_spawn_queue_pending,
    ),
    Shim(
        name="MoE router without Transformer-Engine",
        upstream="megatron.core.transformer.moe.moe_utils",
        why="megatron-core's MoE router (moe_utils.router_gating_linear) tests `te_general_gemm is not None`, "
        "a name bound only when TE imports: without TE every MoE forward raises NameError; bound to None, "
        "the module's own torch fallback runs",
        probe="moe_utils has router_gating_linear but no te_general_gemm attribute",
        retire_when="when moe_utils binds te_general_gemm without TE (0.19.2 does; 0.15.3 and 0.16.1 do not)",
        kind=ADAPTS,
        apply=_bind_router_gemm,
        needed=_router_gemm_unbound,
    ),
    # ---- mcore_dist save/load strategies (backend options; on demand: only a backend that asks gets it)
    Shim(
        name=ASYNC_RESULTS_QUEUE,
        upstream="megatron.core.dist_checkpointing.strategies.filesystem_async",
        why="megatron-core's async save (TemporalAsyncCaller) writes in a forked child whose write results "
        "the in-process queue.Queue above cannot carry back ('results_queue should not be empty'): a "
        "fork-context multiprocessing Manager queue, started on the rank's first async save",
        probe="filesystem_async's _results_queue is None or an in-process queue.Queue",
        retire_when="with the in-process queue above (or when filesystem_async has no module-level queue)",
        kind=ADAPTS,
        apply=_cross_process_results_queue,
        needed=_in_process_queue,
        trigger=REQUIRE,
    ),
)

# ------------------------------------------------------------------ defect workarounds a case can switch off
# switch 'training': the case option `workarounds`, every one on by default; harness.models.training
# applies them (fully_reshardable_step through apply_workaround, process-wide)

_TRAINING = "harness.models.training"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"

SHIMS += (
    Shim(
        name="prime_adam",
        upstream=_DISTRIB_OPTIMIZER,
        why="megatron-core 0.19.2 DistributedOptimizer + plain torch Adam: loading into a never-stepped "
        "optimizer fails `assert len(steps) == 1`; the harness primes Adam state with values no load writes (step -0.5, NaN "
        "moments: what the load leaves alone shows as never loaded) and sets a step the load left unwritten to 0 to train on",
        probe="the load's AssertionError `assert len(steps) == 1` (shown by the strict xfail)",
        retire_when="when DistributedOptimizer loads into a torch Adam that holds no state yet",
        kind=HIDES, trigger=CALLER, switch="training", applied_in=_TRAINING,
        shown_by="matrices/smoke.yaml:defect-unprimed-adam",
    ),
    Shim(
        name="load_no_grad",
        upstream=_DISTRIB_OPTIMIZER,
        why="megatron-core 0.19.2 dp_reshardable load copies into views of leaf params that require grad "
        "('a view of a leaf Variable that requires grad is being used in an in-place operation'); "
        "the harness loads under torch.no_grad()",
        probe="the load's RuntimeError 'a view of a leaf Variable that requires grad' (shown by the strict xfail)",
        retire_when="when the dp_reshardable load copies under no_grad itself",
        kind=HIDES, trigger=CALLER, switch="training", applied_in=_TRAINING,
        shown_by="matrices/smoke.yaml:defect-inplace-view",
    ),
    Shim(
        name="fully_reshardable_step",
        upstream=_DISTRIB_OPTIMIZER,
        why="megatron-core 0.19.2 DistributedOptimizer._set_main_param_and_optimizer_states iterates the "
        "destination torch Adam state keys, 'step' included, but load_parameter_state_from_fully_reshardable "
        "leaves 'step' out of the source: KeyError 'step'; the harness passes step=None so the copy skips it",
        probe="the load's KeyError 'step'; the patch acts only where the loaded tensors carry no 'step'",
        retire_when="when load_parameter_state_from_fully_reshardable hands 'step' over (or the copy skips keys it lacks)",
        kind=HIDES, trigger=CALLER, switch="training", applied_in=_TRAINING,
        apply=lambda: apply_workaround("fully_reshardable_step"),  # process-wide (keep_own_step)
        shown_by="matrices/smoke.yaml:defect-keyerror-step",
    ),
    Shim(
        name="unshare_adam_step",
        upstream=_DISTRIB_OPTIMIZER,
        why="megatron-core 0.19.2 DistributedOptimizer.load_state_dict without Apex/TE puts ONE step tensor in "
        "every param's torch Adam state; Adam increments it once per param per step (3 -> 30 after one step with 27 "
        "params), corrupting bias correction after every resume; the harness gives each param its own copy",
        probe="after a load, params' Adam states share one step tensor (the step check; shown by the strict xfail)",
        retire_when="when DistributedOptimizer.load_state_dict gives each param its own step",
        kind=HIDES, trigger=CALLER, switch="training", applied_in=_TRAINING,
        shown_by="matrices/smoke.yaml:defect-shared-step",
    ),
    Shim(
        name="vpp_overlap_p2p",
        upstream="megatron.core.pipeline_parallel.p2p_communication",
        why="megatron-core 0.19.2 TransformerConfig defaults to batch_p2p_comm=True, overlap_p2p_comm=False "
        "and accepts them with the interleaved schedule at PP=2, where next and previous stage are the same rank: "
        "_batched_p2p_ops (pipeline_parallel/p2p_communication.py:27-49) posts send_prev and send_next to that rank in one "
        "batch_isend_irecv, sends and receives between two ranks match in posting order, so each stage receives the "
        "other's gradient as its activation and the reverse, silently (Megatron-LM asserts PP > 2 for this, "
        "training/arguments.py:972); the harness builds vpp models with Megatron-LM's and Megatron-Bridge's vpp setting, "
        "overlap_p2p_comm=True, batch_p2p_comm=False (harness.models.VPP_P2P)",
        probe="a vpp model at PP=2 built with TransformerConfig's p2p defaults trains on swapped activations "
        "(the losses check; shown by the strict xfail)",
        retire_when="when TransformerConfig refuses batched p2p with the interleaved schedule at PP=2 (or orders it right)",
        kind=HIDES, trigger=CALLER, switch="training", only_on="vpp", applied_in="harness.models.mcore",
        shown_by="matrices/smoke.yaml:defect-vpp-batched-p2p",
    ),
)


def _own_step(optimizer, model_param):
    """The destination's Adam step for `model_param` (None where the optimizer keeps none or lays state out otherwise)."""
    if getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return None  # that branch sets scaled states; 0.19 skips a non-tensor there
    try:
        group_index, group_order = optimizer.model_param_group_index_map[model_param]
        return optimizer.optimizer.state[optimizer.optimizer.param_groups[group_index]["params"][group_order]].get("step")
    except (AttributeError, KeyError, IndexError):
        return None


def apply_workaround(name: str) -> None:
    """The process-wide patch behind a workaround (the others act on one optimizer, harness.models.training)."""
    if name != "fully_reshardable_step":
        raise ValueError(f"workaround {name!r} is applied by harness.models.training, not patched process-wide")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if not getattr(original, "_ckpt_harness", False):
        DistributedOptimizer._set_main_param_and_optimizer_states = keep_own_step(original)


def keep_own_step(original):
    """`_set_main_param_and_optimizer_states` that, when the loaded tensors carry no 'step', copies the
    destination's own step onto itself (every release's loop accepts that: 0.19 also skips a
    non-tensor, 0.15 copies every destination key and fails on None)."""

    def skip_missing_step(self, model_param, tensors):
        if "step" not in tensors:
            tensors = {**tensors, "step": _own_step(self, model_param)}
        return original(self, model_param, tensors)

    skip_missing_step._ckpt_harness = True
    return skip_missing_step


# ------------------------------------------------------------------ APIs that moved between releases
# The harness drives megatron-core 0.15-0.19 with one code path: where an API it calls is newer than
# a release, the call detects the attribute and falls back to what that release offers, and the
# case records the fallback (it is the harness adapting, not the candidate failing).

OPTIMIZER_STATE_KEYS = "mcore: optimizer state keys read from the state (no DistributedOptimizer.optimizer_state_keys)"
PARAM_SYNC_STAGING = "mcore: no prepare_model_params_for_param_sync before a forced param sync"


def optimizer_state_keys(opt, state: dict | None = None) -> tuple[str, ...]:
    """The optimizer-state tensor keys of a DistributedOptimizer (('exp_avg', 'exp_avg_sq') for Adam):
    its own property where it has one, else the moments of a param's `state` (not 'param', not 'step')."""
    keys = getattr(opt, "optimizer_state_keys", None)
    if keys is not None:
        return tuple(keys)
    if state is None:
        raise AttributeError("optimizer has no optimizer_state_keys and no param state was given to read them from")
    note(OPTIMIZER_STATE_KEYS)
    return tuple(k for k in state if k not in ("param", "step"))


def prepare_param_sync(optimizer) -> None:
    """`optimizer.prepare_model_params_for_param_sync()` where the optimizer has it (Core 0.19+)."""
    prepare = getattr(optimizer, "prepare_model_params_for_param_sync", None)
    if prepare is None:
        note(PARAM_SYNC_STAGING)
        return
    prepare()


SHIMS += (
    Shim(
        name=OPTIMIZER_STATE_KEYS,
        upstream=_DISTRIB_OPTIMIZER,
        why="DistributedOptimizer.optimizer_state_keys arrived in megatron-core 0.19 (0.18.2's "
        "distrib_optimizer.py keeps Adam's exp_avg/exp_avg_sq with no such property); before it the keys are the "
        "moments the param's own state holds: not 'param', and not 'step' (0.18's per-param state carries it; 0.19's "
        "property leaves it out and the step has its own check)",
        probe="the optimizer has no optimizer_state_keys attribute",
        retire_when="when the oldest Core driven is 0.19",
        kind=ADAPTS, trigger=CALLER,
        apply=optimizer_state_keys,  # the call that falls back (and notes it) per optimizer
    ),
    Shim(
        name=PARAM_SYNC_STAGING,
        upstream="megatron.core.optimizer",
        why="MegatronOptimizer.prepare_model_params_for_param_sync arrived in megatron-core 0.19 (it stages "
        "MXFP8 params into the param buffer before Megatron-LM's force_param_sync); 0.18's force_param_sync is "
        "start_param_sync(force_sync=True) alone, so without the method there is nothing to stage",
        probe="the optimizer has no prepare_model_params_for_param_sync attribute",
        retire_when="when the oldest Core driven is 0.19",
        kind=ADAPTS, trigger=CALLER,
        apply=prepare_param_sync,  # the call that falls back (and notes it) per optimizer
    ),
)
