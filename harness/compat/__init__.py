"""Every runtime workaround for an upstream assumption or defect, in one place, each with its reason.

Two kinds:
  SHIMS        CUDA assumptions (and import defects) a CPU rank cannot run without; installed in
               every rank (`install`, the CUDA ones only on CPU), listed in each result.
  WORKAROUNDS  upstream defects a training case steps around only when its matrix entry lists the
               workaround (`apply_workaround`); an entry with one switched off shows the defect as
               a named strict xfail, so a workaround never hides what the harness must show.
The parent process (pytest/CLI) gets the noise filters and, for HF cases, the Bridge import shim
(`import_megatron_bridge`, via harness.run.preload), so that forked ranks inherit those imports; the
CUDA shims are installed only in ranks. Installed files are never edited: everything is a runtime patch.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Shim:
    name: str
    reason: str
    apply: Callable[[], None]
    cpu_only: bool = True
    #: applied only when code that needs it asks (`require`), not by `install`
    on_demand: bool = False


def _cuda_device_kw(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Maps device='cuda' (factories, .to()) to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _cuda_device_kw(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _cuda_device_kw(args[1]):
            args = (args[0], "cpu", *args[2:])
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


_mode: _CudaToCpu | None = None


def _enter_cuda_to_cpu_mode() -> None:
    global _mode
    if _mode is None:
        _mode = _CudaToCpu()
        _mode.__enter__()


_orig_type = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
    return _orig_type(self, dtype, non_blocking, **kwargs)


class _CpuEvent:
    """Stands in for torch.cuda.Event: CPU work is already done when it is recorded."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        # MoEAlltoAllTokenDispatcher keeps the returned event and calls .synchronize() on it
        return event if event is not None else _CpuEvent()


class _NoStreamContext:
    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_streams() -> None:
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.Stream = _CpuStream
    torch.cuda.stream = _NoStreamContext


