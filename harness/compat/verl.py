"""verl 0.9.1 (backend verl_manager): its defects (records with switch 'verl': the backend's option
`workarounds`, never a training case's), its CPU shims (C1-C3: applied in the backend's own ranks
when its code needs them and the probe finds the condition), and its log filter. mbridge's TE-spec
stand-in lives beside this module (harness.compat.te_spec)."""

from __future__ import annotations

import torch

from harness.compat._shim import ADAPTS, CALLER, HIDES, Shim, applied, note
from harness.compat.te import te_importable
from harness.compat.verl_platform import CPU_PLATFORM, platform_missing, use_cpu_platform

#: the module verl's async save imports its AsyncCallsQueue from
ASYNC_CALLS_MODULE = "megatron.core.dist_checkpointing.strategies.base"

VERL_RNG_TRACKER = "verl: CPU RNG tracker holds a state"
MBRIDGE_TE_SPEC = "mbridge: TE layer spec from local modules"


def mbridge_te_spec() -> None:
    """C2 (where megatron-core has no TE spec provider): see SHIMS."""
    if applied(MBRIDGE_TE_SPEC):
        note(MBRIDGE_TE_SPEC)
        return
    import megatron.core.models.gpt.gpt_layer_specs as specs

    if te_importable() or getattr(specs, "TESpecProvider", None) is not None:
        return
    from harness.compat.te_spec import install_te_spec_stand_in

    install_te_spec_stand_in()
    note(MBRIDGE_TE_SPEC)


