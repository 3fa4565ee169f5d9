"""megatron-core dist_checkpointing, `torch_dist` format (what verl and Megatron-LM save).

Saves and loads any sharded state dict (model weights, or model + optimizer for training
checkpoints, or adapters only); a model is a chunk list (harness.models: one chunk, or one per
virtual pipeline stage under `model0`, `model1`, ... as Megatron-LM lays them out). Loads are
strict (RAISE_ALL, unless option `strict` says otherwise): a key the state expects but the
checkpoint lacks, or the reverse, is an error, never a silently kept initial value.

Options (matrix `backend_options` or axes `backend.<option>`), each wired as Megatron-LM's
megatron/training/checkpointing.py wires it (save_checkpoint / _load_global_dist_base_checkpoint):

  save_strategy   default: `dist_checkpointing.save` with its own TorchDistSaveShardedStrategy;
                  fully_parallel: FullyParallelSaveStrategyWrapper over the DP group with CP
                  (Megatron-LM's default, `--ckpt-fully-parallel-save`; verl's
                  save_dist_checkpointing): each replicated shard is written by one rank of the
                  group, chosen by a metadata exchange (its memory phase: `distribute`)
  load_strategy   default, or fully_parallel: FullyParallelLoadStrategyWrapper over the same group
                  (`--ckpt-fully-parallel-load`, exchange algo `broadcast`, Megatron-LM's default):
                  each rank reads part of what the group needs and the ranks exchange the tensors
                  (its memory phase: `exchange`)
  exchange_algo   broadcast (Megatron-LM's default), gather_rounds or gather_object: how a
                  fully-parallel load exchanges the tensors (`--ckpt-fully-parallel-load-exchange-algo`;
                  Megatron-LM warns the other two "cannot guarantee numerical stability yet")
  async_save      none; mcore: `save(..., async_sharded_save=True, async_strategy="mcore")`
                  returns an AsyncRequest that an AsyncCallsQueue runs in a forked writer while
                  the job goes on; the checkpoint is complete only after `finalize_saves` (torch
                  DCP's `.metadata`, megatron-core's `metadata.json`), which the next save or the
                  end of the job calls, as Megatron-LM's maybe_finalize_async_save does;
                  nvrx: the same through nvidia-resiliency-ext (not-run where it is not installed)
  cache_metadata  Megatron-LM's `--ckpt-assume-constant-structure`: the save strategy caches its
                  plans and global metadata (`use_cached_ckpt_structure`), the fully-parallel
                  wrapper its distribution (`do_cache_distribution`), saves after the first skip
                  `validate_access_integrity`, and the load strategy caches the checkpoint
                  metadata (`TorchDistLoadShardedStrategy(cache_metadata=True)`); only repeated
                  saves in one job use the cache, so the case must save more than once
  content_metadata  true (Megatron-LM since Core 0.13): a training save passes the job's sharded_state_dict
                  metadata (`_build_sharded_state_dict_metadata`: the distributed optimizer's sharding type,
                  ...) as `save(content_metadata=)`, and a load builds the model's and optimizer's sharded
                  state dicts from what `load_content_metadata` reads back, as Megatron-LM's load does;
                  false: written as before Core 0.13 (no content metadata), and read with the job's own
  strict          the string Megatron-LM passes (`--dist-ckpt-strictness`). raise_all (the harness's: a key
                  the job asks for that the checkpoint lacks, or the reverse, is an error); assume_ok_unexpected
                  (Megatron-LM's default, Bridge's `dist_ckpt_strictness`), log_all: what users load with (a
                  Bridge checkpoint's RNG keys, an old checkpoint into a job with new params); return_all: the
                  load also returns the missing and unexpected keys, recorded in the load's event

  load_template   how a client builds the training load's sharded state (the template the load fills):
                  megatron-lm (default): `sharded_state_dict(..., is_loading=True, metadata=<the
                  checkpoint's content metadata>)`, as Megatron-LM and AReaL after #1468 do;
                  no-is-loading: `is_loading=False` (AReaL before #1468: its template of the
                  distributed optimizer's state is not the one the load writes back); no-metadata:
                  `metadata=None`, the client passes nothing and gets the installed Core's default
                  sharding type whatever the checkpoint was written with (verl #5154)

  verify_integrity  Megatron-LM's `verify_integrity`: the save writes a SHA-256 manifest of every file
                  (`save(verify_integrity=True)`, integrity.json) and the load re-hashes the files against it
                  first (`load(verify_integrity=True)`), refusing a changed or missing one

  layout          plain (the dist checkpoint is the directory, as verl writes it); megatron-lm: a
                  training save writes Megatron-LM's layout (harness.backends._megatron_lm: `iter_NNNNNNN/`
                  with `args`, `iteration` and the scheduler in the common state, then the tracker file;
                  with async_save the tracker is the request's last finalize function, as Megatron-LM's)

A training load given a Megatron-LM / Megatron-Bridge checkpoint root (the tracker file naming
`iter_NNNNNNN/`) reads that iteration, as Megatron-LM's `--load` does, and restores the scheduler
state it carries (`opt_param_scheduler`).

Strategy objects live as long as the backend instance (one per rank function: harness.models.training
gets it once per job), as Megatron-LM keeps them in its checkpointing_context.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.backends._mcore_events import TOLERATING, manifest_problems, returned_keys, tracked_exchange
from harness.backends._megatron_lm import common_state, iteration_dir, restore_scheduler, write_tracker
from harness.core.context import RankContext
from harness.core.result import missing_api
from harness.run.events import record_event

NVRX_MODULE = "nvidia_resiliency_ext"


def async_save_kwargs(save: Any, writer: str) -> dict[str, Any]:
    """What `dist_checkpointing.save` takes to pick the async writer: `async_strategy=` from Core
    0.17 on; before it megatron-core's own writer was the only one (another is a missing API)."""
    if "async_strategy" in inspect.signature(save).parameters:
        return {"async_strategy": writer}
    if writer != "mcore":
        raise missing_api("megatron.core.dist_checkpointing", f"save(async_strategy={writer!r})")  # only its own writer
    return {}