def _patch_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_ckpt_harness", False):
        return

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what the CUDA branch returns: split sizes all_to_all_single accepts
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._ckpt_harness = True
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _cross_process_results_queue() -> None:
    """mcore_dist async_save: the write runs in a child that megatron-core's TemporalAsyncCaller
    forks; its results must come back to the rank, which the in-process queue.Queue cannot do.
    A fork-context Manager queue (megatron's own get_write_results_queue, with mp_mode fork:
    spawn would re-import __main__ in every rank)."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


#: The on-demand shim every async save asks for (`require`): mcore_dist with `async_save: mcore`
#: and verl_manager with `async_save` (verl's saves go through the same megatron-core writer).
ASYNC_RESULTS_QUEUE = "mcore_dist async_save: cross-process write-results queue"

SHIMS: tuple[Shim, ...] = (
    Shim(
        "cuda.current_device",
        "RotaryEmbedding, dist_checkpointing state_dict_saver and others call "
        "torch.cuda.current_device() as a device argument",
        lambda: setattr(torch.cuda, "current_device", lambda: "cpu"),
    ),
    Shim(
        "cuda.synchronize",
        "dist_checkpointing FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize()",
        lambda: setattr(torch.cuda, "synchronize", lambda *a, **k: None),
    ),
    Shim(
        "Tensor.cuda",
        "LanguageModule.setup_embeddings_and_output_layer moves tied embeddings with .cuda() (PP>1)",
        lambda: setattr(torch.Tensor, "cuda", lambda self, *a, **k: self),
    ),
    Shim(
        "device='cuda' -> cpu",
        "hard-coded device='cuda' tensors (state_dict_saver, pipeline schedules, optimizer "
        "grad-norm buffers) and pin_memory=True in rope utils",
        _enter_cuda_to_cpu_mode,
    ),
    Shim(
        "Tensor.type() names CUDA types",
        "DistributedOptimizer._build_model_and_main_param_groups, Float16OptimizerWithFloat16Params "
        "and clip_grads accept only 'torch.cuda.*Tensor' type strings",
        lambda: setattr(torch.Tensor, "type", _cuda_named_type),
    ),
    Shim(
        "cuda streams",
        "param_and_grad_buffer and DistributedDataParallel order grad reduction with "
        "torch.cuda.current_stream()/Stream/stream(); the MoE alltoall token dispatcher syncs on "
        "an event its side stream records",
        _patch_streams,
    ),
    Shim(
        "MoE alltoall split sizes as numpy",
        "MoEAlltoAllTokenDispatcher converts its all_to_all split sizes to numpy only for CUDA "
        "tensors (moe_utils.maybe_move_tensor_to_cpu); a CPU tensor reaches all_to_all_single, which rejects it",
        _patch_moe_split_sizes,
    ),
    Shim(
        "in-process write-results queue",
        "FileSystemWriterAsync's first save starts a spawn-mode multiprocessing Manager that "
        "re-imports __main__ (~5 s per rank); synchronous saves write from threads of the "
        "same process, so a queue.Queue serves",
        _patch_results_queue,
        cpu_only=False,
    ),
    # ---- mcore_dist save/load strategies (backend options; on demand: only a backend that asks gets it)
    Shim(
        ASYNC_RESULTS_QUEUE,
        "megatron-core's async save (TemporalAsyncCaller) writes in a forked child whose write results "
        "the in-process queue.Queue above cannot carry back ('results_queue should not be empty'): a "
        "fork-context multiprocessing Manager queue, started on the rank's first async save",
        _cross_process_results_queue,
        cpu_only=False,
        on_demand=True,
    ),
)

_installed: list[str] = []
_shims_applied = False

# ------------------------------------------------------------------ defect workarounds a case can switch off

WORKAROUNDS: dict[str, str] = {
    "prime_adam": "megatron-core 0.19.2 DistributedOptimizer + plain torch Adam: loading into a never-stepped "
    "optimizer fails `assert len(steps) == 1`; the harness primes Adam state (step 0, zero moments)",
    "load_no_grad": "megatron-core 0.19.2 dp_reshardable load copies into views of leaf params that require grad "
    "('a view of a leaf Variable that requires grad is being used in an in-place operation'); "
    "the harness loads under torch.no_grad()",
    "fully_reshardable_step": "megatron-core 0.19.2 DistributedOptimizer._set_main_param_and_optimizer_states iterates the "
    "destination torch Adam state keys, 'step' included, but load_parameter_state_from_fully_reshardable "
    "leaves 'step' out of the source: KeyError 'step'; the harness passes step=None so the copy skips it",
    "unshare_adam_step": "megatron-core 0.19.2 DistributedOptimizer.load_state_dict without Apex/TE puts ONE step tensor in "
    "every param's torch Adam state; Adam increments it once per param per step (3 -> 30 after one step with 27 "
    "params), corrupting bias correction after every resume; the harness gives each param its own copy",
    "vpp_overlap_p2p": "megatron-core 0.19.2 TransformerConfig defaults to batch_p2p_comm=True, overlap_p2p_comm=False "
    "and accepts them with the interleaved schedule at PP=2, where next and previous stage are the same rank: "
    "_batched_p2p_ops (pipeline_parallel/p2p_communication.py:27-49) posts send_prev and send_next to that rank in one "
    "batch_isend_irecv, sends and receives between two ranks match in posting order, so each stage receives the "
    "other's gradient as its activation and the reverse, silently (Megatron-LM asserts PP > 2 for this, "
    "training/arguments.py:972); the harness builds vpp models with Megatron-LM's and Megatron-Bridge's vpp setting, "
    "overlap_p2p_comm=True, batch_p2p_comm=False (harness.models.VPP_P2P)",
}
DEFAULT_WORKAROUNDS = tuple(WORKAROUNDS)


def apply_workaround(name: str) -> None:
    """The process-wide patch behind a workaround (the others act on one optimizer, harness.models.training)."""
    if name != "fully_reshardable_step":
        raise ValueError(f"workaround {name!r} is applied by harness.models.training, not patched process-wide")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_ckpt_harness", False):
        return

    def skip_missing_step(self, model_param, tensors):
        return original(self, model_param, {"step": None, **tensors})

    skip_missing_step._ckpt_harness = True
    DistributedOptimizer._set_main_param_and_optimizer_states = skip_missing_step


class _ErrorsOnly:
    def filter(self, record) -> bool:
        import logging

        return record.levelno >= logging.ERROR


def quiet_known_noise() -> None:
    """Rank output is for failures: silence warnings that fire on every save/load, unless
    CKPT_HARNESS_VERBOSE=1."""
    import logging
    import os
    import warnings

    if os.environ.get("CKPT_HARNESS_VERBOSE") == "1":
        return
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch\.distributed|torch\.jit|megatron|harness\.compat)")
    warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # fixtures are local; never reach for a hub
    for name in ("transformers", "megatron.bridge", "modelopt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # megatron-bridge 0.6.2 utils/import_utils.py sets its own logger to INFO and adds a handler at
    # import, so every import without TE prints FP8GlobalStateManager tracebacks; a filter on the
    # (pre-created) logger survives its setLevel.
    bridge_imports = logging.getLogger("megatron.bridge.utils.import_utils")
    if not any(isinstance(f, _ErrorsOnly) for f in bridge_imports.filters):
        bridge_imports.addFilter(_ErrorsOnly())


def install(device: torch.device) -> list[str]:
    """Apply the shims this rank needs; return their names (recorded in results)."""
    global _shims_applied
    if _shims_applied:
        return list(_installed)
    _shims_applied = True
    quiet_known_noise()
    on_cpu = device.type == "cpu"
    for shim in SHIMS:
        if (shim.cpu_only and not on_cpu) or shim.on_demand:
            continue
        shim.apply()
        _installed.append(shim.name)
    return list(_installed)


def installed() -> list[str]:
    return list(_installed)


def require(name: str) -> None:
    """Apply the on-demand shim `name` in this process (once); it is then listed with the others."""
    shim = next((s for s in SHIMS if s.name == name), None)
    if shim is None or not shim.on_demand:
        raise KeyError(f"no on-demand shim {name!r}")
    if name not in _installed:
        shim.apply()
        _note(name)


# ------------------------------------------------------------------ Megatron-Bridge without TE


def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _te_stub():
    """Just what megatron.bridge.peft.lora_layers touches at import and in isinstance checks:
    types nothing is an instance of. Nothing else resolves, so safe_import_from checks elsewhere
    still see TE as absent."""
    import types

    def dummy(name: str) -> type:
        return type(name, (), {"__module__": "transformer_engine.pytorch (ckpt-harness stub)"})

    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    for n in ("Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear", "Dropout", "BasicLinear"):
        setattr(ops, n, dummy(n))
    pt.Linear, pt.LayerNormLinear, pt.ops = dummy("Linear"), dummy("LayerNormLinear"), ops
    te.pytorch = pt
    return {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.pytorch.ops": ops}


class _TEStubFinder:
    """Serves the stub only to megatron.bridge.peft.lora_layers' own import statement; every
    other `import transformer_engine` (megatron-core's TE detection) still fails as it should."""

    importer = "megatron.bridge.peft.lora_layers"

    def __init__(self) -> None:
        self.modules = _te_stub()

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery
        import sys

        if name not in self.modules:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == self.importer:
                return importlib.machinery.ModuleSpec(name, self, is_package=name != "transformer_engine.pytorch.ops")
            frame = frame.f_back
        return None

    def create_module(self, spec):
        return self.modules[spec.name]

    def exec_module(self, module) -> None:
        pass


def import_megatron_bridge():
    """Import megatron.bridge where Transformer-Engine is absent (CPU, or a GPU install without TE).

    megatron-bridge 0.6.2 peft/lora_layers.py imports transformer_engine.pytorch unguarded: a
    stub answers that one import (and is dropped from sys.modules right after). Its peft HAVE_TE
    flags come out True without TE because megatron-core leaves placeholder TE classes (then LoRA
    fails with "isinstance() arg 2 must be a type"): forced False.
    """
    import sys

    if "megatron.bridge" in sys.modules or _te_importable():
        import megatron.bridge

        return megatron.bridge
    finder = _TEStubFinder()
    sys.meta_path.insert(0, finder)
    try:
        import megatron.bridge
        import megatron.bridge.peft.lora_layers  # noqa: F401  (the module that needs the stub)
    finally:
        sys.meta_path.remove(finder)
        for name in finder.modules:
            sys.modules.pop(name, None)
    import megatron.bridge.peft.module_matcher as matcher
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
    for flag in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        setattr(matcher, flag, False)
    _installed.extend(["transformer_engine stub for megatron.bridge.peft.lora_layers", "megatron.bridge peft HAVE_TE=False"])
    return megatron.bridge


# ------------------------------------------------------------------ verl 0.9.1 (backend verl_manager)
# Kept apart from the megatron-core entries above: the verl_manager backend applies its shims in
# its own ranks only (when its code needs them), and a verl workaround is switched by the backend's option
# `workarounds`, never by a training case's (whose defaults stay the four megatron-core ones).

VERL_WORKAROUNDS: dict[str, str] = {
    "verl_fresh_model_sd": "F1 verl 0.9.1 MegatronCheckpointManager.load_checkpoint hands dict(model_sharded_state_dict), "
    "a shallow copy, to load_dist_checkpointing, whose torch strategy replaces each ShardedTensor's .data in place, then "
    "reuses that dict for optimizer.sharded_state_dict: fully_reshardable cannot map Parameters to metadata "
    "(ValueError 'not in model_sharded_state_dict'); the harness rebuilds the model sharded state dict for the optimizer",
    "verl_async_calls_module": "F2 verl 0.9.1 async_save imports megatron.core.dist_checkpointing.strategies.base.async_calls, "
    "a module megatron-core 0.19.2 no longer has (ModuleNotFoundError); the harness registers one holding an AsyncCallsQueue",
    "verl_async_strategy_mcore": "F3 verl 0.9.1 save_dist_checkpointing passes no async_strategy and megatron-core 0.19.2 "
    "defaults it to 'nvrx', which needs nvidia-resiliency-ext (not a verl dependency); the harness defaults it to 'mcore'",
    "verl_async_one_at_a_time": "F5 verl 0.9.1 schedules its three async dist saves (model, optimizer, extra) at once, and "
    "megatron-core 0.19.2's FileSystemWriterAsync returns write results through ONE process-wide queue, taking the first "
    "(get_nowait) at finalize: a request can finalize with another tree's results, writing metadata for files it does not "
    "hold (a corrupt checkpoint, silent at save); the harness finalizes each async request before the next is scheduled",
    "mbridge_encoder_and_decoder": "F6 verl 0.9.1's vanilla bridge (vanilla_mbridge=True) builds the model with mbridge 0.15.1 "
    "(verl's own pin), whose get_model (mbridge/core/util.py:52,83) compares the model type with "
    "ModelType.encoder_and_decoder, a member megatron-core 0.19.2 no longer has: AttributeError before any layer is "
    "built; the harness gives megatron-core's ModelType that name (a value no model type equals)",
}
DEFAULT_VERL_WORKAROUNDS = tuple(VERL_WORKAROUNDS)
#: the verl workarounds that matter only on one path: async saves, the vanilla (mbridge) bridge
ASYNC_VERL_WORKAROUNDS = tuple(w for w in VERL_WORKAROUNDS if w.startswith("verl_async"))
VANILLA_VERL_WORKAROUNDS = ("mbridge_encoder_and_decoder",)

VERL_RNG_TRACKER = "verl: CPU RNG tracker holds a state"
MBRIDGE_TE_SPEC = "mbridge: TE layer spec from local modules"
VERL_SHIMS: dict[str, str] = {
    VERL_RNG_TRACKER: "C1 on CPU megatron's RNG tracker is the inference tracker (no states, set_states a "
    "no-op), and verl's load_rng_states raises a bare KeyError on an empty tracker state; the shim gives it one CPU generator "
    "state (seed + 2718 + tp rank, as model_parallel_cuda_manual_seed) and a set_states that keeps what it is given",
    MBRIDGE_TE_SPEC: "C2 mbridge builds megatron-core's Transformer-Engine layer spec and maps "
    "TE's parameter names (linear_qkv.layer_norm_weight); TE does not install on CPU, so its TESpecProvider is None: the "
    "shim makes it local modules with the input norm folded into the column-parallel linear under TE's names "
    "(harness.compat.te_spec.LocalTESpecProvider); applied only without TE",
}


def mbridge_te_spec() -> None:
    """C2 (where Transformer-Engine is absent): see VERL_SHIMS."""
    if _te_importable() or MBRIDGE_TE_SPEC in _installed:
        return
    from harness.compat.te_spec import install_te_spec_stand_in

    install_te_spec_stand_in()
    _note(MBRIDGE_TE_SPEC)


def verl_rng_tracker_state(seed: int) -> None:
    """C1 (CPU only): a tracker state verl can save and restore (see VERL_SHIMS)."""
    import types

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    if torch.cuda.is_available():
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    gen = torch.Generator().manual_seed(seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.states_ = {"model-parallel-rng": gen.get_state()}
    tracker.set_states = types.MethodType(CudaRNGStatesTracker.set_states, tracker)
    _note(VERL_RNG_TRACKER)


def apply_verl_workaround(name: str) -> None:
    """The process-wide patch behind a verl workaround (idempotent)."""
    import sys
    import types

    if name == "verl_fresh_model_sd":
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
    elif name == "verl_async_calls_module":
        import megatron.core.dist_checkpointing.strategies as strategies
        from megatron.core.dist_checkpointing.strategies.async_utils import (
            AsyncCallsQueue,
        )

        if "megatron.core.dist_checkpointing.strategies.base" not in sys.modules:
            base = types.ModuleType("megatron.core.dist_checkpointing.strategies.base")
            base.__doc__ = "registered by ckpt-harness (compat.VERL_WORKAROUNDS['verl_async_calls_module'])"
            base.async_calls = AsyncCallsQueue()
            sys.modules[base.__name__] = base
            strategies.base = base
    elif name == "verl_async_one_at_a_time":
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
    elif name == "verl_async_strategy_mcore":
        from megatron.core import dist_checkpointing

        original = dist_checkpointing.save
        if getattr(original, "_ckpt_harness", False):
            return

        def mcore_async_strategy(*args, **kwargs):
            kwargs.setdefault("async_strategy", "mcore")
            return original(*args, **kwargs)

        mcore_async_strategy._ckpt_harness = True
        dist_checkpointing.save = mcore_async_strategy
    elif name == "mbridge_encoder_and_decoder":
        from megatron.core.models.gpt.gpt_model import (
            ModelType,  # the enum mbridge imports
        )

        if not hasattr(ModelType, "encoder_and_decoder"):
            ModelType.encoder_and_decoder = object()
    else:
        raise ValueError(f"unknown verl workaround {name!r}; known: {sorted(VERL_WORKAROUNDS)}")


def _note(name: str) -> None:
    if name not in _installed:
        _installed.append(name)


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
