"""Fault-injecting doubles: prove that each check can go red.

Backends that damage what they save or load, and rank hooks that break a build, the way real
defects do. They are not in the backend registry: a test (or a user checking their own harness
setup) names one by import path, `backends.register("name", "doubles:CorruptAfterLoad")`
or `RunOptions(rank_hooks=("doubles:drop_distributed_optimizer_knob",))`. The path travels
to the ranks inside the phase, so the fault reaches them under fork, spawn, forkserver and torchrun.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from harness.backends.bridge_hf import BridgeHF
from harness.backends.bridge_peft import BridgePeft
from harness.backends.bridge_training import BridgeTraining
from harness.backends.hf_peft import HfPeft
from harness.backends.mcore_dist import McoreDist
from harness.core.context import RankContext


def flip_first_bit(model) -> str:
    """Flip the lowest bit of the first parameter of the first chunk; its name."""
    from harness.models.mcore import as_chunks

    name, param = next(iter(as_chunks(model)[0].named_parameters()))
    with torch.no_grad():
        param.data.view(-1).view(torch.int32)[0] ^= 1
    return name


def edit_safetensors(directory: Path, key_part: str, edit) -> None:
    """Apply edit(state, key) to the first tensor whose key contains key_part, in place on disk."""
    from safetensors.torch import load_file, save_file

    (f,) = sorted(Path(directory).glob("*.safetensors"))
    state = load_file(str(f))
    key = sorted(k for k in state if key_part in k)[0]
    edit(state, key)
    save_file(state, str(f), metadata={"format": "pt"})


def flip_in_safetensors(directory: Path, key_part: str, bit: int = 0) -> None:
    def flip(state, key):
        state[key].view(-1).view(torch.int32)[0] ^= 1 << bit

    edit_safetensors(directory, key_part, flip)


# ------------------------------------------------------------------ dist checkpoints


class CorruptAfterLoad(McoreDist):
    """One bit of the first parameter flipped on rank 0 after a correct load."""

    def load(self, ctx, model, directory):
        super().load(ctx, model, directory)
        if ctx.rank == 0:
            flip_first_bit(model)


class CorruptBeforeSave(McoreDist):
    """One bit flipped before the first save (not the re-save): the checkpoint itself is wrong."""

    def save(self, ctx, model, directory):
        if ctx.rank == 0 and not directory.name.endswith("resaved"):
            flip_first_bit(model)
        super().save(ctx, model, directory)


class NoopLoad(McoreDist):
    """A load that returns without loading anything."""

    def load(self, ctx, model, directory):
        pass


class LoadFirstChunkOnly(McoreDist):
    """A load written for one module and handed a virtual-pipeline chunk list: it loads `model[0]`
    alone, leniently (StrictHandling.IGNORE_ALL and validate_access_integrity=False: the layers of
    the later chunks are asked by nobody). Every later chunk keeps its pre-load (decoy) weights.
    (megatron-core's defaults refuse such a load: the ranks' requests do not cover the tensors.)"""

    def load(self, ctx, model, directory):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        from harness.models.mcore import as_chunks

        chunk = as_chunks(model)[0]
        state = dist_checkpointing.load(chunk.sharded_state_dict(), str(directory), strict=StrictHandling.IGNORE_ALL,
                                       validate_access_integrity=False)
        chunk.load_state_dict(state, strict=True)


class RaisingLoad(McoreDist):
    """A load that fails inside upstream code (torch's loader on a file that is not there), as a real
    upstream defect raises: the raising frame is torch's, never the harness's."""

    def load(self, ctx, model, directory):
        import torch

        torch.load(str(directory / "simulated-upstream-defect.pt"), weights_only=True)


def _swallowing(call, *args) -> None:
    """Run `call`, dropping every error but an interrupt (torch DCP's CheckpointException is a BaseException)."""
    try:
        call(*args)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise


class SwallowLoadErrors(McoreDist):
    """A load that catches every error and returns, keeping whatever the model held: the resume
    code that 'tolerates' a bad checkpoint (corrupt-load must call it a silent load and go red)."""

    def load(self, ctx, model, directory):
        _swallowing(super().load, ctx, model, directory)


class SaveUnvalidated(McoreDist):
    """A save that skips megatron-core's sharding validation (`validate_access_integrity=False`, what
    a release that lost the check would do): corrupt-load's claimed-whole must go red, not refused."""

    def save_state(self, ctx, sharded_state, directory, *args, **kwargs):
        from megatron.core import dist_checkpointing

        original = dist_checkpointing.save
        dist_checkpointing.save = lambda *a, **k: original(*a, **{**k, "validate_access_integrity": False})
        try:
            return super().save_state(ctx, sharded_state, directory, *args, **kwargs)
        finally:
            dist_checkpointing.save = original


class CorruptOptimizerAfterLoad(McoreDist):
    """One bit of the first exp_avg flipped on rank 0 after a training-state load."""

    key = "exp_avg"

    def load_state(self, ctx, sharded_state, directory):
        state = super().load_state(ctx, sharded_state, directory)
        if ctx.rank == 0:
            stack = [state["optimizer"]]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if torch.is_tensor(node.get(self.key)):
                        node[self.key].view(-1).view(torch.int32)[0] ^= 1
                        break
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
        return state


class CorruptMomentumAfterLoad(CorruptOptimizerAfterLoad):
    """One bit of the first Muon momentum_buffer flipped on rank 0 after a training-state load."""

    key = "momentum_buffer"


def _flip_lowest_bit(t: torch.Tensor) -> None:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        t.view(-1).view(ints)[0] ^= 1


class CorruptExpertAfterLoad(McoreDist):
    """A MoE model whose first local expert weight comes back one ulp off on the LAST rank after a
    correct load: under expert parallelism that rank holds only the last experts (global index
    ep_rank * local experts), so a judge that looked at rank 0's experts would miss it."""

    def load(self, ctx, model, directory):
        super().load(ctx, model, directory)
        if ctx.rank == ctx.world_size - 1:
            from harness.models.mcore import as_chunks

            _flip_lowest_bit(next(p for c in as_chunks(model) for n, p in c.named_parameters() if ".local_experts." in n))


class CorruptExpertMainParamAfterLoad(McoreDist):
    """A MoE training-state load whose expert optimizer (the second member of megatron's
    ChainedOptimizer [dense, expert], built when ep > 1) gets its first fp32 main param one ulp off
    on the LAST rank; the dense optimizer and the model section load correctly."""

    def load_state(self, ctx, sharded_state, directory):
        state = super().load_state(ctx, sharded_state, directory)
        if ctx.rank == ctx.world_size - 1:
            stack = [state["optimizer"][1]]  # KeyError/TypeError: no expert optimizer in a chain
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if torch.is_tensor(node.get("param")) and "exp_avg" in node:
                        _flip_lowest_bit(node["param"])
                        break
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
            else:
                raise RuntimeError("CorruptExpertMainParamAfterLoad: no main param in the expert optimizer's state")
        return state


class ModelWeightOffMainParam(McoreDist):
    """A training-state load whose model section comes back with one weight one ulp off on rank 0
    (the lowest bit of the first floating tensor, by key), while the optimizer section, fp32 main
    params included, loads correctly: the mixed-precision bug of a load that takes the bf16 weights
    from another source than the main params (megatron's optimizer load never copies main params
    down into the model, so nothing repairs it before the next step). Only the bf16 checks of
    weights-match-main-params see it directly."""

    def load_state(self, ctx, sharded_state, directory):
        state = super().load_state(ctx, sharded_state, directory)
        if ctx.rank == 0:
            model = state["model"]
            key = next(k for k in sorted(model) if torch.is_tensor(model[k]) and model[k].is_floating_point())
            t = model[key]
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            t.view(-1).view(ints)[0] ^= 1
        return state


# ------------------------------------------------------------------ HF and PEFT exports


def drop_from_tree(tree: Path, gone) -> None:
    """Remove from an HF tree every tensor whose name `gone(name)` says, from its safetensors files and
    its index's weight_map, as an export that never wrote them would leave the tree."""
    from safetensors.torch import load_file, save_file

    for f in sorted(tree.glob("*.safetensors")):
        state = load_file(str(f))
        if any(gone(k) for k in state):
            save_file({k: v for k, v in state.items() if not gone(k)}, str(f), metadata={"format": "pt"})
    index = tree / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not gone(k)}
        index.write_text(json.dumps(doc))


class FlipExportedWeight(BridgeHF):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            # the top mantissa bit: a lowest-bit flip may round away in the logits, and the
            # logits check must be seen to fail too (export-bitwise catches any bit)
            flip_in_safetensors(directory, "layers.1.self_attn.k_proj.weight", bit=22)


class ExportAsFp32(BridgeHF):
    """A bf16 model exported as fp32: every tensor upcast (the values exact) and the config saying
    float32, as an export that builds its HF model in the default dtype writes it."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            for f in sorted(Path(directory).glob("*.safetensors")):
                from safetensors.torch import load_file, save_file

                state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
                save_file(state, str(f), metadata={"format": "pt"})
            cfg = json.loads((directory / "config.json").read_text())
            cfg.pop("torch_dtype", None)
            cfg["dtype"] = "float32"
            (directory / "config.json").write_text(json.dumps(cfg))


class ExportDropsMtpLayer(BridgeHF):
    """Megatron-Bridge #3348's outcome as a double: an export that writes no tensor of the MTP layer
    (DeepSeek-V3's model.layers.<num_hidden_layers>.*), files and index rewritten after the save."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            mtp = f"model.layers.{json.loads((directory / 'config.json').read_text())['num_hidden_layers']}."
            drop_from_tree(Path(directory), lambda k: k.startswith(mtp))


class ExportOneEpRanksExperts(BridgeHF):
    """Megatron-Bridge #1716/#1871 as a double: an export from an EP topology that keeps only EP rank
    0's experts (the second half of every layer's experts missing from the files)."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            import re

            from safetensors.torch import load_file, save_file

            for f in sorted(Path(directory).glob("*.safetensors")):
                state = load_file(str(f))
                experts = 1 + max((int(m.group(1)) for k in state if (m := re.search(r"\.experts\.(\d+)\.", k))), default=-1)
                kept = {k: v for k, v in state.items()
                        if not ((m := re.search(r"\.experts\.(\d+)\.", k)) and int(m.group(1)) >= experts // 2)}
                save_file(kept, str(f), metadata={"format": "pt"})
            index = directory / "model.safetensors.index.json"
            if index.exists():
                index.unlink()


class DropExportShard(BridgeHF):
    """Megatron-Bridge#4188's shape: a sharded export missing its last shard, the index still
    naming it (run with hf-roundtrip option shards > 1)."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            sorted(Path(directory).glob("model-*.safetensors"))[-1].unlink()


class PruneExportIndex(BridgeHF):
    """Megatron-Bridge#4083's shape: the index lists what the other ranks wrote but not the last
    pipeline stage's tensors (final norm, lm_head), which the shards hold."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            index = Path(directory) / "model.safetensors.index.json"
            data = json.loads(index.read_text())
            for k in ("model.norm.weight", "lm_head.weight"):
                del data["weight_map"][k]
            index.write_text(json.dumps(data))


class FlipLoraB(BridgePeft):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            flip_in_safetensors(directory, "layers.2.self_attn.v_proj.lora_B")


class DropLoraA(BridgePeft):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            edit_safetensors(directory, "layers.0.mlp.down_proj.lora_A", lambda state, key: state.pop(key))


class DropTargetModule(BridgePeft):
    """An adapter with one target module dropped: v_proj gone from adapter_config.json's
    target_modules and its tensors gone from the file (peft then loads it without a word)."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            from safetensors.torch import load_file, save_file

            cfg = json.loads((directory / "adapter_config.json").read_text())
            cfg["target_modules"] = [m for m in cfg["target_modules"] if m != "v_proj"]
            (directory / "adapter_config.json").write_text(json.dumps(cfg))
            (f,) = sorted(Path(directory).glob("*.safetensors"))
            save_file({k: v for k, v in load_file(str(f)).items() if ".v_proj." not in k}, str(f), metadata={"format": "pt"})


class LoseAlpha(BridgePeft):
    """verl #1821: the exported adapter_config.json lost lora_alpha."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            cfg = json.loads((directory / "adapter_config.json").read_text())
            cfg["lora_alpha"] = 0
            (directory / "adapter_config.json").write_text(json.dumps(cfg))


class PeftSwapsLoraB(HfPeft):
    """PEFT's adapter file with two layers' q_proj lora_B values swapped under their keys (a renaming slip)."""

    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        from safetensors.torch import load_file, save_file

        f = Path(directory) / "adapter_model.safetensors"
        state = load_file(str(f))
        a, b = sorted(k for k in state if k.endswith("q_proj.lora_B.weight"))[:2]
        state[a], state[b] = state[b], state[a]
        save_file(state, str(f), metadata={"format": "pt"})


class PeftDropsEmbedding(HfPeft):
    """save_pretrained without the base embeddings PEFT's "auto" rule saves (save_embedding_layers=False)."""

    def save(self, ctx, model, directory):
        model.save_pretrained(str(directory), save_embedding_layers=False)


class PeftLoadsIntoNothing(HfPeft):
    """The adapter loaded under a name the model never activates: from_pretrained's adapter is 'other'."""

    def load(self, ctx, model, directory, adapter="default"):
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return super().load(ctx, model, directory, adapter)
        loaded = PeftModel.from_pretrained(model, str(directory), adapter_name=adapter)
        with torch.no_grad():
            for n, t in loaded.named_parameters():
                if "lora_A" in n:
                    t.zero_()
        return loaded


class PeftTpFirstShardEverywhere(HfPeft):
    """On a TP model, every rank's q_proj lora_B is the file's first slice (rank 0's): a sharder that slices
    for the wrong rank."""

    def load(self, ctx, model, directory, adapter="default"):
        from safetensors.torch import load_file

        loaded = super().load(ctx, model, directory, adapter)
        state = load_file(str(Path(directory) / "adapter_model.safetensors"))
        with torch.no_grad():
            for n, t in loaded.named_parameters():
                if "q_proj.lora_B" in n:
                    full = state[n.replace(f".{adapter}.", ".")]
                    t.copy_(full[:t.shape[0]])
        return loaded


class PeftTpLoadsAsNoop(HfPeft):
    """The adapter left at its init on load (every lora_B zero), as PEFT leaves one whose keys did not match."""

    def load(self, ctx, model, directory, adapter="default"):
        loaded = super().load(ctx, model, directory, adapter)
        with torch.no_grad():
            for n, t in loaded.named_parameters():
                if "lora_B" in n:
                    t.zero_()
        return loaded


# ------------------------------------------------------------------ rank hooks


def drop_distributed_optimizer_knob() -> None:
    """verl PR #5775: use_distributed_optimizer is dropped on the way to DDP (always True there)."""
    import dataclasses

    from harness.models import training

    real = training.build_training

    def build(spec, topo, cfg, seed_offset=0, **config_overrides):
        return real(spec, topo, dataclasses.replace(cfg, use_distributed_optimizer=True), seed_offset, **config_overrides)

    training.build_training = build


def muon_built_as_adam() -> None:
    """optimizer_type muon is dropped on the way to megatron-core's OptimizerConfig (Adam is built)."""
    from harness.models.training import build

    real = build.optimizer_config

    def config(cfg):
        built = real(cfg)
        built.optimizer = "adam"
        return built

    build.optimizer_config = config


def rotate_vpp_chunks() -> None:
    """Virtual-pipeline chunk i takes chunk (i+1) % vpp's layer offset (a builder whose layer
    numbering is off by one virtual stage): with pp2vpp2, pp rank 0 holds layer 2 in chunk 0 and
    layer 0 in chunk 1. Every layer is still held exactly once and saved/loaded under its own key, so
    the weight checks stay green: only the forward pass (layers run in the wrong order) can see it.
    Patches megatron-core 0.19.2's `get_transformer_layer_offset` where TransformerLayer (layer
    numbers) and TransformerBlock (sharded-state offsets) look it up; without vpp nothing changes.
    (Giving every chunk the same offset instead is refused by megatron-core itself: duplicate
    `_extra_state` ShardedObject keys, overlapping torch DCP shards.)"""
    from megatron.core.transformer import transformer_block, transformer_layer

    real = transformer_layer.get_transformer_layer_offset

    def offset(config, vp_stage=None, pp_rank=None):
        if vp_stage is not None:
            vp_stage = (vp_stage + 1) % config.virtual_pipeline_model_parallel_size
        return real(config, vp_stage, pp_rank)

    transformer_layer.get_transformer_layer_offset = offset
    transformer_block.get_transformer_layer_offset = offset


def corrupt_mcore_loads() -> None:
    """Every mcore_dist model load on rank 0 flips one bit after loading: for checks that resolve
    the backend by name themselves (the golden corpus), where no double can be named."""
    from harness.backends.mcore_dist import McoreDist

    real = McoreDist.load

    def load(self, ctx, model, directory):
        real(self, ctx, model, directory)
        if ctx.rank == 0:
            flip_first_bit(model)

    McoreDist.load = load



def sync_sends_one_ep_ranks_experts_twice() -> None:
    """verl's weight sync hands the rollout engine EP rank 0's experts twice: under their own names and
    again under EP rank 1's (experts E/2 .. E-1 carry the tensors of 0 .. E/2-1), as a gather that
    read one rank's shard for both would. Patches AutoBridge.export_hf_weights in the rank."""
    import re

    from megatron.bridge import AutoBridge

    real = AutoBridge.export_hf_weights
    expert = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")

    def export_hf_weights(self, model, *args, **kwargs):
        seen, names = {}, []
        for name, w in real(self, model, *args, **kwargs):
            names.append(name)
            seen[name] = w
        total = 1 + max((int(m.group(2)) for n in names if (m := expert.match(n))), default=-1)
        for name in names:
            m = expert.match(name)
            if m and total >= 2 and int(m.group(2)) >= total // 2:
                yield name, seen[f"{m.group(1)}{int(m.group(2)) - total // 2}{m.group(3)}"]
            else:
                yield name, seen[name]

    AutoBridge.export_hf_weights = export_hf_weights


def sync_merge_loses_alpha() -> None:
    """verl's merged LoRA weight sync folds B @ A into the base at scale 1, not alpha / r: every
    adapter's alpha reads as its rank while export_hf_weights merges (the unmerged and adapter-only
    streams keep the real alpha). Patches AutoBridge.export_hf_weights in the rank."""
    from megatron.bridge import AutoBridge

    real = AutoBridge.export_hf_weights

    def export_hf_weights(self, model, *args, merge_adapter_weights=True, **kwargs):
        adapters = [m for chunk in model for m in chunk.modules()
                    if isinstance(getattr(m, "alpha", None), (int, float)) and isinstance(getattr(m, "dim", None), int)]
        kept = [m.alpha for m in adapters]
        if merge_adapter_weights:
            for m in adapters:
                m.alpha = m.dim
        try:
            yield from real(self, model, *args, merge_adapter_weights=merge_adapter_weights, **kwargs)
        finally:
            for m, a in zip(adapters, kept):
                m.alpha = a

    AutoBridge.export_hf_weights = export_hf_weights


def mark_checkpoint_complete_first() -> None:
    """Rank 0 writes megatron-core's `metadata.json` before every dist_checkpointing.save writes a
    byte: the ordering bug of a checkpoint manager that marks a directory complete first, so any
    interruption leaves a directory megatron-core's own rule (check_is_distributed_checkpoint)
    calls a checkpoint. interrupted-save must go red on it (recognised-incomplete)."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    real = dist_checkpointing.save

    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if int(os.environ["RANK"]) == 0:
            save_config(CheckpointingConfig("torch_dist", 1), str(checkpoint_dir))
        return real(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    dist_checkpointing.save = save


def leak_a_process() -> None:
    """A rank that starts a process in its own session and forgets it: the launcher's process-group
    kill cannot reach it, so only a leak check finds it (tests/test_soak.py)."""
    import subprocess

    subprocess.Popen(["sleep", "60"], start_new_session=True)


def record_gpu_env() -> None:
    """Rank hook of the GPU packing tests: this rank's GPU environment, one JSON file per rank under
    $CKPT_HARNESS_TEST_GPU_LOG (the test sets it in the CLI's environment)."""
    import os
    import time

    out = os.environ.get("CKPT_HARNESS_TEST_GPU_LOG")
    if out:
        rec = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "world_size": os.environ.get("WORLD_SIZE"), "time": time.time(),
               "gpus": os.environ.get("CKPT_HARNESS_GPUS"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        (Path(out) / f"rank-{os.getpid()}.json").write_text(json.dumps(rec))


def fake_packed_case(spec: Any, options: Any):
    """runner.run_case's stand-in for the packing executor's tests: no world, holds its GPUs for a
    moment and reports the GPU environment its worker gave it; a case whose id names `dies` exits
    without a word, as a worker killed mid-case would."""
    import os
    import time

    from harness.core.result import CaseResult

    if "dies" in spec.id:
        os._exit(7)
    start = time.time()
    time.sleep(0.4)
    return CaseResult(spec.id, spec.case, spec.model, spec.backend, spec.source.id, spec.target.id, status="passed",
                      notes=[f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}",
                             f"CKPT_HARNESS_GPUS={os.environ.get('CKPT_HARNESS_GPUS')}", f"ran {start} {time.time()}"])
#: what the chatty doubles below print, warn and write (a quiet console: tests/test_ranklog.py)
CHATTER = "chatter from"


def chatter() -> None:
    """A rank hook that talks as libraries do: a print, a warning, and a C-level write to fd 2."""
    import os
    import warnings

    print(f"{CHATTER} a rank's print", flush=True)
    warnings.warn(f"{CHATTER} a rank's warning", RuntimeWarning)
    os.write(2, f"{CHATTER} a rank's fd 2\n".encode())


def chatter_then_fail() -> None:
    """`chatter`, then the rank fails: its case errors, and its failure names the logs."""
    chatter()
    raise RuntimeError("a rank hook failed on purpose")


class ChattyJudge(McoreDist):
    """mcore_dist whose check in the parent talks, as peft warns when the parent loads an adapter."""

    name = "chatty_dist"

    def strategy_check(self, events: dict[str, dict[str, list[dict]]]) -> Any:
        import warnings

        print(f"{CHATTER} the parent's print", flush=True)
        warnings.warn(f"{CHATTER} the parent's warning", RuntimeWarning)
        return super().strategy_check(events)


@dataclass(frozen=True)
class _TaggedOptions:
    tag: str = "plain"
    copies: int = 1


class TaggedDist(McoreDist):
    """mcore_dist with options (tests of backend options: typed, validated, delivered to ranks)."""

    name = "tagged_dist"
    Options = _TaggedOptions


# ------------------------------------------------------------------ verl's checkpoint manager (issue 10)
# Subclasses of the real verl_manager backend: the manager is verl's, one step of the load is
# skipped or one value damaged after it, so each verl-checkpoint / training check is seen to go red.

from harness.backends.verl_manager import VerlManager  # noqa: E402  (no verl import until a rank uses it)


class VerlSkipSchedulerLoad(VerlManager):
    """A resume whose manager never restores the LR scheduler (the optimizer and RNG load fine)."""

    def load_training(self, ctx, job, directory):
        mgr = self.manager(job)
        mgr.lr_scheduler, kept = None, mgr.lr_scheduler
        try:
            super().load_training(ctx, job, directory)
        finally:
            mgr.lr_scheduler = kept


class VerlSkipRngRestore(VerlManager):
    """A resume that reads `extra` but never puts the RNG state back."""

    def load_training(self, ctx, job, directory):
        mgr = self.manager(job)
        mgr.load_rng_states = lambda *a, **k: None
        try:
            super().load_training(ctx, job, directory)
        finally:
            del mgr.load_rng_states


def _flip_lowest_bit(t: torch.Tensor) -> None:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        t.view(-1).view(ints)[0] ^= 1


class VerlCorruptMainParam(VerlManager):
    """After a correct load, rank 0's first fp32 main param is one ulp off (the optimizer's copy;
    under fp32 the distributed optimizer's main params are views of the weights)."""

    def load_training(self, ctx, job, directory):
        super().load_training(ctx, job, directory)
        if ctx.rank == 0:
            from harness.models.training import leaf_optimizers

            opt = leaf_optimizers(job.optimizer)[0]
            groups = getattr(opt, "shard_fp32_from_float16_groups", None) or []
            mains = [p for g in groups for p in g] or [p for g in opt.optimizer.param_groups for p in g["params"]]
            _flip_lowest_bit(mains[0].data)


class VerlWeightOffMainParam(VerlManager):
    """After a correct load, rank 0's first bf16 model weight (by name) is one ulp off its fp32 main param."""

    def load_training(self, ctx, job, directory):
        super().load_training(ctx, job, directory)
        if ctx.rank == 0:
            name, p = sorted(job.chunks[0].module.named_parameters())[0]
            _flip_lowest_bit(p.data)


class VerlAdapterWrongAlpha(VerlManager):
    """The HF adapter verl exported declares lora_alpha twice what was trained (rank 0 rewrites its
    adapter_config.json after the save): a LoRA adapter that loads into PEFT with the wrong alpha."""

    def save_training(self, ctx, job, directory):
        import torch.distributed as dist

        from harness.backends.verl_manager import step_dir

        super().save_training(ctx, job, directory)
        path = step_dir(directory, job.step) / "model" / "huggingface" / "adapter" / "adapter_config.json"
        if ctx.rank == 0 and path.exists():
            cfg = json.loads(path.read_text())
            cfg["lora_alpha"] *= 2
            path.write_text(json.dumps(cfg))
        dist.barrier()


class VerlHfTreeLosesLastExperts(VerlManager):
    """verl #6821 / #6842's shape: the HF tree verl saves beside the checkpoint lacks the routed experts
    of the last MoE layer (rank 0 rewrites the tree's safetensors and index after the save), as an
    EP x PP export that gathered every expert but those of the last stage's last layer."""

    def save_training(self, ctx, job, directory):
        import re

        import torch.distributed as dist
        from safetensors.torch import load_file

        from harness.backends.verl_manager import step_dir

        super().save_training(ctx, job, directory)
        tree = step_dir(directory, job.step) / "model" / "huggingface"
        if ctx.rank == 0 and tree.is_dir():
            keys = [k for f in sorted(tree.glob("*.safetensors")) for k in load_file(str(f))]
            last = max(int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", k)))
            drop_from_tree(tree, lambda k: k.startswith(f"model.layers.{last}.mlp.experts."))
        dist.barrier()


class VerlAdapterNotRestored(VerlManager):
    """A PEFT resume that restores the base and the optimizer but leaves the adapters at the resuming
    job's own (decoy) values."""

    def load_training(self, ctx, job, directory):
        chunk = job.chunks[0]
        kept = {n: p.detach().clone() for n, p in chunk.named_parameters() if ".adapter." in n}
        super().load_training(ctx, job, directory)
        with torch.no_grad():
            for n, p in chunk.named_parameters():
                if n in kept:
                    p.copy_(kept[n])


class VerlAsyncModelTreeWritesLast(VerlManager):
    """Not a fault: makes F5's race deterministic. The async writer process of the model tree
    (model/dist_ckpt) starts writing 3 s late, so the optimizer's and extra's write results reach
    megatron-core's one process-wide results queue first; without the verl_async_one_at_a_time
    workaround the model request then finalizes with another tree's results."""

    def _prepare(self, job):
        super()._prepare(job)
        import time

        from megatron.core.dist_checkpointing.strategies.filesystem_async import (
            FileSystemWriterAsync as W,
        )

        original = W.write_preloaded_data_multithread
        if getattr(original, "_ckpt_harness", False):
            return

        def model_tree_last(transform_list, use_msc, rank, write_buckets, global_results_queue):
            if any("/model/dist_ckpt/" in str(bucket[0]) for bucket in write_buckets):
                time.sleep(3)
            return original(transform_list, use_msc, rank, write_buckets, global_results_queue)

        model_tree_last._ckpt_harness = True
        W.write_preloaded_data_multithread = staticmethod(model_tree_last)


# ------------------------------------------------------------------ save/load strategies (mcore_dist options)


class SkipAsyncFinalize(McoreDist):
    """An async save whose finalize step never runs: the writer is waited for (its shards are on
    disk), its finalize functions (torch DCP's .metadata, megatron-core's metadata.json) dropped,
    as a client without a finalize hook leaves it (verl 0.9.1 calls no finalize of its own)."""

    def finalize_saves(self, ctx):
        if self._calls is not None:
            while self._calls.async_calls:
                self._calls.async_calls.popleft().async_caller.close()  # join the writer, skip the finalize
        self._pending = []
        return []


class DefaultStrategies(McoreDist):
    """Takes every strategy option and runs the default save and load anyway (an option that
    never reaches the call, as verl's save_dist_checkpointing passes no async_strategy)."""

    def _save_strategy_obj(self):
        return None

    def _load_strategy_obj(self):
        return None


class CorruptSecondSave(McoreDist):
    """The job's second save (the one a metadata cache serves) writes one Adam exp_avg element with
    its top mantissa bit flipped (rank 0's first main-replica exp_avg shard, a flipped copy: the
    live job is untouched; a lowest-bit flip of a moment rounds away in the next weight update);
    the first save is correct."""

    def save_state(self, ctx, sharded_state, directory, **kwargs):
        if self._saves == 1 and ctx.rank == 0:
            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import (
                ShardedTensor,
                is_main_replica,
            )

            sh = next(v for v in nested_values(sharded_state.get("optimizer", {}))
                      if isinstance(v, ShardedTensor) and "exp_avg." in v.key and is_main_replica(v.replica_id) and v.data.numel())
            sh.data = sh.data.detach().clone()
            sh.data.view(-1).view(torch.int32)[0] ^= 1 << 22
        super().save_state(ctx, sharded_state, directory, **kwargs)


def skip_param_sync() -> None:
    """Saves and weight reads without Megatron-LM's force_param_sync: with overlap_param_gather
    each rank's params hold stale values outside its own shard until the next forward."""
    from harness.models import training

    training.sync_params = lambda ddp, optimizer, cfg: None


def backend_and_hook(ctx: RankContext, backend_ref: Any) -> dict:
    """What a rank sees of the extension points: the backend its phase names by import path (with
    its options), and whether the rank hooks ran (tests/doubles.py hooks mark themselves in the
    environment)."""
    import dataclasses
    import os

    from harness.backends import get_backend

    backend = get_backend(backend_ref)
    return {"backend": type(backend).__name__, "options": dataclasses.asdict(backend.options),
            "hook": os.environ.get("CKPT_HARNESS_PROBE_HOOK", "")}


@contextmanager
def registered(names: dict[str, str]) -> Iterator[None]:
    """Register test backends (name -> "doubles:Class") for as long as the block runs: a module's
    doubles exist only while its tests do (ranks fork from the registering process)."""
    from harness.backends import register, unregister

    for name, target in names.items():
        register(name, target)
    try:
        yield
    finally:
        for name in names:
            unregister(name)


def use_doubles(**names: str):
    """A module's autouse fixture registering its doubles (name="doubles:Class") for its tests only:
    `_doubles = use_doubles(test_noop_load="doubles:NoopLoad")` at module level."""
    import pytest

    @pytest.fixture(autouse=True, scope="module")
    def _doubles():
        with registered(names):
            yield

    return _doubles


class BridgeTrainingScrambledRng(BridgeTraining):
    """A Bridge load after which rank 0's python RNG is reseeded (what a resume that restores another
    rank's, or no, RNG state looks like); the load is recorded after the reseed."""

    def load_training(self, ctx, job, directory):
        import random

        from harness.backends import bridge_training

        real = bridge_training.rng_digest

        def reseeded():
            if ctx.rank == 0:
                random.seed(12345)
            return real()

        bridge_training.rng_digest = reseeded
        try:
            super().load_training(ctx, job, directory)
        finally:
            bridge_training.rng_digest = real


class BridgeTrainingSampleOffByOne(BridgeTraining):
    """After Bridge's save, the train state on disk counts one consumed sample less (a data position
    one draw off): both train_state.pt files, as a defective writer would leave them."""

    def save_training(self, ctx, job, directory):
        super().save_training(ctx, job, directory)
        torch.distributed.barrier()
        if ctx.rank == 0:
            for f in [Path(directory) / "latest_train_state.pt", *Path(directory).glob("iter_*/train_state.pt")]:
                sd = torch.load(f, weights_only=False)
                sd["consumed_train_samples"] -= 1
                torch.save(sd, f)
        torch.distributed.barrier()


class BridgeTrainingFinetuneIgnoresPath(BridgeTraining):
    """A finetune start that never reads its pretrained checkpoint (Bridge returning (0, 0) with a
    warning): the job stays at its random init and reports a fresh start."""

    def load_pretrained(self, ctx, job, directory, run_dir):
        job.step = 0


class BridgeTrainingFinetuneKeepsOptimizer(BridgeTraining):
    """A finetune start that restores the whole training state (optimizer, scheduler, iteration) of
    the pretrained checkpoint, as a resume would."""

    def load_pretrained(self, ctx, job, directory, run_dir):
        from harness.compat.registry import defaults
        from harness.models.training import load_training

        load_training(ctx, self, job, directory, defaults("training"))  # with the harness's megatron-core workarounds
        job.step = 0


class BridgeTrainingSchedulerNotRestored(BridgeTraining):
    """A resume whose LR scheduler keeps its fresh state (saved, never restored: the warmup replays)."""

    def load_training(self, ctx, job, directory):
        super().load_training(ctx, job, directory)
        job.scheduler.num_steps = 0  # as built: OptimizerParamScheduler.load_state_dict would add to num_steps
        job.scheduler.step(increment=0)


class BridgeTrainingPeftSavesBase(BridgeTraining):
    """A LoRA job saved without its PEFT config (cfg.peft None): the whole model, base included, goes
    into what should be an adapter-only checkpoint."""

    def _state(self, job, **checkpoint):
        state = super()._state(job, **checkpoint)
        if checkpoint.get("save"):
            state.cfg.peft = None
        return state


class BridgeTrainingPeftKeepsDecoyAdapters(BridgeTraining):
    """A PEFT resume whose adapters never come back: the job keeps the adapters it was built with."""

    def load_training(self, ctx, job, directory):
        kept = {n: p.detach().clone() for n, p in job.chunks[0].named_parameters() if ".adapter." in n}
        super().load_training(ctx, job, directory)
        with torch.no_grad():
            for n, p in job.chunks[0].named_parameters():
                if n in kept:
                    p.copy_(kept[n])


class BridgeTrainingNoopLoad(BridgeTraining):
    """A resume that reads nothing: the job keeps the weights it was built with."""

    def load_training(self, ctx, job, directory):
        job.step = 0


class BridgeTrainingSkipFinalize(BridgeTraining):
    """An async save never finalized: the job goes on (and a resume reads) as if it were complete."""

    def finalize_saves(self, ctx):
        pending, self._pending = self._pending, []
        return [{"directory": str(d), "complete_before": self.checkpoint_complete(d), "complete_after": self.checkpoint_complete(d)}
                for d in pending]


class BridgeTrainingPeftBaseNotLoaded(BridgeTraining):
    """A LoRA resume built without Bridge's PEFT pre-wrap hook: the base keeps the provider's init (its
    pretrained_checkpoint never read)."""

    def build_bridge_model(self, hf_dir, spec, topo, *, load_weights=True, ddp_config=None, adapter=None):
        from harness.backends import Backend

        return Backend.build_bridge_model(self, hf_dir, spec, topo, load_weights=load_weights, ddp_config=ddp_config, adapter=adapter)


class LoadWritesIntoSource(McoreDist):
    """A load that leaves a file behind in the checkpoint it read (and touches its metadata): what a
    loader must never do to a source the run shares (harness.run.reuse)."""

    def load(self, ctx, model, directory):
        super().load(ctx, model, directory)
        if ctx.rank == 0:
            (Path(directory) / "loaded-by-me.txt").write_text("a loader wrote here")
            meta = Path(directory) / "metadata.json"
            if meta.exists():
                meta.write_text(meta.read_text() + " ")


# ------------------------------------------------------------------ async saves (case async-save)


class TrackerBeforeFinalize(McoreDist):
    """Megatron-LM's layout with the tracker written as soon as the async save returns, before its
    finalize: what a client does that writes the tracker after save() as after a synchronous save."""

    def save_training(self, ctx, job, directory):
        super().save_training(ctx, job, directory)
        if ctx.is_rank0:
            from harness.backends._megatron_lm import write_tracker

            write_tracker(directory, job.step)


class CorruptAsyncSave(McoreDist):
    """The async save writes rank 0's first main-replica Adam exp_avg shard with one element's top
    mantissa bit flipped (a flipped copy: the live job is untouched); the synchronous twin writes what
    the job holds. An async writer that reads the wrong buffer looks like this. (A flipped model
    weight would not move a resume: the distributed optimizer's load restores the weights from its
    main params.)"""

    def save_state(self, ctx, sharded_state, directory, **kwargs):
        if self.saves_async and ctx.rank == 0:
            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

            sh = next(v for v in nested_values(sharded_state["optimizer"])
                      if isinstance(v, ShardedTensor) and "exp_avg." in v.key and is_main_replica(v.replica_id) and v.data.numel())
            sh.data = sh.data.detach().clone()
            sh.data.view(-1).view(torch.int32)[0] ^= 1 << 22
        super().save_state(ctx, sharded_state, directory, **kwargs)


class SwallowTrainingLoadErrors(McoreDist):
    """A training load that catches every error and returns, the job keeping its decoy state: a resume
    that 'tolerates' an unfinished checkpoint."""

    def load_training(self, ctx, job, directory):
        _swallowing(super().load_training, ctx, job, directory)


class SwallowFinalizeErrors(McoreDist):
    """An async finalize whose errors are dropped: a write killed in flight goes unreported and the job
    carries on as if its checkpoint were saved."""

    def finalize_saves(self, ctx):
        try:
            return super().finalize_saves(ctx)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return []


class ThroughMutationTarget(McoreDist):
    """A correct load, then the first parameter passed through tests/mutation_target.py (`take` of the
    whole of it, written back; `describe` of what was taken): the target of test_mutate.py's campaign,
    where a mutant of that module changes the loaded weights or nothing at all."""

    def load(self, ctx, model, directory):
        import mutation_target

        from harness.models.mcore import as_chunks

        super().load(ctx, model, directory)
        p = next(as_chunks(model)[0].parameters())
        taken = mutation_target.take(p.detach().flatten().tolist(), 0, 1)
        with torch.no_grad():
            p.view(-1).copy_(torch.tensor(taken, dtype=p.dtype))
        mutation_target.describe({"taken": len(taken)})


def merger_swaps_q_and_k() -> None:
    """verl's model_merger writes each layer's q under k's name and k under q's, as a split that took
    the query group's pieces in the wrong order would (patches MegatronModelMerger._split_tensors in
    the merger's ranks)."""
    from verl.model_merger.megatron_model_merger import MegatronModelMerger

    real = MegatronModelMerger._split_tensors

    def _split_tensors(self, key, tensor, config, is_value_model=False):
        parts = real(self, key, tensor, config, is_value_model)
        return [parts[1], parts[0], parts[2]] if len(parts) == 3 else parts

    MegatronModelMerger._split_tensors = _split_tensors


def merger_drops_last_layer_experts() -> None:
    """verl's model_merger leaves out the experts of the model's last layer (the shape of verl #6842's
    partial export), on the rank that merges it (patches MegatronModelMerger._merge_state_dicts)."""
    import re

    from verl.model_merger.megatron_model_merger import MegatronModelMerger

    real = MegatronModelMerger._merge_state_dicts

    def _merge_state_dicts(self, model_state_dict_list):
        merged = real(self, model_state_dict_list)
        last = self.hf_config.num_hidden_layers - 1
        return {k: v for k, v in merged.items() if not re.match(rf"model\.layers\.{last}\.mlp\.experts\.", k)}

    MegatronModelMerger._merge_state_dicts = _merge_state_dicts


def resaved_adapter_loses_alpha() -> None:
    """The HF PEFT adapter verl re-exports after a resume (the lifecycle's second save, global_step_1)
    declares lora_alpha = r: the adapter's scale alpha/r becomes 1 (patches AutoBridge.save_hf_adapter)."""
    from megatron.bridge import AutoBridge

    real = AutoBridge.save_hf_adapter

    def save_hf_adapter(self, model, path, *args, **kwargs):
        out = real(self, model, path, *args, **kwargs)
        config = Path(path) / "adapter_config.json"
        if "global_step_1" in str(path) and config.exists():
            cfg = json.loads(config.read_text())
            cfg["lora_alpha"] = cfg["r"]
            config.write_text(json.dumps(cfg))
        return out

    AutoBridge.save_hf_adapter = save_hf_adapter
