"""Megatron-FSDP's `fsdp_dtensor` checkpoints: the defects the mcore_fsdp backend steps around
(records with switch 'fsdp'), each switched on by default and off by the backend option `workarounds`, so a
matrix entry without one shows the defect as a named strict xfail. The CUDA-on-CPU part (the FSDP
device, the TP RNG sync, gloo's missing PREMUL_SUM) is in harness.compat.cuda.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from harness.compat._shim import CALLER, HIDES, Shim

ADAM_STATE = "fsdp_adam_state"
SWIGLU_LOOKUP = "fsdp_swiglu_lookup"
LOAD_KEYS = "fsdp_load_keys"

def adapter_keys(model_state: dict) -> dict:
    """A FullyShardedDataParallel state dict keyed as the adapter's load_state_dict expects (see LOAD_KEYS)."""
    return {k.removeprefix("module."): v for k, v in model_state.items()}


def materialize_adam_state(optimizer: Any) -> int:
    """Collective over the world: give every param of every torch Adam(W) under `optimizer` that holds
    no state the state TE's FusedAdam would give it (zero exp_avg and exp_avg_sq shaped like the param,
    an empty local shard on this rank), with the job's step (the largest any rank holds, so the
    replicated 'step' each rank writes agrees); a stateless param already holding one gets the step
    refreshed (Adam never steps a param without a grad). Returns how many states it created."""
    import torch.distributed as dist

    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    steps = [float(st["step"]) for opt in inner for st in opt.state.values() if "step" in st]
    params = [p for opt in inner for group in opt.param_groups for p in group["params"]]
    step = torch.tensor([max(steps) if steps else 0.0], device=params[0].device if params else "cpu")  # NCCL reduces device tensors
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    step = step.cpu()  # torch Adam keeps its step on the CPU
    created = 0
    for opt in inner:
        ordered: dict = {}
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                if not state:
                    state = {"step": step[0].clone(), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                    created += 1
                elif _local_numel(p) == 0 and "step" in state:
                    state["step"] = step[0].clone()
                ordered[p] = state
        # in param order on every rank, as FusedAdam creates them: handle_swiglu_in_state_dict walks the
        # optimizer state in dict order and builds each fc1 half's DTensor with a collective
        opt.state = defaultdict(dict, ordered)
    return created


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


@contextmanager
def swiglu_lookup(model: Any) -> Iterator[None]:
    """While the state dict is preprocessed: `model.get_parameter(name)` answers the one parameter
    whose name is `name` or ends with it after dropping leading 'module.' segments (the FSDP
    adapter, MegatronFSDP and Float16Module each add one)."""
    params = dict(model.named_parameters())
    original = model.get_parameter

    def strip(name: str) -> str:
        while name.startswith("module."):
            name = name[len("module."):]
        return name

    by_tail: dict[str, list[str]] = {}
    for name in params:
        by_tail.setdefault(strip(name), []).append(name)

    def get_parameter(target: str):
        if target in params:
            return params[target]
        found = by_tail.get(strip(target), [])
        if len(found) != 1:
            return original(target)  # upstream's own error, naming the path it could not resolve
        return params[found[0]]

    model.get_parameter = get_parameter
    try:
        yield
    finally:
        del model.get_parameter


_OPTIONS = dict(kind=HIDES, trigger=CALLER, switch="fsdp")
SHIMS: tuple[Shim, ...] = (
    Shim(
        name=ADAM_STATE,
        upstream="megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor",
        why="megatron-core 0.19.2 without Transformer-Engine or Apex steps Megatron-FSDP with torch.optim.AdamW "
        "(optimizer/__init__.py:29-35), which keeps state only for params it saw a grad for; Megatron-FSDP gives a "
        "param whose shard on this rank is empty no grad (param_and_grad_buffer.py:3393), and the loading side's "
        "_init_optimizer_states_with_dummy_values skips it (distrib_optimizer.py:1432), so the ranks' optimizer state "
        "dicts hold different keys and the per-DTensor all_gather_object of preprocess_state_dict_for_uneven_dtensor "
        "(uneven_dtensor.py:51, called by Bridge's preprocess_fsdp_dtensor_state_dict and Megatron-LM's) pairs "
        "unrelated tensors across ranks and deadlocks (TE's FusedAdam initialises state for every param before it "
        "looks at the grad); the harness gives every stateless param the state TE's FusedAdam would (zero moments, "
        "the job's step), in param order on every rank as FusedAdam creates it (handle_swiglu_in_state_dict builds "
        "one DTensor per fc1 half with a collective, walking the state in dict order), before each save and load",
        probe="a param of the torch Adam(W) Megatron-FSDP steps holds no optimizer state on some rank (its shard "
        "is empty); the defect: the save's per-DTensor all_gather_object deadlocks (shown by the strict xfail)",
        retire_when="when the torch-Adam path initialises state for every param (or the preprocessing gathers by key)",
        apply=materialize_adam_state,
        shown_by="matrices/extended.yaml:defect-fsdp-adam-state",
        **_OPTIONS,
    ),
    Shim(
        name=SWIGLU_LOOKUP,
        upstream="megatron.core.transformer.fsdp_dtensor_checkpoint",
        why="megatron-core 0.19.2 handle_swiglu_in_state_dict (transformer/fsdp_dtensor_checkpoint.py:343 and 375-377) "
        "looks each fc1 param up on the model it is given (Bridge and Megatron-LM pass model[0], the "
        "FullyShardedDataParallel adapter) by 'module.' + its state-dict key, and an optimizer key with one 'module.' "
        "cut off; the adapter's parameters are named module.module.<key> (adapter > MegatronFSDP > GPTModel), one "
        "more with Float16Module: the optimizer lookup fails in fp32 ('MegatronFSDP has no attribute decoder') and "
        "both fail in bf16 ('Float16Module has no attribute decoder'), so no SwiGLU model saves or loads; the harness "
        "resolves the name to the one parameter whose name ends the same way",
        probe="the defect's AttributeError ('MegatronFSDP has no attribute decoder'); the patch answers only "
        "names get_parameter cannot resolve, with the one parameter whose name ends the same way",
        retire_when="when handle_swiglu_in_state_dict resolves fc1 params on the adapter by their real names",
        apply=swiglu_lookup,
        shown_by="matrices/extended.yaml:defect-fsdp-swiglu-optimizer",
        **_OPTIONS,
    ),
    Shim(
        name=LOAD_KEYS,
        upstream="megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        why="megatron-core 0.19.2 FullyShardedDataParallel.load_state_dict "
        "(distributed/fsdp/mcore_fsdp_adapter.py:245-261) puts 'module.' before every key, but its state_dict (what "
        "Bridge and Megatron-LM save under `model`) already carries MegatronFSDP's 'module.': a strict load misses "
        "every key. The adapter itself loads gated-linear-unit (SwiGLU) and fp8 models non-strict, Megatron-LM's "
        "load_model_state_dict retries non-strict, but Bridge 0.6.2's _load_model_state_dict "
        "(training/checkpointing.py:2581-2588) retries non-strict and then reads `.missing_keys` of the None the "
        "adapter returns: AttributeError, so every Bridge fsdp_dtensor load of a non-gated model fails; the harness "
        "hands the adapter the state dict's keys without their first 'module.', and the strict load matches",
        probe="a strict load misses every key (the adapter's load_state_dict prefixes keys its state_dict already "
        "carries); shown by the strict xfail",
        retire_when="when FullyShardedDataParallel.load_state_dict takes the keys its state_dict writes",
        apply=adapter_keys,
        shown_by="matrices/extended.yaml:defect-fsdp-load-keys",
        **_OPTIONS,
    ),
)
