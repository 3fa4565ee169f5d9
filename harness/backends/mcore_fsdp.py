"""Megatron-FSDP's `fsdp_dtensor` checkpoints (torch DCP over DTensors), saved and loaded the way
Megatron-Bridge does with `CheckpointConfig(ckpt_format="fsdp_dtensor")` (training/checkpointing.py
save_checkpoint / load_checkpoint; Megatron-LM's `--ckpt-format fsdp_dtensor` is the same path):

  save  Bridge's generate_state_dict over the FSDP chunks (`model`: the adapter's DTensor state dict;
        `optimizer`: DistributedOptimizer.sharded_state_dict with Bridge's metadata, sharding type
        `fsdp_dtensor`; the scheduler, the iteration, the RNG states as Bridge's get_rng_state builds
        them for fsdp_dtensor), then Bridge's save_fsdp_dtensor_checkpoint (preprocess_fsdp_dtensor_state_dict:
        megatron-core's handle_fp8_extra_state_case, handle_swiglu_in_state_dict, handle_experts_in_state_dict,
        preprocess_state_dict_for_uneven_dtensor; then torch.distributed.checkpoint.save)
  load  the same generate_state_dict with is_loading (the optimizer's dummy-initialised state), `_model`,
        Bridge's load_fsdp_dtensor_checkpoint (the same preprocessing, DCP load_state_dict in place,
        partial loads allowed unless option `strict`: CheckpointConfig.strict_fsdp_dtensor_load), then
        Bridge's _load_model_state_dict (the adapter's load_state_dict: Megatron-FSDP installs the
        loaded main weights) and the optimizer's and scheduler's load_state_dict

The model is built by this backend's builder (harness.models.fsdp.MegatronFsdp: the GPT-zoo model in
megatron-core's FullyShardedDataParallel, through Bridge's own `_ddp_wrap`), so reshard-weights,
reshard-optimizer and resume run unchanged and judge it with their usual checks.

Layout: a weights save (reshard-weights) writes the DCP checkpoint into the directory; a training
save writes it into `<dir>/iter_NNNNNNN/` and then Megatron-LM's tracker `latest_checkpointed_iteration.txt`
(which Bridge's loader reads too). `load_fsdp_dtensor` below is the public entry point that loads
such a checkpoint into a job built elsewhere.

Options:
  sharding_strategy  Megatron-FSDP's data_parallel_sharding_strategy (default optim_grads_params)
  strict             Bridge's strict_fsdp_dtensor_load (default false, as in Bridge and Megatron-LM: a
                     key the job asks for that the checkpoint lacks keeps its current value, logged only)
  workarounds        the harness.compat.fsdp workarounds to apply (default all; an entry without one
                     shows its defect as a named strict xfail)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.backends._megatron_lm import iteration_dir, restore_scheduler, write_tracker
from harness.compat import registry
from harness.compat.fsdp import ADAM_STATE, LOAD_KEYS, SWIGLU_LOOKUP, adapter_keys
from harness.core.context import RankContext
from harness.core.result import CheckStop
from harness.run.events import record_event


@dataclass(frozen=True)
class McoreFsdpOptions:
    sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "optim_grads_params"
    strict: bool = False
    workarounds: tuple[str, ...] = registry.defaults("fsdp")

    def __post_init__(self) -> None:
        registry.check("fsdp", self.workarounds, "workaround(s)")


def _bridge() -> Any:
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.training import checkpointing

    return checkpointing


def checkpoint_config(strict: bool = False, save_optim: bool = True, save_rng: bool = True) -> Any:
    """Bridge's CheckpointConfig for an fsdp_dtensor save or load."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.training.config import CheckpointConfig

    return CheckpointConfig(ckpt_format="fsdp_dtensor", save_optim=save_optim, save_rng=save_rng, load_rng=False,
                            strict_fsdp_dtensor_load=strict)


