"""CUDA-on-CPU shims: what megatron-core calls on torch.cuda (or hard-codes as device='cuda')
that a CPU rank cannot run. `install` applies each whose probe finds the CUDA call failing (or
the CPU result differing) on this rank's device; on a CUDA rank every probe says not needed."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from harness.compat._shim import ADAPTS, CALLER, REQUIRE, Shim, fails, note

_ON_CUDA = "never on a rank with CUDA; on CPU, when megatron-core stops calling it (the probe then fails to fail)"


def _cuda_device_kw(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Maps device='cuda' (factories, .to()) to CPU; every torch call of a CPU rank comes here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _TO and len(args) > 1 and _cuda_device_kw(args[1]):
            args = (args[0], "cpu", *args[2:])
        if not kwargs:  # the common case returns after two tests
            return func(*args)
        if _cuda_device_kw(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


_TO = torch.Tensor.to
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


def _moe_split_sizes_stay_tensors(device: torch.device) -> bool:
    """megatron-core's own helper, asked for numpy split sizes of a tensor on this rank's device."""
    if device.type == "cuda":
        return False  # the CUDA branch converts; no need to import the MoE dispatcher to know it
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    out = token_dispatcher.maybe_move_tensor_to_cpu(torch.zeros(1, dtype=torch.long, device=device), as_numpy=True)
    return not isinstance(out, np.ndarray)


@contextmanager
def current_device_scope() -> Iterator[None]:
    """The `cuda.current_device` shim (below) for one block only: a model built under
    torch.device("meta") (the planner's), whose RotaryEmbedding still asks torch.cuda.current_device()
    for a device (megatron-core rotary_pos_embedding.py:78). A meta build needs no CUDA device
    whatever the machine has, so the block answers "cpu" without probing: a probe (current_device(),
    even is_available() on a CUDA build) registers torch's CUDA fork handler, and every process forked
    from this one afterwards fails its first CUDA query ("Cannot re-initialize CUDA in forked
    subprocess"): the planner runs in a user's CLI process or a pytest worker that forks rank worlds."""
    own = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # not `note`d: that marks the shim applied for every later fork of this process
    try:
        yield
    finally:
        torch.cuda.current_device = own


SHIMS: tuple[Shim, ...] = (
    Shim(
        name="cuda.current_device",
        upstream="torch.cuda",
        why="RotaryEmbedding, dist_checkpointing state_dict_saver and others call "
        "torch.cuda.current_device() as a device argument",
        probe="torch.cuda.current_device() raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=lambda: setattr(torch.cuda, "current_device", lambda: "cpu"),
        needed=lambda device: fails(torch.cuda.current_device),
    ),
    Shim(
        name="cuda.synchronize",
        upstream="torch.cuda",
        why="dist_checkpointing FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize()",
        probe="torch.cuda.synchronize() raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=lambda: setattr(torch.cuda, "synchronize", lambda *a, **k: None),
        needed=lambda device: fails(torch.cuda.synchronize),
    ),
    Shim(
        name="Tensor.cuda",
        upstream="torch.Tensor",
        why="LanguageModule.setup_embeddings_and_output_layer moves tied embeddings with .cuda() (PP>1)",
        probe="torch.zeros(1).cuda() raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=lambda: setattr(torch.Tensor, "cuda", lambda self, *a, **k: self),
        needed=lambda device: fails(lambda: torch.zeros(1).cuda()),
    ),
    Shim(
        name="device='cuda' -> cpu",
        upstream="torch",
        why="hard-coded device='cuda' tensors (state_dict_saver, pipeline schedules, optimizer "
        "grad-norm buffers) and pin_memory=True in rope utils",
        probe="torch.zeros(1, device='cuda') raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=_enter_cuda_to_cpu_mode,
        needed=lambda device: fails(lambda: torch.zeros(1, device="cuda")),
    ),
    Shim(
        name="Tensor.type() names CUDA types",
        upstream="torch.Tensor",
        why="DistributedOptimizer._build_model_and_main_param_groups, Float16OptimizerWithFloat16Params "
        "and clip_grads accept only 'torch.cuda.*Tensor' type strings",
        probe="a tensor on the rank's device has a type() string without '.cuda.'",
        retire_when="when megatron-core checks param.is_cuda / device instead of type strings (or accepts CPU types)",
        kind=ADAPTS,
        apply=lambda: setattr(torch.Tensor, "type", _cuda_named_type),
        needed=lambda device: ".cuda." not in torch.zeros(0, device=device).type(),
    ),
    Shim(
        name="cuda streams",
        upstream="torch.cuda",
        why="param_and_grad_buffer and DistributedDataParallel order grad reduction with "
        "torch.cuda.current_stream()/Stream/stream(); the MoE alltoall token dispatcher syncs on "
        "an event its side stream records",
        probe="torch.cuda.current_stream() raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=_patch_streams,
        needed=lambda device: fails(torch.cuda.current_stream),
    ),
    Shim(
        name="MoE alltoall split sizes as numpy",
        upstream="megatron.core.transformer.moe.token_dispatcher",
        why="MoEAlltoAllTokenDispatcher converts its all_to_all split sizes to numpy only for CUDA "
        "tensors (moe_utils.maybe_move_tensor_to_cpu); a CPU tensor reaches all_to_all_single, which rejects it",
        probe="maybe_move_tensor_to_cpu(as_numpy=True) returns no numpy array for a tensor on the rank's device",
        retire_when="when maybe_move_tensor_to_cpu(as_numpy=True) returns numpy for a CPU tensor too",
        kind=ADAPTS,
        apply=_patch_moe_split_sizes,
        needed=_moe_split_sizes_stay_tensors,
    ),
)


# ------------------------------------------------------------------ before megatron-core is imported

JIT_ARCH_LIST = "megatron-core import: TORCH_CUDA_ARCH_LIST set where no GPU is visible"
JIT_ARCH_LIST_REASON = (
    "megatron-core 0.15.x JIT-builds a CUDA unified-memory allocator when megatron.core is imported "
    "(inference/unified_memory.py, load_inline with_cuda=True) and catches only RuntimeError/ImportError/"
    "OSError; with no GPU visible torch's _get_cuda_arch_flags raises IndexError (an empty arch list), so "
    "`import megatron.core` fails on every CPU machine. With an arch list named the build fails the way it "
    "catches and the import goes on (measured: 0.15.3 imports, ~30 s slower). Needed only where no GPU is "
    "visible and the variable is unset; no longer needed when the oldest Core driven is 0.16 (it guards the build)")


def guard_megatron_import() -> bool:
    """Call before the first `import megatron.core` of a process: where no GPU is visible and
    TORCH_CUDA_ARCH_LIST is unset, name an arch list (see JIT_ARCH_LIST_REASON); children inherit
    it. Returns whether it applied (recorded for the case)."""
    import os

    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return False
    os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"
    note(JIT_ARCH_LIST)
    return True


SHIMS += (
    Shim(
        name=JIT_ARCH_LIST,
        upstream="megatron.core.inference.unified_memory",
        why=JIT_ARCH_LIST_REASON,
        probe="no GPU visible (torch.cuda.is_available() False) and TORCH_CUDA_ARCH_LIST unset: torch's "
        "_get_cuda_arch_flags would raise IndexError on the empty arch list",
        retire_when="when the oldest Core driven is 0.16 (it guards the build)",
        kind=ADAPTS,
        apply=guard_megatron_import,
        needed=lambda device: not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available(),
        trigger=CALLER,
    ),
)


# ------------------------------------------------------------------ Megatron-FSDP on a CPU rank (on demand)
# harness.backends.mcore_fsdp asks for these (`require`) when it wraps a model in megatron-core's
# FullyShardedDataParallel; nothing else in the harness builds Megatron-FSDP.

FSDP_DEVICE = "Megatron-FSDP: module placed on the rank's CPU device"
FSDP_GLOO_PREMUL_SUM = "Megatron-FSDP: gradient scaling before a SUM reduce (gloo has no PREMUL_SUM)"


def _fsdp_device_unparsable(device: torch.device) -> bool:
    """What the adapter and MegatronFSDP build as their default device: cuda:{current_device()}."""
    return fails(lambda: torch.device(f"cuda:{torch.cuda.current_device()}"))


def _place_fsdp_on_cpu() -> None:
    import functools

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    cls = mcore_fsdp_adapter.FullyShardedDataParallel
    original = cls.__init__
    if getattr(original, "_ckpt_harness", False):
        return

    @functools.wraps(original)
    def init(self, *args, device=None, **kwargs):
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # f"cuda:{...}" parses (MegatronFSDP compares against it, then warns)
        try:
            original(self, *args, device=torch.device("cpu") if device is None else device, **kwargs)
        finally:
            torch.cuda.current_device = current

    init._ckpt_harness = True
    cls.__init__ = init


class _NoDivFusion:
    """A DDP config read through, with gradient_reduce_div_fusion off (scale, then SUM)."""

    def __init__(self, config) -> None:
        self._config = config

    def __getattr__(self, name):
        return False if name == "gradient_reduce_div_fusion" else getattr(self._config, name)


def _scale_then_sum() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    original = param_and_grad_buffer.gradient_reduce_preprocessing
    if getattr(original, "_ckpt_harness", False):
        return

    def unfused(grad_data, scaling_factor, ddp_config):
        return original(grad_data, scaling_factor, _NoDivFusion(ddp_config))

    unfused._ckpt_harness = True
    param_and_grad_buffer.gradient_reduce_preprocessing = unfused


def _group_refuses(ask) -> bool:
    """Whether the process group Megatron-FSDP communicates over refuses what `ask(group)` asks of it: a
    world that is not gloo (NCCL) is asked itself (collective: every rank asks at the FSDP build); a
    gloo world, or none yet, through a private one-rank gloo group (gloo checks before it
    communicates: no collective, no peer needed)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() != "gloo":
        return fails(lambda: ask(dist.group.WORLD))
    return fails(lambda: ask(dist.ProcessGroupGloo(dist.HashStore(), 0, 1)))


def _premul_sum_refused(device: torch.device) -> bool:
    import torch.distributed as dist

    def ask(group):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist._make_nccl_premul_sum(1.0)
        group.allreduce([torch.zeros(1, device=device)], opts).wait()

    return _group_refuses(ask)


SHIMS += (
    Shim(
        name=FSDP_DEVICE,
        upstream="megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        why="megatron-core 0.19.2's FullyShardedDataParallel (mcore_fsdp_adapter.py:158) and MegatronFSDP (megatron_fsdp.py:232-234) "
        "build torch.device(f'cuda:{torch.cuda.current_device()}') as their default device, and Megatron-LM's get_model and "
        "Bridge's _ddp_wrap pass none; a CPU rank's current_device is 'cpu' ('cuda:cpu' does not parse): the adapter gets "
        "device=cpu, and while it is built current_device() answers 0 so the comparison parses (then only warns)",
        probe="torch.device(f'cuda:{torch.cuda.current_device()}') raises",
        retire_when=_ON_CUDA,
        kind=ADAPTS,
        apply=_place_fsdp_on_cpu,
        needed=_fsdp_device_unparsable,
        trigger=REQUIRE,
    ),
    Shim(
        name=FSDP_GLOO_PREMUL_SUM,
        upstream="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
        why="Megatron-FSDP's gradient_reduce_preprocessing (param_and_grad_buffer.py:4746) reduces with NCCL's PREMUL_SUM when "
        "gradient_reduce_div_fusion is on (the default); gloo refuses it ('Cannot use ReduceOp.PREMUL_SUM with Gloo'): the "
        "function's own other branch runs, grad.mul_(1/dp) then SUM (premul-sum multiplies each input the same way)",
        probe="the process group Megatron-FSDP reduces over refuses a PREMUL_SUM all_reduce",
        retire_when="on NCCL (its premul-sum all_reduce succeeds); on gloo when torch accepts PREMUL_SUM",
        kind=ADAPTS,
        apply=_scale_then_sum,
        needed=_premul_sum_refused,
        trigger=REQUIRE,
    ),
)


FSDP_GLOO_UNEVEN_ALL_GATHER = "Megatron-FSDP: uneven all_gather on gloo (padded to the largest shard)"


class _PaddedAllGather:
    """torch.distributed as Megatron-FSDP's uneven_dtensor module sees it: an all_gather of tensors of
    different sizes pads each to the largest and trims back (NCCL gathers uneven sizes itself)."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        import torch.distributed as dist

        if len({t.numel() for t in tensor_list} | {tensor.numel()}) == 1:
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(t.numel() for t in tensor_list)
        padded = [t.new_empty(n) for t in tensor_list]
        dist.all_gather(padded, torch.cat([tensor.reshape(-1), tensor.new_zeros(n - tensor.numel())]), group=group)
        for out, got in zip(tensor_list, padded):
            out.copy_(got[: out.numel()].view_as(out))
        return None


def _pad_uneven_all_gather() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    if not isinstance(uneven_dtensor.dist, _PaddedAllGather):
        uneven_dtensor.dist = _PaddedAllGather()


def _uneven_all_gather_refused(device: torch.device) -> bool:
    """Rank r gathers a tensor of r + 1 elements from every rank: NCCL serves it; gloo checks every
    output's size against the input's (asked of a one-rank group: an output of 2 for an input of 1)."""

    def ask(group):
        size, rank = group.size(), group.rank()
        outs = [torch.empty(i + 1 + (size == 1), device=device) for i in range(size)]
        group.allgather([outs], [torch.zeros(rank + 1, device=device)]).wait()

    return _group_refuses(ask)


SHIMS += (
    Shim(
        name=FSDP_GLOO_UNEVEN_ALL_GATHER,
        upstream="megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor",
        why="Megatron-FSDP's uneven_dtensor_to_full_tensor (uneven_dtensor.py:338, what the harness's FSDP views gather "
        "with) all_gathers each rank's shard as it is, of different sizes where the FSDP buffer splits a parameter "
        "unevenly; NCCL accepts that, gloo refuses ('invalid tensor size at index 1'): the module's all_gather pads "
        "to the largest shard and trims back",
        probe="the process group Megatron-FSDP gathers over refuses an all_gather of uneven sizes",
        retire_when="on NCCL; on gloo when ProcessGroupGloo::allgather accepts uneven sizes",
        kind=ADAPTS,
        apply=_pad_uneven_all_gather,
        needed=_uneven_all_gather_refused,
        trigger=REQUIRE,
    ),
)