@dataclass(frozen=True)
class McoreDistOptions:
    save_strategy: Literal["default", "fully_parallel"] = "default"
    load_strategy: Literal["default", "fully_parallel"] = "default"
    exchange_algo: Literal["broadcast", "gather_rounds", "gather_object"] = "broadcast"
    async_save: Literal["none", "mcore", "nvrx"] = "none"
    cache_metadata: bool = False
    content_metadata: bool = True
    strict: Literal["raise_all", "assume_ok_unexpected", "log_all", "return_all"] = "raise_all"
    layout: Literal["plain", "megatron-lm"] = "plain"
    load_template: Literal["megatron-lm", "no-is-loading", "no-metadata"] = "megatron-lm"
    verify_integrity: bool = False


def is_complete(directory: Path) -> bool:
    """megatron-core's rule for a finished torch_dist checkpoint: its `metadata.json` is readable
    (written by the save's finalize step, after every rank's shards), and torch DCP's `.metadata`
    (the coordinator's global plan, also written at finalize) is there."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    return bool(check_is_distributed_checkpoint(str(directory))) and (Path(directory) / ".metadata").is_file()


def _dp_cp_group():
    """The group Megatron-LM's fully-parallel save and load distribute over: DP with CP."""
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


class McoreDist(Backend):
    name = "mcore_dist"
    capabilities = frozenset({"weights", "training_state", "read_plain"})
    refusals = ("CheckpointingException",)  # megatron.core.dist_checkpointing.core
    Options = McoreDistOptions

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._reset()

    def configured(self, options: Any) -> "McoreDist":
        other = super().configured(options)
        other._reset()  # strategies, caches and pending saves belong to one configured instance
        return other

    def _reset(self) -> None:
        self._save_strategy: Any = None
        self._load_strategy: Any = None
        self._saves = 0
        self._calls: Any = None  # AsyncCallsQueue
        self._pending: list[Path] = []

    @property
    def strategy(self) -> McoreDistOptions:
        """The strategy options (a subclass with Options of its own, a test double, gets the defaults)."""
        return self.options if isinstance(self.options, McoreDistOptions) else McoreDistOptions()

    # ------------------------------------------------------------------ contract

    def unavailable(self) -> str | None:
        if self.strategy.async_save == "nvrx" and importlib.util.find_spec(NVRX_MODULE) is None:
            return (f"async_save 'nvrx' needs nvidia-resiliency-ext, which is not installed (no module "
                    f"{NVRX_MODULE!r}); megatron-core's own async strategy is async_save 'mcore'")
        return None

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        o = self.strategy
        if o.save_strategy == "fully_parallel" and source.dp * source.cp == 1:
            raise ValueError(f"backend option save_strategy 'fully_parallel' distributes the save over the DP x CP group, "
                             f"which has one rank at source {source.id}: it would run the default save; use a source with dp > 1")
        if o.exchange_algo != "broadcast" and o.load_strategy != "fully_parallel":
            raise ValueError(f"backend option exchange_algo {o.exchange_algo!r} is how a fully-parallel load exchanges "
                             "tensors: it needs load_strategy 'fully_parallel'")
        if o.load_strategy == "fully_parallel" and target.dp * target.cp == 1:
            raise ValueError(f"backend option load_strategy 'fully_parallel' distributes the load over the DP x CP group, "
                             f"which has one rank at target {target.id}: it would run the default load; use a target with dp > 1")
        if o.async_save != "none" and not getattr(case, "finalizes_saves", False):
            raise ValueError(f"backend option async_save {o.async_save!r}: case {case.name} does not run an async save's "
                             "finalize step (the training cases reshard-optimizer and resume do)")
        if o.cache_metadata and getattr(opts, "saves", 1) < 2:
            raise ValueError("backend option cache_metadata caches what a previous save of the same job computed: it only "
                             f"means something when the job saves more than once (case {case.name}"
                             f"{' with saves: 2' if hasattr(opts, 'saves') else ' saves once'})")

    # ------------------------------------------------------------------ strategies

    def _save_strategy_obj(self):
        """None (dist_checkpointing.save builds its default) unless an option asks for more; built
        once and reused, as Megatron-LM keeps it in checkpointing_context['save_strategy']."""
        o = self.strategy
        if o.save_strategy == "default" and not o.cache_metadata:
            return None
        if self._save_strategy is None:
            from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                FullyParallelSaveStrategyWrapper,
            )
            from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

            from harness.core.memory import track

            # Megatron-LM's own factory (0.15's TorchDistSaveShardedStrategy has no default backend/version)
            strategy = get_default_save_sharded_strategy()
            if o.cache_metadata:
                strategy.use_cached_ckpt_structure = True
                strategy.thread_count = 1  # Megatron-LM: no per-rank parallel save for a sync save
            if o.save_strategy == "fully_parallel":

                class Tracked(FullyParallelSaveStrategyWrapper):
                    """megatron-core's wrapper, its distribution step recorded as memory phase `distribute`."""

                    last = ""

                    def apply_saving_parallelization(self, sharded_state_dict):
                        cached = self.do_cache_distribution and self.cached_distribution is not None
                        self.last = "cached" if cached else "computed"
                        with track("distribute"):
                            return super().apply_saving_parallelization(sharded_state_dict)

                strategy = Tracked(strategy, _dp_cp_group(), o.cache_metadata)
            self._save_strategy = strategy
        return self._save_strategy

    def _load_strategy_obj(self):
        o = self.strategy
        if o.load_strategy == "default" and not o.cache_metadata:
            return None
        if self._load_strategy is None:
            from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                FullyParallelLoadStrategyWrapper,
            )
            from megatron.core.dist_checkpointing.strategies.torch import (
                TorchDistLoadShardedStrategy,
            )

            if "cache_metadata" in inspect.signature(TorchDistLoadShardedStrategy).parameters:
                strategy = TorchDistLoadShardedStrategy(cache_metadata=o.cache_metadata)
            elif o.cache_metadata:  # the release has no load-side metadata cache: a hole, not the release's fault
                raise missing_api("megatron.core.dist_checkpointing.strategies.torch",
                                  "TorchDistLoadShardedStrategy(cache_metadata=)")
            else:
                strategy = TorchDistLoadShardedStrategy()
            if o.load_strategy == "fully_parallel":
                strategy = FullyParallelLoadStrategyWrapper(strategy, _dp_cp_group(), exchange_algo=o.exchange_algo)
            self._load_strategy = strategy
        return self._load_strategy

    # ------------------------------------------------------------------ save / load

    def save_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        """Megatron-LM's training save: the job's sharded state with its metadata, and that metadata
        as the checkpoint's content metadata (option content_metadata)."""
        from harness.models.training import GLOBAL_BATCH

        meta = job.content_metadata() if self.strategy.content_metadata else None
        state, root = job.sharded_state(is_loading=False), directory
        if self.strategy.layout != "megatron-lm":
            self.save_state(ctx, state, directory, content_metadata=meta)
            return
        directory = root / f"iter_{job.step:07d}"
        state.update(common_state(job, self.strategy.save_strategy == "fully_parallel", job.step * GLOBAL_BATCH))
        # Megatron-LM writes the tracker last: after every rank's sync save, or as the async request's last
        # finalize function (checkpointing.py iter_finalize_fn), so it never names an unfinished iteration
        step = job.step
        self.save_state(ctx, state, directory, content_metadata=meta, then=lambda: write_tracker(root, step) if ctx.is_rank0 else None)

    def load_training(self, ctx: RankContext, job: Any, directory: Path) -> None:
        """Megatron-LM's training load: the sharded state built from the checkpoint's content metadata
        (the job's own where the checkpoint has none), recorded for the strategy check."""
        from megatron.core import dist_checkpointing

        directory = iteration_dir(directory)
        found = dist_checkpointing.load_content_metadata(checkpoint_dir=str(directory))
        record_event({"op": "content_metadata", "read": found, "job": job.content_metadata()}, self.name)
        how = self.strategy.load_template
        template = job.sharded_state(is_loading=how != "no-is-loading", metadata={} if how == "no-metadata" else found)
        state = self.load_state(ctx, template, directory)
        job.restore(state)
        restore_scheduler(job, state)

    def save_state(self, ctx: RankContext, sharded_state: dict, directory: Path, content_metadata: dict | None = None,
                   then: Callable[[], None] | None = None) -> None:
        """`then` runs on every rank once the checkpoint is complete: after a barrier past a sync save, or
        as the async request's last finalize function."""
        from megatron.core import dist_checkpointing

        o = self.strategy
        if self._pending:  # Megatron-LM: a save waits for the previous async save's finalize
            self.finalize_saves(ctx)
        if ctx.is_rank0:
            directory.mkdir(parents=True, exist_ok=False)  # dist_checkpointing expects it to exist
        dist.barrier()
        strategy = self._save_strategy_obj()
        kwargs: dict[str, Any] = {} if content_metadata is None else {"content_metadata": content_metadata}
        kwargs.update(self._integrity(dist_checkpointing.save))
        if o.cache_metadata and self._saves:  # Megatron-LM: already validated by the first save
            kwargs["validate_access_integrity"] = False
        event = self._save_event(strategy, directory, validated="validate_access_integrity" not in kwargs)
        if o.async_save == "none":
            if strategy is None and not kwargs:
                dist_checkpointing.save(sharded_state, str(directory))  # exactly the call it always was
            else:
                dist_checkpointing.save(sharded_state, str(directory), strategy, **kwargs)
            if o.verify_integrity:  # written by rank 0 before the save's last barrier
                event["manifest"] = (directory / "integrity.json").is_file()
                if event["manifest"] and ctx.is_rank0:  # its hashes against the files, read here with hashlib
                    event["manifest_problems"] = manifest_problems(directory)
            if then is not None:
                dist.barrier()
                then()
        else:
            from harness.compat import require
            from harness.compat.mcore import ASYNC_RESULTS_QUEUE

            require(ASYNC_RESULTS_QUEUE)
            kwargs.update(async_save_kwargs(dist_checkpointing.save, o.async_save))
            request = dist_checkpointing.save(sharded_state, str(directory), strategy, async_sharded_save=True, **kwargs)
            if then is not None:
                request.add_finalize_fn(then)
            self._async_queue().schedule_async_request(request)
            self._pending.append(directory)
        if strategy is not None and hasattr(strategy, "last"):
            event["distribution"] = strategy.last
        record_event(event, self.name)
        self._saves += 1

    def _integrity(self, entry: Callable) -> dict[str, Any]:
        """`verify_integrity=True` for `entry` (save or load) when the option asks; a release without it
        (before Core 0.19) misses the API."""
        if not self.strategy.verify_integrity:
            return {}
        if "verify_integrity" not in inspect.signature(entry).parameters:
            raise missing_api("megatron.core.dist_checkpointing", f"{entry.__name__}(verify_integrity=)")
        return {"verify_integrity": True}

    def _save_event(self, strategy: Any, directory: Path, validated: bool) -> dict:
        """What this save is about to run: the strategy class, the group it distributes over,
        how much of megatron-core's cached plan it starts from (0: plans from scratch, 1: the
        cached local plan, 2: the cached central plan and global metadata; None: no cache)."""
        from megatron.core import parallel_state

        base = getattr(strategy, "base_strategy", strategy)
        reuse = None
        if base is not None and getattr(base, "use_cached_ckpt_structure", False):
            reuse = 2 if (base.validated_cache_reuse and base.cached_central_plan is not None) else int(base.cached_local_plan is not None)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        group = getattr(strategy, "parallelization_group", None)
        return {
            "op": "save", "n": self._saves + 1, "directory": str(directory),
            "strategy": "fully_parallel" if isinstance(strategy, FullyParallelSaveStrategyWrapper) else "default",
            "group": dist.get_world_size(group) if group is not None else None,
            "dp_cp": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            "plan_reuse": reuse, "validated": validated, "async": self.strategy.async_save,
        }

    def _async_queue(self):
        if self._calls is None:
            from megatron.core.dist_checkpointing.strategies import torch as torch_strategies

            if hasattr(torch_strategies, "get_async_strategy"):
                _, modules = torch_strategies.get_async_strategy(self.strategy.async_save)
                self._calls = modules["AsyncCallsQueue"]()
            else:  # before 0.17: megatron-core's own queue (save() refused any other writer above)
                from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

                self._calls = AsyncCallsQueue()
        return self._calls

    @property
    def saves_async(self) -> bool:
        return self.strategy.async_save != "none"

    def checkpoint_complete(self, directory: Path) -> bool | None:
        return is_complete(directory)

    def strategy_check(self, events: dict[str, dict[str, list[dict]]]) -> Any:
        """Every save and load of the case ran what the options asked (harness.backends._mcore_events)."""
        from dataclasses import replace

        from harness.backends._mcore_events import strategy_check

        o = self.strategy
        return strategy_check(o, replace(McoreDistOptions(), strict=o.strict, layout=o.layout), events, self.name)

    def pending_saves(self) -> int:
        return len(self._pending)

    def finalize_saves(self, ctx: RankContext) -> list[dict]:
        """Wait for every pending async write on every rank, then run the finalize functions
        (megatron-core's AsyncCallsQueue.maybe_finalize_async_calls(blocking=True), what
        Megatron-LM's maybe_finalize_async_save calls). Records whether each checkpoint was
        complete just before and right after."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        before = [is_complete(d) for d in pending]
        dist.barrier()  # nobody's finalize may write metadata before every rank looked
        self._calls.maybe_finalize_async_calls(blocking=True)
        return [{"directory": str(d), "complete_before": b, "complete_after": is_complete(d)} for d, b in zip(pending, before)]

    def load_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> dict:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        strategy = self._load_strategy_obj()
        group = getattr(strategy, "parallelization_group", None)
        fully = isinstance(strategy, FullyParallelLoadStrategyWrapper)
        event = {"op": "load", "directory": str(directory), "strategy": "fully_parallel" if fully else "default",
                 "group": dist.get_world_size(group) if group is not None else None,
                 "dp_cp": parallel_state.get_data_parallel_world_size(with_context_parallel=True)}
        # the flag as a string, as Megatron-LM passes args.dist_ckpt_strictness: megatron-core parses it
        kwargs = {"strict": self.strategy.strict, **self._integrity(dist_checkpointing.load)}
        if strategy is None:
            state = dist_checkpointing.load(sharded_state, str(directory), **kwargs)
        else:
            calls: list = []
            with tracked_exchange(calls):
                state = dist_checkpointing.load(sharded_state, str(directory), strategy, **kwargs)
            event["exchanges"] = len(calls)
            event["exchange_algos"] = sorted({str(c) for c in calls})
            base = getattr(strategy, "base_strategy", strategy)
            event["metadata_cached"] = getattr(base, "cached_global_metadata", None) is not None
        state = returned_keys(state, self.strategy.strict, event)
        record_event(event, self.name)
        return state

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        from harness.models.mcore import sharded_state_dict

        self.save_state(ctx, sharded_state_dict(model), directory)

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        from harness.models.mcore import load_state_dict, sharded_state_dict

        state = self.load_state(ctx, sharded_state_dict(model), directory)
        load_state_dict(model, state, retry_non_strict=self.strategy.strict in TOLERATING)

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        from megatron.core import dist_checkpointing

        plain = dist_checkpointing.load_plain_tensors(str(iteration_dir(directory)))
        return {k: v for k, v in plain.items() if isinstance(v, torch.Tensor)}


BACKEND = McoreDist()
