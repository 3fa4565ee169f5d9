"""Megatron-Bridge's own training checkpoints (issue 19): `megatron.bridge.training.checkpointing`
`save_checkpoint` / `load_checkpoint` over the live job, as Bridge's train loop calls them.

A client backend like verl_manager: it overrides `save_training` / `load_training` over the live
`TrainingJob` (model chunks, distributed optimizer, LR scheduler). Each call gets a `GlobalState`
whose `ConfigContainer` holds what Bridge's checkpointing reads: the model config (the job's own
TransformerConfig, what a recipe's provider builds), the optimizer and DDP configs, RNG and logger
configs, and the `CheckpointConfig` under test (`save`, `load`, `ckpt_format`, `fully_parallel_save`,
`load_optim`, `load_rng`, `finetune`, `dist_ckpt_optim_fully_reshardable` from the job's sharding).
A recipe's train/dataset/tokenizer configs are not read by checkpointing and stay unset. Before its
first load a rank initialises megatron-core's microbatch calculator (Bridge's initialize.py does:
`load_checkpoint` updates it), and the save's `TrainState` carries step, consumed samples
(step x GLOBAL_BATCH) and floating point operations (step x FLOPS_PER_STEP, the harness's count).

Layout, as Bridge writes it: `<dir>/iter_<N:07d>/` (the torch_dist checkpoint with model, optimizer,
scheduler and RNG, `run_config.yaml`, `train_state.pt`), `<dir>/latest_train_state.pt` and
`<dir>/latest_checkpointed_iteration.txt`.

CPU: the on-demand shims of harness.compat.bridge_training (torch.cuda.get_rng_state, an RNG
tracker with a state); `SystemExit` from Bridge's load (it sys.exit()s on some failures, exit code
0, which would make the rank vanish) becomes a RuntimeError naming it. A load that finds nothing
returns (0, 0) in Bridge with a warning only: here it is a FileNotFoundError (a resume that starts
from scratch must not pass).

Its checks (from what each save and load recorded): `train-state` (the iteration, step and
consumed samples a load restores are the ones its save wrote), `flops` (the FLOP count, exactly) and
`rng-state` (python, numpy, torch and megatron-tracker RNG states restored on every rank where TP and
PP are unchanged: Bridge restores the DP-rank-0 state of each (TP, PP) rank; at another TP/PP it
ignores them by design, and with `finetune` or `load_rng: false` it does not load them: the check
says which).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from harness.backends import Backend
from harness.backends._megatron_lm import TRACKER, iteration_dir
from harness.core.context import RankContext
from harness.run.events import record_event

FLOPS_PER_STEP = 1.5e9  # the harness's FLOP count per optimizer step (what the TrainState carries)


@dataclass(frozen=True)
class BridgeTrainingOptions:
    fully_parallel_save: bool = True  # CheckpointConfig's default
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    #: CheckpointConfig.load_main_params_from_ckpt (with load_optim false): bf16 main params from the loaded state dict
    load_main_params_from_ckpt: bool = False
    #: CheckpointConfig.async_save (async_strategy mcore): the save returns before the checkpoint is
    #: complete; Bridge's maybe_finalize_async_save completes it (Backend.finalize_saves)
    async_save: bool = False
    #: CheckpointConfig.use_persistent_ckpt_worker: Bridge's validation requires it with async_save (its
    #: default); false: megatron-core's per-save forked writer (what runs on a CPU rank, see unavailable)
    use_persistent_ckpt_worker: bool = True
    #: CheckpointConfig.dist_ckpt_strictness: how a load treats keys the job and the checkpoint disagree on
    dist_ckpt_strictness: Literal["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                                  "return_unexpected", "return_all", "ignore_all"] = "assume_ok_unexpected"


def _import_bridge() -> None:
    """The Bridge through the harness's import (the TE stand-in where Transformer-Engine is absent)
    before any `from megatron.bridge...`: a forked rank inherits the parent's import, a spawned one
    (NCCL's default) imports first here, and a plain import fails without TE (seen on the lent H200)."""
    from harness.compat.te import import_megatron_bridge

    import_megatron_bridge()


def _state_bytes(state: Any) -> bytes:
    """A tracker state's bytes: a generator state tensor, or (graph-safe tracker) a torch.Generator."""
    return (state.get_state() if isinstance(state, torch.Generator) else state).cpu().numpy().tobytes()


def _cuda() -> bool:
    """Whether this rank has a CUDA generator of its own (a CPU rank's torch.cuda.get_rng_state is a shim)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_digest() -> dict[str, str]:
    """A digest per RNG this rank holds (python, numpy, torch, CUDA where the rank has it, megatron's
    tracker), read without drawing."""
    import numpy as np
    from megatron.core import tensor_parallel

    def h(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()[:12]

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    out = {"python": h(repr(random.getstate()).encode()), "numpy": h(np.random.get_state()[1].tobytes()),
           "torch": h(torch.get_rng_state().numpy().tobytes()),
           "tracker": h(b"".join(k.encode() + _state_bytes(v) for k, v in sorted(tracker.items())))}
    if _cuda():
        out["cuda"] = h(torch.cuda.get_rng_state().numpy().tobytes())
    return out


def _decoy_state(state: Any, seed: int) -> Any:
    """A tracker state of the same kind as `state`, from `seed`: a CPU generator state (the CPU
    shim's), a CUDA generator state, or a graph-safe tracker's torch.Generator."""
    if isinstance(state, torch.Generator):
        g = state.clone_state()
        g.manual_seed(seed)
        return g
    cpu = torch.Generator().manual_seed(seed).get_state()
    if state.numel() == cpu.numel() or not _cuda():
        return cpu
    kept = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    decoy = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(kept)
    return decoy


class RngDecoy:
    """Every RNG a Bridge checkpoint carries (python, numpy, torch, CUDA, megatron's tracker), set to
    a decoy before a load, as the weights start from decoys: a load that restores nothing leaves the
    decoy, which differs from what the save wrote, so the rng-state check fails. The tracker's
    decoy is written to its storage directly (not through set_states: a defective set_states must
    not defeat the decoy). `before` is the digest right before the load. After the load has been
    recorded, `settle` puts back the job's own state of every generator the load left at its decoy
    (Bridge ignores RNG by design across a TP/PP change, with finetune or load_rng false: the job
    goes on as it would have)."""

    def __init__(self, seed: int) -> None:
        import numpy as np
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states()
        self._own = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                     "tracker": dict(states), **({"cuda": torch.cuda.get_rng_state()} if _cuda() else {})}
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # with CUDA, every device's generator too
        decoy = {k: _decoy_state(v, seed + 1 + i) for i, (k, v) in enumerate(sorted(states.items()))}
        if hasattr(tracker, "states_"):
            tracker.states_ = decoy
        else:
            tracker.set_states(decoy)
        self.before = rng_digest()

    def settle(self) -> None:
        import numpy as np
        from megatron.core import tensor_parallel

        now = rng_digest()
        left = {k for k, v in self.before.items() if now.get(k) == v}
        if "python" in left:
            random.setstate(self._own["python"])
        if "numpy" in left:
            np.random.set_state(self._own["numpy"])
        if "torch" in left:
            torch.set_rng_state(self._own["torch"])
        if "cuda" in left and "cuda" in self._own:
            torch.cuda.set_rng_state(self._own["cuda"])
        if "tracker" in left:
            tracker = tensor_parallel.get_cuda_rng_tracker()
            if hasattr(tracker, "states_"):
                tracker.states_ = dict(self._own["tracker"])
            else:
                tracker.set_states(dict(self._own["tracker"]))


def _place() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank()}


def _train_state(state: Any) -> dict[str, float]:
    ts = state.train_state
    return {k: float(getattr(ts, k)) for k in ("step", "consumed_train_samples", "floating_point_operations_so_far")}


class BridgeTraining(Backend):
    name = "bridge_training"
    capabilities = frozenset({"training_state", "finetune", "peft_training"})
    refusals = ("CheckpointingException",)  # Bridge loads through megatron-core's dist_checkpointing
    Options = BridgeTrainingOptions
    preload = ("megatron.bridge.training.checkpointing",)
    checks = ("train-state", "flops", "rng-state")  # harness.backends._bridge_state

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._context: dict = {}  # Bridge's checkpointing_context: strategies kept across a job's saves
        self._async: Any = None  # the GlobalState whose async calls queue holds this job's pending saves
        self._pending: list[Path] = []
        self._decoy: RngDecoy | None = None  # the RNG decoy of the load in flight (_load to _loaded)
        self._train_state_before: dict[str, float] = {}

    def configured(self, options: Any) -> "BridgeTraining":
        other = super().configured(options)
        other._context, other._async, other._pending, other._decoy, other._train_state_before = {}, None, [], None, {}
        return other

    def unavailable(self) -> str | None:
        o = self.options
        if o.async_save and o.use_persistent_ckpt_worker and not torch.cuda.is_available():
            return ("async_save with Bridge's persistent checkpoint worker: on a machine without CUDA megatron-core's "
                    "worker dies at start (dist_checkpointing/strategies/async_utils.py:565, torch.cuda.set_device(rank % "
                    "torch.cuda.device_count()): ZeroDivisionError) and schedule_async_call then blocks forever on the "
                    "preload queue (no liveness check, :416-423; tests/test_async.py shows it, a strict xfail); on CPU the "
                    "harness runs async_save with use_persistent_ckpt_worker: false, GPU machines run the worker")
        return None

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        if self.options.async_save and not getattr(case, "finalizes_saves", False):
            raise ValueError(f"backend option async_save: case {case.name} does not run an async save's finalize step "
                             "(the training cases reshard-optimizer and resume do)")

    def build_bridge_model(self, hf_dir: Path | str, spec: Any, topo: Any, *, load_weights: bool = True, ddp_config: Any = None,
                           adapter: Any = None) -> Any:
        """A LoRA job resumed as a Bridge recipe builds it: with adapters and no HF weights asked, the
        provider runs Bridge's own PEFT pre-wrap hook (training.setup._create_peft_pre_wrap_hook), which
        loads the base from `pretrained_checkpoint` (the HF directory) and applies the adapters; the
        hook sets `finetune`, which setup.py clears again before the resume load (setup.py:398-402)."""
        from harness.models import bridge as mb

        if adapter is None or load_weights:
            return super().build_bridge_model(hf_dir, spec, topo, load_weights=load_weights, ddp_config=ddp_config, adapter=adapter)

        def hook_for(provider: Any, peft: Any):
            _import_bridge()
            from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
            from megatron.bridge.training.setup import _create_peft_pre_wrap_hook
            from megatron.bridge.training.state import GlobalState

            state = GlobalState()
            state.cfg = ConfigContainer(model=provider, train=None, scheduler=None, dataset=None, tokenizer=None, logger=LoggerConfig(),
                                        optimizer=None, ddp=None, peft=peft,
                                        checkpoint=CheckpointConfig(ckpt_format="torch_dist", pretrained_checkpoint=str(hf_dir)))
            hook = _create_peft_pre_wrap_hook(state.cfg, state)

            def run(model: Any) -> Any:
                out = hook(model)
                state.cfg.checkpoint.finetune = False
                return out

            return run

        return mb.build(hf_dir, spec, topo, load_weights=False, adapter=adapter, ddp_config=ddp_config, peft_hook=hook_for)

    # ------------------------------------------------------------------ async saves

    @property
    def saves_async(self) -> bool:
        return self.options.async_save

    def checkpoint_complete(self, directory: Path) -> bool | None:
        """Bridge's rule: the tracker names an iteration whose dist checkpoint is finished
        (metadata.json and torch DCP's .metadata); finalize writes the tracker last."""
        if not (Path(directory) / TRACKER).is_file():
            return False
        it = iteration_dir(directory)
        return (it / "metadata.json").is_file() and (it / ".metadata").is_file()

    def pending_saves(self) -> int:
        return len(self._pending)

    def finalize_saves(self, ctx: RankContext) -> list[dict]:
        """Bridge's maybe_finalize_async_save(blocking=True), as its train loop calls it before the
        next save and at the end of training."""
        _import_bridge()
        from megatron.bridge.training.checkpointing import maybe_finalize_async_save

        pending, self._pending = self._pending, []
        if not pending:
            return []
        before = [self.checkpoint_complete(d) for d in pending]
        torch.distributed.barrier()  # nobody's finalize may write before every rank looked
        maybe_finalize_async_save(self._async, self._async.cfg.checkpoint, blocking=True)
        return [{"directory": str(d), "complete_before": b, "complete_after": self.checkpoint_complete(d)}
                for d, b in zip(pending, before)]

    # ------------------------------------------------------------------ Bridge's config

    def _prepare(self, job: Any) -> None:
        from megatron.core import num_microbatches_calculator as nmc
        from megatron.core import parallel_state as ps

        from harness.compat import require
        from harness.compat.bridge_training import CUDA_RNG_STATE, RNG_TRACKER_STATE
        from harness.compat.te import import_megatron_bridge
        from harness.models.training import GLOBAL_BATCH

        import_megatron_bridge()
        require(CUDA_RNG_STATE)
        require(RNG_TRACKER_STATE)
        nmc.destroy_num_microbatches_calculator()  # Bridge's initialize.py sets it up; load_checkpoint updates it
        nmc.init_num_microbatches_calculator(torch.distributed.get_rank(), None, GLOBAL_BATCH, 1,
                                             ps.get_data_parallel_world_size(), False)

    def _state(self, job: Any, **checkpoint: Any) -> Any:
        from megatron.bridge.training.config import (
            CheckpointConfig,
            ConfigContainer,
            DistributedDataParallelConfig,
            LoggerConfig,
            OptimizerConfig,
            RNGConfig,
        )
        from megatron.bridge.training.state import GlobalState

        distopt = job.sharding is not None
        model_cfg = job.chunks[0].config  # a Bridge-built job's: the provider itself
        peft = getattr(job.bridge, "peft", None)
        if peft is not None:  # a LoRA recipe: cfg.peft, the base as pretrained_checkpoint (adapter-only saves, PEFT resume)
            checkpoint.setdefault("pretrained_checkpoint", str(job.bridge.base_path))
        cfg = ConfigContainer(
            model=model_cfg, train=None, scheduler=None, dataset=None, tokenizer=None, logger=LoggerConfig(),
            optimizer=OptimizerConfig(optimizer="adam", use_distributed_optimizer=distopt, bf16=model_cfg.bf16, fp16=model_cfg.fp16),
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=distopt), rng=RNGConfig(seed=job.seed), peft=peft,
            checkpoint=CheckpointConfig(ckpt_format="torch_dist", fully_parallel_save=self.options.fully_parallel_save,
                                        dist_ckpt_strictness=self.options.dist_ckpt_strictness,
                                        async_save=self.options.async_save and checkpoint.get("save") is not None,
                                        async_strategy="mcore", use_persistent_ckpt_worker=self.options.use_persistent_ckpt_worker,
                                        dist_ckpt_optim_fully_reshardable=job.sharding == "fully_reshardable",
                                        distrib_optim_fully_reshardable_mem_efficient=bool(job.mem_efficient), **checkpoint),
        )
        state = GlobalState()
        state.cfg = cfg
        return state

    # ------------------------------------------------------------------ training state

    def save_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        _import_bridge()
        from megatron.bridge.training.checkpointing import save_checkpoint
        from megatron.bridge.training.state import TrainState

        from harness.models.training import GLOBAL_BATCH

        self._prepare(job)
        state = self._state(job, save=str(directory), load=None, save_optim=getattr(job, "save_optim", True))
        if self.options.async_save:  # one queue for the job's saves, as Bridge's GlobalState keeps it
            from harness.compat import require
            from harness.compat.mcore import ASYNC_RESULTS_QUEUE

            require(ASYNC_RESULTS_QUEUE)  # the writer is a forked child: its results need a cross-process queue
            if self._async is None:
                state.initialize_async_checkpoint_worker()
                self._async = state
            else:
                self._async.cfg = state.cfg
            state = self._async
            self._pending.append(Path(directory))
        flops = job.step * FLOPS_PER_STEP
        state.train_state = TrainState(step=job.step, consumed_train_samples=job.step * GLOBAL_BATCH,
                                       floating_point_operations_so_far=int(flops), do_train=True)
        save_checkpoint(state, job.chunks, job.optimizer, job.scheduler, flops, checkpointing_context=self._context)
        record_event({"op": "save", "iteration": job.step, "train_state": _train_state(state), "rng": rng_digest(), **_place()}, self.name)

    def _load(self, job: Any, directory: Path, **checkpoint: Any) -> tuple[int, float, Any]:
        """Bridge's load_checkpoint with this CheckpointConfig: (iteration, FLOPs, the GlobalState).
        Every RNG starts from a decoy (RngDecoy) and the train state from a fresh TrainState (step,
        samples and FLOPs 0, what a starting job holds); both are recorded, so a check can tell a
        restore from a state that already equalled the saved one."""
        _import_bridge()
        from megatron.bridge.training.checkpointing import load_checkpoint
        from megatron.bridge.training.state import TrainState

        from harness.core.truth import DECOY_SEED_OFFSET

        o = self.options
        self._prepare(job)
        state = self._state(job, save=None, load_optim=o.load_optim, load_rng=o.load_rng, finetune=o.finetune,
                            load_main_params_from_ckpt=o.load_main_params_from_ckpt, **checkpoint)
        state.train_state = TrainState()
        self._train_state_before = _train_state(state)
        self._decoy = RngDecoy(job.seed + DECOY_SEED_OFFSET + 1000 * torch.distributed.get_rank())
        try:
            iteration, flops = load_checkpoint(state, job.chunks, job.optimizer, job.scheduler, checkpointing_context=self._context)
        except SystemExit as exc:  # Bridge's load exits the process on some failures
            raise RuntimeError(f"megatron-bridge load_checkpoint called sys.exit({exc.code!r}) loading {directory}") from None
        return iteration, flops, state

    def _loaded(self, iteration: int, flops: float, state: Any, **more: Any) -> None:
        decoy, self._decoy = self._decoy, None
        record_event({"op": "load", "iteration": iteration, "flops": flops, "train_state": _train_state(state),
                      "train_state_before": self._train_state_before, "finetune": bool(state.cfg.checkpoint.finetune),
                      "rng": rng_digest(), "rng_before": decoy.before if decoy else {}, **_place(), **more}, self.name)
        if decoy is not None:
            decoy.settle()

    def load_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        """Bridge's resume from the checkpoint root `directory` (its tracker names the iteration); an
        `iter_NNNNNNN` directory is that iteration of its parent, named as a user names one
        (CheckpointConfig.ckpt_step): Bridge reads a bare iteration directory only when it holds a
        finished save's markers (utils/checkpoint_utils.py is_checkpoint_iteration_directory), else as
        a root without a tracker, and returns (0, 0)."""
        match = re.fullmatch(r"iter_(\d{7})", Path(directory).name)
        where = {"load": str(Path(directory).parent), "ckpt_step": int(match.group(1))} if match else {"load": str(directory)}
        iteration, flops, state = self._load(job, directory, **where)
        if iteration == 0 and not self.options.finetune:
            raise FileNotFoundError(f"megatron-bridge load_checkpoint found no checkpoint under {directory} and returned "
                                    "(0, 0): the job would train from scratch with only a warning")
        job.step = iteration
        self._loaded(iteration, flops, state)

    def load_pretrained(self, ctx: RankContext, job: Any, directory: Path, run_dir: Path) -> None:
        """A recipe's finetune start: `checkpoint.load` is the job's own (empty) directory and
        `checkpoint.pretrained_checkpoint` the given one; Bridge falls back to it and sets
        `finetune` (weights only, iteration 0; bf16 main params reloaded from the weights)."""
        iteration, flops, state = self._load(job, directory, load=str(run_dir), pretrained_checkpoint=str(directory))
        job.step = iteration
        self._loaded(iteration, flops, state, pretrained=str(directory))

    def strategy_check(self, events: dict[str, dict[str, list[dict]]]) -> list[Any]:
        """What every load restored against what its save wrote: checks train-state, flops, rng-state."""
        from harness.backends._bridge_state import state_check

        return state_check(self.options, events)

    # ------------------------------------------------------------------ the abstract format methods

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        raise NotImplementedError("bridge_training saves a live training job (save_training), not a bare model")

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        raise NotImplementedError("bridge_training loads a live training job (load_training), not a bare model")

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """The tensors of the iteration `latest_checkpointed_iteration.txt` names, unsharded."""
        from megatron.core import dist_checkpointing

        plain = dist_checkpointing.load_plain_tensors(str(iteration_dir(directory)))
        return {k: v for k, v in plain.items() if isinstance(v, torch.Tensor)}


BACKEND = BridgeTraining()