def _fsdp_chunks(model: Any) -> Any:
    from harness.models.fsdp import FsdpChunks

    if not isinstance(model, FsdpChunks):
        raise TypeError(f"mcore_fsdp saves and loads Megatron-FSDP models (harness.models.fsdp, this backend's builder), "
                        f"got {type(model).__name__}")
    if len(model) != 1:
        raise ValueError(f"mcore_fsdp: one model chunk (pp 1), got {len(model)}")
    return model


def _optimizer_metadata(ckpt: Any, with_group: bool) -> dict:
    """Bridge's _build_sharded_state_dict_metadata (sharding type fsdp_dtensor), plus the DP x CP group on a save."""
    from megatron.core import parallel_state

    meta = _bridge()._build_sharded_state_dict_metadata(True, ckpt)
    if with_group:
        meta["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return meta


def _dtensors(tree: Any, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    """(key, ranks of its device mesh) of every DTensor of a state dict, in dict order."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return [kv for k, v in tree.items() if k != "_model" for kv in _dtensors(v, f"{prefix}{k}.")]
    if isinstance(tree, DTensor):
        return [(prefix[:-1], tuple(tree.device_mesh.mesh.flatten().tolist()))]
    return []


#: the check check_same_dtensors fails (harness.core.result.CheckStop) before the save would deadlock
DTENSORS_AGREE = "fsdp-dtensors-agree"


def check_same_dtensors(state: dict) -> None:
    """Collective: stop the case on a failed `fsdp-dtensors-agree` check unless every two ranks that share a device mesh hold the same
    DTensors of it in the same order. Megatron-FSDP's preprocessing runs one collective per DTensor
    (preprocess_state_dict_for_uneven_dtensor's all_gather_object over the sorted keys,
    handle_swiglu_in_state_dict's per fc1 half in dict order): otherwise it pairs unrelated tensors
    across ranks and deadlocks or computes wrong offsets; this says so before it starts."""
    mine = _dtensors(state)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    me = dist.get_rank()
    for peer, theirs in enumerate(gathered):
        a = [k for k, ranks in mine if peer in ranks]
        b = [k for k, ranks in theirs if me in ranks]
        if peer != me and a != b:
            only_peer, only_me = sorted(set(b) - set(a)), sorted(set(a) - set(b))
            how = f"only rank {peer} has {only_peer[:3]}, only rank {me} has {only_me[:3]}" if only_peer or only_me else "in another order"
            raise CheckStop(
                DTENSORS_AGREE, f"the ranks' fsdp_dtensor state dicts differ: rank {me} holds {len(a)} DTensors it shares with rank {peer}, "
                f"rank {peer} {len(b)}; {how}. Megatron-FSDP's preprocessing runs one collective per DTensor and would pair "
                "unrelated tensors across the ranks (a deadlock or wrong offsets)")


def _preprocessing(model: Any, workarounds: tuple[str, ...]):
    from harness.compat.fsdp import swiglu_lookup

    return swiglu_lookup(model[0]) if SWIGLU_LOOKUP in workarounds else nullcontext()


def _adam_state(optimizer: Any, workarounds: tuple[str, ...]) -> int:
    if optimizer is None or ADAM_STATE not in workarounds:
        return 0
    from harness.compat.fsdp import materialize_adam_state

    return materialize_adam_state(optimizer)


def load_fsdp_dtensor(model: Any, optimizer: Any, directory: Path, *, scheduler: Any = None, strict: bool = False,
                      workarounds: tuple[str, ...] = registry.defaults("fsdp")) -> dict:
    """Collective: load the fsdp_dtensor checkpoint at `directory` into a built Megatron-FSDP job, as
    Megatron-Bridge's load_checkpoint does. `model`: harness.models.fsdp.FsdpChunks (one chunk, built by
    MegatronFsdp.build_model / build_training at this world's topology); `optimizer`: its megatron
    optimizer, or None to load the weights alone; `scheduler`: an OptimizerParamScheduler or None.
    Returns the loaded state dict (raw model and optimizer sections, `opt_param_scheduler`, `iteration`).

    `directory`: a torch DCP checkpoint (`.metadata` + `__<rank>_0.distcp`), or a root whose
    `latest_checkpointed_iteration.txt` names `iter_NNNNNNN/` holding one. Keys it reads:
      model.module.<module path>            every model parameter as one DTensor, full over DP and TP
                                            (`model.module.decoder.layers.0.self_attention.linear_qkv.weight`);
                                            SwiGLU fc1 as `<...>.linear_fc1.weight_w` and `_v` (the two
                                            halves of every TP rank's rows); experts by global index
                                            (`...mlp.experts.local_experts.<global>.linear_fc1.weight`)
      optimizer.state.module.module.<path>.<exp_avg|exp_avg_sq|step>   Adam state per parameter
                                            (the same fc1 split and expert numbering)
      optimizer.param_to_group_meta.module.module.<path>.<lr|weight_decay|...>  param-group settings
      opt_param_scheduler.*, iteration, checkpoint_version, rng_state.(<pp>, <tp>).<dp>.*
    With `strict` False (Bridge's default) a key the job asks for that the checkpoint lacks keeps
    its current value; True raises (torch DCP's CheckpointException)."""
    model = _fsdp_chunks(model)
    it = iteration_dir(Path(directory))
    bridge = _bridge()
    ckpt = checkpoint_config(strict=strict, save_optim=optimizer is not None, save_rng=False)  # Bridge's load_rng=False: no RNG template
    _adam_state(optimizer, workarounds)  # before the optimizer builds its load-side state dict
    kwargs = {} if optimizer is None else {"optim_sd_kwargs": {"metadata": _optimizer_metadata(ckpt, False), "is_loading": True}}
    state = bridge.generate_state_dict(ckpt, list(model), optimizer, scheduler, None, iteration=1, **kwargs)
    state["_model"] = list(model)
    check_same_dtensors(state)
    with _preprocessing(model, workarounds):
        loaded, _, _, _ = bridge.load_fsdp_dtensor_checkpoint(str(it), ckpt, rank0=False, sharded_state_dict=state, iteration=None,
                                                              checkpoint_path_override=str(it))
    bridge._load_model_state_dict(model[0], adapter_keys(loaded["model"]) if LOAD_KEYS in workarounds else loaded["model"], True)
    if optimizer is not None:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    return loaded


class McoreFsdp(Backend):
    name = "mcore_fsdp"
    capabilities = frozenset({"weights", "training_state", "read_plain"})
    Options = McoreFsdpOptions
    refusals = ("CheckpointException",)  # torch DCP's, raised by a strict load of a checkpoint that lacks a key
    preload = ("megatron.bridge.training.checkpointing",)
    checks = (DTENSORS_AGREE,)  # failed by check_same_dtensors, which stops the case before a save deadlocks

    @property
    def o(self) -> McoreFsdpOptions:
        return self.options if isinstance(self.options, McoreFsdpOptions) else McoreFsdpOptions()

    def builder(self) -> Any:
        from harness.models.fsdp import MegatronFsdp

        return MegatronFsdp(self.o.sharding_strategy)

    def notes(self) -> list[str]:
        return [f"workaround applied: {w}: {registry.get(w).why}" for w in self.o.workarounds]

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        for topo in (source, target):
            if topo.pp > 1:
                raise ValueError(f"{topo.id}: pp > 1: an fsdp_dtensor checkpoint names parameters by module path, which "
                                 "repeats on every pipeline stage; this backend runs pp 1 (TP, DP, EP and ETP change freely)")
        if case.name == "reshard-weights" and getattr(opts, "dtype", "fp32") == "bf16":
            raise ValueError("dtype bf16 with reshard-weights: an fsdp_dtensor checkpoint holds a bf16 model's fp32 main weights "
                             "(the FSDP adapter's state_dict is Megatron-FSDP's main-weight DTensors), so the bf16 bytes "
                             "checkpoint-canonical asks for are not what the format stores; run bf16 through reshard-optimizer "
                             "or resume (weights-match-main-params compares the bf16 compute weights with them)")
        if getattr(opts, "load_with", ""):
            raise ValueError(f"load_with {opts.load_with!r}: the job is a Megatron-FSDP job (this backend's builder), "
                             "which another backend's load does not know how to fill")
        if not getattr(opts, "use_distributed_optimizer", True):
            raise ValueError("use_distributed_optimizer: false: Megatron-FSDP always steps megatron-core's distributed "
                             "optimizer (Bridge's _validate_and_apply_megatron_fsdp_configs turns it on)")
        if getattr(opts, "sharding", "dp_reshardable") != "dp_reshardable" or getattr(opts, "mem_efficient", False):
            raise ValueError("options sharding and mem_efficient choose the torch_dist optimizer format; an fsdp_dtensor "
                             "checkpoint's optimizer sharding is always 'fsdp_dtensor' (Bridge's _build_sharded_state_dict_metadata)")

    # ------------------------------------------------------------------ weights (reshard-weights)

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        model = _fsdp_chunks(model)
        ckpt = checkpoint_config(save_optim=False, save_rng=False)
        self._write(ctx, _bridge().generate_state_dict(ckpt, list(model), None, None, None, iteration=0), model, directory)

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        load_fsdp_dtensor(model, None, directory, strict=self.o.strict, workarounds=self.o.workarounds)
        record_event({"op": "load", "directory": str(directory), "strict": self.o.strict}, self.name)

    # ------------------------------------------------------------------ training checkpoints

    def save_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        from harness.compat import require
        from harness.compat.bridge_training import CUDA_RNG_STATE

        model = _fsdp_chunks(job.chunks)
        bridge = _bridge()
        ckpt = checkpoint_config()
        created = _adam_state(job.optimizer, self.o.workarounds)
        require(CUDA_RNG_STATE)  # Bridge's get_rng_state reads torch.cuda.get_rng_state() unconditionally
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        rng = bridge.get_rng_state(False, "fsdp_dtensor", pg_collection=pgc)
        meta = _optimizer_metadata(ckpt, True)
        state = bridge.generate_state_dict(ckpt, list(model), job.optimizer, job.scheduler, rng, iteration=job.step,
                                           optim_sd_kwargs={"metadata": meta}, model_sd_kwargs={"metadata": meta}, pg_collection=pgc)
        self._write(ctx, state, model, Path(directory) / f"iter_{job.step:07d}")
        if ctx.is_rank0:
            write_tracker(Path(directory), job.step)
        dist.barrier()
        record_event({"op": "save", "directory": str(directory), "adam_states_created": created}, self.name)

    def load_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        loaded = load_fsdp_dtensor(job.chunks, job.optimizer, directory, scheduler=job.scheduler, strict=self.o.strict,
                                   workarounds=self.o.workarounds)
        restore_scheduler(job, loaded)
        record_event({"op": "load", "directory": str(directory), "strict": self.o.strict}, self.name)

    def _write(self, ctx: RankContext, state: dict, model: Any, directory: Path) -> None:
        """Bridge's save_fsdp_dtensor_checkpoint (rank 0 creates the directory first, as Bridge's save does)."""
        if ctx.is_rank0:
            directory.mkdir(parents=True, exist_ok=False)
        dist.barrier()
        check_same_dtensors(state)
        with _preprocessing(model, self.o.workarounds):
            _bridge().save_fsdp_dtensor_checkpoint(str(directory), state, cfg=None, model=model[0])

    def checkpoint_complete(self, directory: Path) -> bool | None:
        return (iteration_dir(Path(directory)) / ".metadata").is_file()

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, model tensors under megatron's torch_dist keys
        (harness.backends._fsdp_keys), the rest under their own DCP keys."""
        from harness.backends._fsdp_keys import megatron_keys, read_checkpoint

        entries = {k: v for k, v in read_checkpoint(iteration_dir(Path(directory))).items() if isinstance(v, torch.Tensor)}
        model = {k: v for k, v in entries.items() if k.startswith("model.")}
        return {**megatron_keys(model), **{k: v for k, v in entries.items() if not k.startswith("model.")}}


BACKEND = McoreFsdp()