def rng_tracker_needs_state() -> bool:
    """C1's probe: megatron's RNG tracker is the inference tracker (what a CPU rank gets instead of
    model_parallel_cuda_manual_seed), whose set_states keeps nothing, or holds no state at all."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return bool(getattr(tracker, "is_inference_rng_tracker", False)) or not tracker.get_states()


def verl_rng_tracker_state(seed: int) -> None:
    """C1 (an inference or empty tracker): a tracker state verl can save and restore (see SHIMS)."""
    import types

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    if not rng_tracker_needs_state():
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    gen = torch.Generator().manual_seed(seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.states_ = {"model-parallel-rng": gen.get_state()}
    tracker.set_states = types.MethodType(CudaRNGStatesTracker.set_states, tracker)
    note(VERL_RNG_TRACKER)


def _async_calls_module_missing() -> bool:
    import importlib

    try:
        importlib.import_module(ASYNC_CALLS_MODULE)
    except ModuleNotFoundError:
        return True
    return False


def _fresh_model_sd() -> None:
    from verl.utils.checkpoint.megatron_checkpoint_manager import (
        MegatronCheckpointManager as M,
    )

    original = M._build_optimizer_state_dict
    if getattr(original, "_ckpt_harness", False):
        return

    def fresh_model_sd(self, model_sharded_state_dict, metadata, is_loading=False):
        if is_loading:  # the load already consumed model_sharded_state_dict's ShardedTensors
            model_sharded_state_dict = self._build_model_sharded_state_dict(metadata)
        return original(self, model_sharded_state_dict, metadata, is_loading=is_loading)

    fresh_model_sd._ckpt_harness = True
    M._build_optimizer_state_dict = fresh_model_sd


def _async_calls_module() -> None:
    import sys
    import types

    if _async_calls_module_missing():
        import megatron.core.dist_checkpointing.strategies as strategies
        from megatron.core.dist_checkpointing.strategies.async_utils import (
            AsyncCallsQueue,
        )

        base = types.ModuleType(ASYNC_CALLS_MODULE)
        base.__doc__ = "registered by ckpt-harness (harness.compat.verl, workaround 'verl_async_calls_module')"
        base.async_calls = AsyncCallsQueue()
        sys.modules[base.__name__] = base
        strategies.base = base


def _one_at_a_time() -> None:
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncCallsQueue,
    )

    original = AsyncCallsQueue.schedule_async_request
    if getattr(original, "_ckpt_harness", False):
        return

    def one_at_a_time(self, async_request):
        idx = original(self, async_request)
        self.maybe_finalize_async_calls(blocking=True)  # its writes and finalize done before the next starts
        return idx

    one_at_a_time._ckpt_harness = True
    AsyncCallsQueue.schedule_async_request = one_at_a_time


def _mcore_async_strategy() -> None:
    from megatron.core import dist_checkpointing

    original = dist_checkpointing.save
    if getattr(original, "_ckpt_harness", False):
        return

    def mcore_async_strategy(*args, **kwargs):
        kwargs.setdefault("async_strategy", "mcore")
        return original(*args, **kwargs)

    mcore_async_strategy._ckpt_harness = True
    dist_checkpointing.save = mcore_async_strategy


def _encoder_and_decoder() -> None:
    from megatron.core.models.gpt.gpt_model import (
        ModelType,  # the enum mbridge imports
    )

    if not hasattr(ModelType, "encoder_and_decoder"):
        ModelType.encoder_and_decoder = object()


def apply_verl_workaround(name: str) -> None:
    """The process-wide patch behind a verl workaround (idempotent; each applies only where its
    defect's condition is detected: a missing module or enum member, an unpatched function)."""
    shim = next((s for s in SHIMS if s.name == name and s.switch == "verl"), None)
    if shim is None:
        raise ValueError(f"unknown verl workaround {name!r}; known: {sorted(s.name for s in SHIMS if s.switch == 'verl')}")
    shim.apply()


def quiet_verl_noise() -> None:
    """verl's import warns about optional engines (torchtitan, veomni, nemo_automodel) and the
    missing accelerator, its manager logs every save at INFO: silenced unless CKPT_HARNESS_VERBOSE=1."""
    import logging
    import os
    import warnings

    if os.environ.get("CKPT_HARNESS_VERBOSE") == "1":
        return
    warnings.filterwarnings("ignore", category=UserWarning, module=r"verl(\.|$)")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
    logging.getLogger("verl").setLevel(logging.ERROR)


_VERL_CKPT = "verl.utils.checkpoint.megatron_checkpoint_manager"
_ASYNC = dict(kind=HIDES, trigger=CALLER, switch="verl", only_on="async_save")
SHIMS: tuple[Shim, ...] = (
    # ---- defects (switch 'verl', each on by default; an entry without one shows it as its strict xfail)
    Shim(
        name="verl_fresh_model_sd",
        upstream=_VERL_CKPT,
        why="F1 verl 0.9.1 MegatronCheckpointManager.load_checkpoint hands dict(model_sharded_state_dict), "
        "a shallow copy, to load_dist_checkpointing, whose torch strategy replaces each ShardedTensor's .data in place, then "
        "reuses that dict for optimizer.sharded_state_dict: fully_reshardable cannot map Parameters to metadata "
        "(ValueError 'not in model_sharded_state_dict'); the harness rebuilds the model sharded state dict for the optimizer",
        probe="the load's ValueError 'not in model_sharded_state_dict'; the patch wraps "
        "MegatronCheckpointManager._build_optimizer_state_dict once (a wrapped one is left alone)",
        retire_when="when load_checkpoint builds the optimizer's state dict from a model sharded state dict the load did not consume",
        kind=HIDES, trigger=CALLER, switch="verl",
        apply=_fresh_model_sd,
        shown_by="matrices/smoke.yaml:verl-F1",
    ),
    Shim(
        name="verl_async_calls_module",
        upstream=ASYNC_CALLS_MODULE,
        why="F2 verl 0.9.1 async_save imports megatron.core.dist_checkpointing.strategies.base.async_calls, "
        "a module megatron-core 0.19.2 no longer has (ModuleNotFoundError); the harness registers one holding an AsyncCallsQueue",
        probe=f"importing {ASYNC_CALLS_MODULE} raises ModuleNotFoundError",
        retire_when="when verl imports AsyncCallsQueue from where megatron-core keeps it (or megatron-core keeps the module)",
        apply=_async_calls_module,
        shown_by="matrices/verl.yaml:verl-F2",
        **_ASYNC,
    ),
    Shim(
        name="verl_async_strategy_mcore",
        upstream="megatron.core.dist_checkpointing",
        why="F3 verl 0.9.1 save_dist_checkpointing passes no async_strategy and megatron-core 0.19.2 "
        "defaults it to 'nvrx', which needs nvidia-resiliency-ext (not a verl dependency); the harness defaults it to 'mcore'",
        probe="the async save's error 'A compatible `nvidia-resiliency-ext` installation is required'; the patch "
        "wraps dist_checkpointing.save once, setting async_strategy only where the caller passes none",
        retire_when="when verl passes an async_strategy (or megatron-core's default needs no extra package)",
        apply=_mcore_async_strategy,
        shown_by="matrices/verl.yaml:verl-F3",
        **_ASYNC,
    ),
    Shim(
        name="verl_async_one_at_a_time",
        upstream="megatron.core.dist_checkpointing.strategies.async_utils",
        why="F5 verl 0.9.1 schedules its three async dist saves (model, optimizer, extra) at once, and "
        "megatron-core 0.19.2's FileSystemWriterAsync returns write results through ONE process-wide queue, taking the first "
        "(get_nowait) at finalize: a request can finalize with another tree's results, writing metadata for files it does not "
        "hold (a corrupt checkpoint, silent at save); the harness finalizes each async request before the next is scheduled",
        probe="a resume of concurrent async saves fails reading the checkpoint (timing-dependent; made deterministic "
        "by tests/doubles.py VerlAsyncModelTreeWritesLast)",
        retire_when="when the writer's results are per request (or verl schedules one request at a time)",
        apply=_one_at_a_time,
        shown_by="tests/test_verl_manager.py::test_f5_concurrent_async_saves_take_each_others_write_results",
        **_ASYNC,
    ),
    Shim(
        name="mbridge_encoder_and_decoder",
        upstream="megatron.core.models.gpt.gpt_model",
        why="F6 verl 0.9.1's vanilla bridge (vanilla_mbridge=True) builds the model with mbridge 0.15.1 "
        "(verl's own pin), whose get_model (mbridge/core/util.py:52,83) compares the model type with "
        "ModelType.encoder_and_decoder, a member megatron-core 0.19.2 no longer has: AttributeError before any layer is "
        "built; the harness gives megatron-core's ModelType that name (a value no model type equals)",
        probe="megatron-core's ModelType has no member encoder_and_decoder",
        retire_when="when mbridge stops reading ModelType.encoder_and_decoder",
        kind=HIDES, trigger=CALLER, switch="verl", only_on="vanilla",
        apply=_encoder_and_decoder,
        shown_by="matrices/verl.yaml:verl-F6",
    ),
    # ---- CPU shims (C1-C3)
    Shim(
        name=VERL_RNG_TRACKER,
        upstream="megatron.core.tensor_parallel.random",
        why="C1 on CPU megatron's RNG tracker is the inference tracker (no states, set_states a "
        "no-op), and verl's load_rng_states raises a bare KeyError on an empty tracker state; the shim gives it one CPU generator "
        "state (seed + 2718 + tp rank, as model_parallel_cuda_manual_seed) and a set_states that keeps what it is given",
        probe="megatron's RNG tracker is the inference tracker, or holds no state (rng_tracker_needs_state)",
        retire_when="when the CPU path seeds a real tracker (model_parallel_cuda_manual_seed, i.e. with CUDA)",
        kind=ADAPTS, trigger=CALLER,
        apply=verl_rng_tracker_state,
        needed=lambda device: rng_tracker_needs_state(),
    ),
    Shim(
        name=MBRIDGE_TE_SPEC,
        upstream="megatron.core.models.gpt.gpt_layer_specs",
        why="C2 mbridge (and verl's model merger, through init_mcore_model) builds megatron-core's Transformer-Engine layer spec and maps "
        "TE's parameter names (linear_qkv.layer_norm_weight); TE does not install on CPU, so its TESpecProvider is None: the "
        "shim makes it local modules with the input norm folded into the column-parallel linear under TE's names "
        "(harness.compat.te_spec.LocalTESpecProvider)",
        probe="transformer_engine is not importable and gpt_layer_specs.TESpecProvider is None",
        retire_when="where TE is installed (TESpecProvider is set), or when mbridge builds a local spec without TE",
        kind=ADAPTS, trigger=CALLER,
        apply=mbridge_te_spec,
        needed=lambda device: _no_te_spec_provider(),
    ),
    Shim(
        name=CPU_PLATFORM,
        upstream="verl.plugin.platform",
        why="C3 verl 0.9.1 registers CUDA, NPU and ROCm platforms and falls back to 'nvidia' without one "
        "(platform_manager.py _detect_platform_name): on CPU its model merger inits an NCCL group and calls "
        "torch.cuda.set_device (megatron_model_merger.py:152-158); the shim registers a CPU platform (gloo, torch.cpu) "
        "through verl's own PlatformRegistry and set_platform (harness.compat.verl_platform)",
        probe="no CUDA, and verl's detected platform says it is not available",
        retire_when="where CUDA is present, or when verl ships a CPU platform its detection picks",
        kind=ADAPTS, trigger=CALLER,
        apply=use_cpu_platform,
        needed=lambda device: platform_missing(),
    ),
)


def _no_te_spec_provider() -> bool:
    import megatron.core.models.gpt.gpt_layer_specs as specs

    return not te_importable() and getattr(specs, "TESpecProvider", None) is None
