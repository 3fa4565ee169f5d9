"""verl 0.9.1's real MegatronCheckpointManager, driven the way verl drives it (issue 10).

A client backend: verl builds its own sharded state dicts and loads into the live model,
optimizer and LR scheduler, so it overrides `save_training` / `load_training` over the live
`TrainingJob` (harness.backends.TrainingState) instead of `save_state` / `load_state`.

The manager is built as verl's Megatron engine builds it (verl/workers/engine/megatron/
transformer_impl.py, `initialize`): an OmegaConf `{model.path, megatron.{dist_ckpt_optim_fully_reshardable,
distrib_optim_fully_reshardable_mem_efficient}}`, an `McoreCheckpointConfig(save_contents,
load_contents, async_save)`, the DDP-wrapped chunks, the megatron optimizer and scheduler, and for a
Megatron-Bridge model its AutoBridge + provider (the provider path), or with option `bridge: vanilla`
the `mbridge` package's AutoBridge and no provider (verl's deprecated vanilla_mbridge path: the model
itself is then built by mbridge through verl's make_megatron_module, harness.models.mbridge). The optimizer format follows the job: its
`sharding` fully_reshardable sets dist_ckpt_optim_fully_reshardable, `mem_efficient` the other.

Layout, as verl's trainer lays it out: `<dir>/global_step_<N>/actor/` per save, the tracker
`<dir>/latest_checkpointed_iteration.txt` written by the trainer after a synchronous save (here: this
backend) and by the manager's finalize after an async one; a load resolves the tracker with verl's
own `find_latest_ckpt_path`. One manager per job and rank, so `max_ckpt_to_keep` sees every save.

Options (matrix `backend_options` / axes `backend.<name>`): `save_contents`, `load_contents`
(subsets of model, optimizer, extra, hf_model), `use_dist_checkpointing`, `async_save`, `bridge`
(provider | vanilla: which bridge builds and converts a Bridge model),
`max_ckpt_to_keep` (0: keep all), `use_checkpoint_opt_param_scheduler`, and `workarounds` (the verl
defects of harness.compat.verl stepped around, switch 'verl' of harness.compat.registry; an entry that drops one shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.compat import registry, require
from harness.compat import verl as compat
from harness.compat.mcore import ASYNC_RESULTS_QUEUE
from harness.core.context import RankContext

compat.quiet_verl_noise()  # before verl is imported (harness.run.preload, in the parent; forked ranks inherit it)

Content = Literal["model", "optimizer", "extra", "hf_model"]
TRACKER = "latest_checkpointed_iteration.txt"
ROLE = "actor"
BRIDGE_MODEL_CASES = ("verl-checkpoint", "verl-merger")  # the cases whose job is a Bridge model from an HF fixture


def step_dir(directory: Path, step: int) -> Path:
    """Where verl's trainer puts the actor's checkpoint of global step `step`."""
    return Path(directory) / f"global_step_{step}" / ROLE


@dataclass(frozen=True)
class VerlOptions:
    save_contents: tuple[Content, ...] = ("model", "optimizer", "extra")  # verl's CheckpointConfig default
    load_contents: tuple[Content, ...] = ("model", "optimizer", "extra")
    use_dist_checkpointing: bool = True
    async_save: bool = False
    max_ckpt_to_keep: int = 0  # 0: None (keep every checkpoint)
    use_checkpoint_opt_param_scheduler: bool = True
    bridge: Literal["provider", "vanilla"] = "provider"  # verl's vanilla_mbridge False / True
    workarounds: tuple[str, ...] = registry.defaults("verl")

    def __post_init__(self) -> None:
        registry.check("verl", self.workarounds, "verl workaround(s)")
        if not self.save_contents:
            raise ValueError("option 'save_contents' must name at least one of model, optimizer, extra, hf_model")
        if self.max_ckpt_to_keep < 0:
            raise ValueError(f"option 'max_ckpt_to_keep' must be >= 0, got {self.max_ckpt_to_keep}")


class VerlManager(Backend):
    name = "verl_manager"
    capabilities = frozenset({"training_state", "manager"})
    refusals = ("CheckpointingException",)  # verl has no checkpoint errors of its own: it loads through dist_checkpointing
    Options = VerlOptions
    preload = ("verl.utils.checkpoint.megatron_checkpoint_manager", "verl.workers.config.checkpoint")

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._managers: dict[int, Any] = {}

    def configured(self, options: Any) -> "VerlManager":
        other = super().configured(options)
        other._managers = {}
        return other

    def notes(self) -> list[str]:
        return [f"verl workaround applied: {w}: {registry.get(w).why}" for w in self._workarounds()]

    # ------------------------------------------------------------------ the manager

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        if self.options.bridge == "vanilla" and case.name not in BRIDGE_MODEL_CASES:
            raise ValueError(f"backend option bridge 'vanilla' builds a Bridge model with mbridge from an HF fixture; case {case.name} "
                             f"trains a GPT zoo model (only {', '.join(BRIDGE_MODEL_CASES)} build Bridge models)")
        if self.options.bridge == "vanilla":
            for topo in (source, target):
                if topo.vpp > 1 or topo.ep > 1 or topo.cp > 1:
                    raise ValueError(f"backend option bridge 'vanilla': harness.models.mbridge builds TP/PP/DP models, got {topo.id} "
                                     "(vpp, ep, cp > 1 are not built on the vanilla path here)")

    def unavailable(self) -> str | None:
        """verl's checkpoint path imports ray and tensordict (verl/protocol.py) wherever verl is; a box
        without them (a GPU image that carries no ray) runs the cases as not-run, not as errors."""
        import importlib.util

        missing = [m for m in ("verl", "ray", "tensordict") if importlib.util.find_spec(m) is None]
        if missing:
            return (f"backend verl_manager needs {', '.join(missing)} (verl's checkpoint manager imports them; "
                    "requirements-nodeps.txt, requirements-verl.txt), not installed")
        if self.options.bridge == "vanilla" and importlib.util.find_spec("mbridge") is None:
            return "backend option bridge 'vanilla' needs the mbridge package (requirements-nodeps.txt), which is not installed"
        return None

    def _workarounds(self) -> list[str]:
        o = self.options
        return [w for w in o.workarounds if (o.async_save or registry.get(w).only_on != "async_save")
                and (o.bridge == "vanilla" or registry.get(w).only_on != "vanilla")]

    def build_bridge_model(self, hf_dir, spec, topo, *, load_weights: bool = True, ddp_config: Any = None, adapter: Any = None) -> Any:
        if self.options.bridge == "provider":
            return super().build_bridge_model(hf_dir, spec, topo, load_weights=load_weights, ddp_config=ddp_config, adapter=adapter)
        from harness.models import mbridge

        if adapter is not None:
            raise ValueError("verl's vanilla bridge (mbridge 0.15.1) has no PEFT: verl builds LoRA only on the provider path")

        for w in self._workarounds():
            if registry.get(w).only_on == "vanilla":
                compat.apply_verl_workaround(w)
        compat.mbridge_te_spec()
        return mbridge.build(hf_dir, spec, topo, load_weights=load_weights, ddp_config=ddp_config)

    def _prepare(self, job) -> None:
        o = self.options
        for w in self._workarounds():
            compat.apply_verl_workaround(w)
        if o.async_save:
            require(ASYNC_RESULTS_QUEUE)  # the same writer as mcore_dist's async saves
        from megatron.core import tensor_parallel

        if not tensor_parallel.get_cuda_rng_tracker().get_states():
            compat.verl_rng_tracker_state(job.seed)

    def manager(self, job) -> Any:
        """The job's MegatronCheckpointManager on this rank (built once, as verl's engine does)."""
        mgr = self._managers.get(id(job))
        if mgr is None:
            self._prepare(job)
            mgr = self._managers[id(job)] = build_manager(job, self.options)
        return mgr

    # ------------------------------------------------------------------ training state

    def save_training(self, ctx: RankContext, job, directory: Path) -> None:
        mgr = self.manager(job)
        o = self.options
        local = step_dir(directory, job.step)
        mgr.save_checkpoint(str(local), global_step=job.step, max_ckpt_to_keep=o.max_ckpt_to_keep or None)
        if o.async_save:
            # verl 0.9.1 has no finalize of its own (its trainers call an undefined
            # async_calls_finalize_fn_exec): the caller drains megatron's queue, which runs the
            # manager's finalize (manifest, tracker, retention) once every rank's writes are done.
            # verl scheduled its requests on the queue of the module it imports (compat.verl.ASYNC_CALLS_MODULE:
            # megatron-core's own, or the one workaround F2 registers); had it failed to import it, the save
            # would have raised above, so a module not imported means nothing was scheduled.
            import sys

            base = sys.modules.get(compat.ASYNC_CALLS_MODULE)
            if base is not None:
                base.async_calls.maybe_finalize_async_calls(blocking=True)
        else:
            dist.barrier()
            if ctx.is_rank0:  # what verl's trainer does after a synchronous save (ray_trainer._save_checkpoint)
                (Path(directory) / TRACKER).write_text(str(job.step))
        dist.barrier()

    def load_training(self, ctx: RankContext, job, directory: Path) -> None:
        """verl's resume: the tracker of the root `directory` names the step (resume_mode auto); a
        `global_step_<N>` directory is loaded as it is (resume_mode resume_path, resume_from_path:
        verl/trainer/ppo/ray_trainer.py _load_checkpoint)."""
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        if Path(directory).name.startswith("global_step_"):
            self.manager(job).load_checkpoint(str(Path(directory) / ROLE))
            return
        found = find_latest_ckpt_path(str(directory))
        if found is None:
            raise FileNotFoundError(f"no resumable verl checkpoint under {directory}: {TRACKER} missing or names no global_step_<N>")
        self.manager(job).load_checkpoint(str(Path(found) / ROLE))

    # ------------------------------------------------------------------ the abstract format methods

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        raise NotImplementedError("verl_manager saves a live training job (save_training), not a bare model")

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        raise NotImplementedError("verl_manager loads a live training job (load_training), not a bare model")

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """The model tree of the checkpoint the tracker names (model/dist_ckpt), unsharded."""
        from megatron.core import dist_checkpointing

        step = int((Path(directory) / TRACKER).read_text())
        plain = dist_checkpointing.load_plain_tensors(str(step_dir(directory, step) / "model" / "dist_ckpt"))
        return {k: v for k, v in plain.items() if isinstance(v, torch.Tensor)}


def build_manager(job, o: VerlOptions):
    """verl/workers/engine/megatron/transformer_impl.py `initialize`, with the job's objects."""
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.megatron_checkpoint_manager import (
        MegatronCheckpointManager,
    )
    from verl.workers.config.checkpoint import McoreCheckpointConfig

    from harness.models.training import leaf_optimizers

    bm = job.bridge
    config = OmegaConf.create({
        "model": {"path": bm.base_path if bm is not None else "/nonexistent-hf-path"},  # read into model_path only
        "megatron": {
            "dist_ckpt_optim_fully_reshardable": job.sharding == "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": bool(job.mem_efficient),
        },
    })
    checkpoint_config = McoreCheckpointConfig(save_contents=list(o.save_contents), load_contents=list(o.load_contents),
                                              async_save=o.async_save)
    inner = job.chunks[0].module  # DDP -> (Float16Module ->) GPTModel
    gpt = getattr(inner, "module", inner)
    param_dtype = next(p.dtype for p in job.chunks[0].parameters())
    leaves = leaf_optimizers(job.optimizer)
    hf_config = processing_class = bridge = provider = None
    arch = "GPTModel"
    if bm is not None:
        from transformers import AutoTokenizer

        bridge, provider = bm.bridge, bm.provider
        from harness.models.mbridge import hf_config_of

        hf_config = hf_config_of(bm.bridge)
        processing_class = AutoTokenizer.from_pretrained(bm.base_path)
        arch = hf_config.architectures[0]
    return MegatronCheckpointManager(
        config=config,
        checkpoint_config=checkpoint_config,
        model_config=hf_config,
        transformer_config=gpt.config,
        role=ROLE,
        model=job.chunks,
        arch=arch,
        hf_config=hf_config,
        param_dtype=param_dtype,
        share_embeddings_and_output_weights=bool(getattr(gpt, "share_embeddings_and_output_weights", False)),
        processing_class=processing_class,
        optimizer=job.optimizer,
        optimizer_scheduler=job.scheduler,
        use_distributed_optimizer=all(o.config.use_distributed_optimizer for o in leaves),
        use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler and job.scheduler is not None,
        use_dist_checkpointing=o.use_dist_checkpointing,
        bridge=bridge,
        provider=provider,
        peft_cls=bm.peft if bm is not None else None,  # the Bridge PEFT object (LoRA/CanonicalLoRA), as verl's engine passes it
    )


BACKEND = VerlManager()
