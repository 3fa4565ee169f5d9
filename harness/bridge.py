"""Rank side of the Megatron-Bridge cases: build a Bridge model at a topology on CPU, give its
LoRA adapters known weights, and hand out raw adapter shards for an independent derivation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import truth
from harness.models import FUSIONS
from harness.topology import Topology
from harness.zoo import HFModelSpec

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
CANONICAL_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate", "linear_fc2")


@dataclass(frozen=True)
class AdapterSpec:
    kind: str = "lora"  # lora | canonical_lora
    dim: int = 4
    alpha: int = 8
    targets: tuple[str, ...] = field(default=LORA_TARGETS)
    seed: int = 77

    def make(self):
        if self.kind == "lora":
            from megatron.bridge.peft.lora import LoRA

            return LoRA(target_modules=list(self.targets), dim=self.dim, alpha=self.alpha, dropout=0.0)
        if self.kind == "canonical_lora":
            from megatron.bridge.peft.canonical_lora import CanonicalLoRA

            return CanonicalLoRA(target_modules=list(self.targets), dim=self.dim, alpha=self.alpha, dropout=0.0)
        raise ValueError(f"adapter kind must be lora or canonical_lora, got {self.kind!r}")


@dataclass
class BridgeModel:
    bridge: Any
    modules: list  # what the provider returns: one chunk per virtual stage (one here)
    peft: Any = None
    ddp_config: Any = None
    base_path: str = ""


def build(hf_dir: str | Path, spec: HFModelSpec, topo: Topology, *, load_weights: bool = True,
          adapter: AdapterSpec | None = None, ddp_config=None) -> BridgeModel:
    """AutoBridge -> provider (local layer spec, fp32, fusions off) -> model at this rank.

    Megatron-Bridge's default layer spec is Transformer-Engine's and its finalize() asserts on
    apply_rope_fusion: a CPU build needs the local spec and every fusion off.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harness.compat import import_megatron_bridge, seed_model_parallel

    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    seed_model_parallel(spec.seed)
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.tensor_model_parallel_size = topo.tp
    provider.pipeline_model_parallel_size = topo.pp
    provider.transformer_layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    for name in FUSIONS:
        setattr(provider, name, False)
    provider.params_dtype = torch.float32
    provider.pipeline_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    if getattr(spec, "pad_vocab", False):  # the Bridge's default (no padding) otherwise
        provider.should_pad_vocab = True
    peft = None
    if adapter is not None:
        peft = adapter.make()
        provider.register_pre_wrap_hook(lambda m: peft(m, training=True))
    provider.finalize()
    modules = provider.provide_distributed_model(
        ddp_config=ddp_config, wrap_with_ddp=ddp_config is not None, use_cpu_initialization=True, mixed_precision_wrapper=None
    )
    return BridgeModel(bridge, modules, peft, ddp_config, str(hf_dir))


def unwrapped(bm: BridgeModel):
    m = bm.modules[0]
    return getattr(m, "module", m)


def _layer_offset(spec: HFModelSpec) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank() * (spec.num_layers // parallel_state.get_pipeline_model_parallel_world_size())


def global_name(local: str, offset: int) -> str:
    """decoder.layers.<local>.… -> decoder.layers.<global>.…"""
    parts = local.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers" and parts[2].isdigit():
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


@torch.no_grad()
def fill_adapters(bm: BridgeModel, spec: HFModelSpec, adapter: AdapterSpec) -> int:
    """Give every adapter parameter its truth.adapter_tensor values (non-zero, per TP rank)."""
    from megatron.core import parallel_state

    offset, tp_rank, n = _layer_offset(spec), parallel_state.get_tensor_model_parallel_rank(), 0
    for name, p in unwrapped(bm).named_parameters():
        if ".adapter." in name:
            p.copy_(truth.adapter_tensor(adapter.seed, global_name(name, offset), tp_rank, tuple(p.shape)))
            n += 1
    return n


def adapter_pieces(bm: BridgeModel, spec: HFModelSpec) -> list[dict]:
    """This rank's adapter tensors as they are, with where they sit (global name, TP rank)."""
    from megatron.core import parallel_state

    offset = _layer_offset(spec)
    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    return [
        {"name": global_name(n, offset), "tp_rank": tp_rank, "tp": tp, "data": p.detach().clone().cpu()}
        for n, p in unwrapped(bm).named_parameters()
        if ".adapter." in n
    ]


def ddp_propagation(bm: BridgeModel, asked: dict[str, Any]) -> list[dict[str, Any]]:
    """Asked DDP knobs vs the built DDP module's ddp_config (verl PR #5775 on the provider path)."""
    built = getattr(bm.modules[0], "ddp_config", None)
    return [
        {"knob": k, "asked": v, "actual": getattr(built, k, "no DDP wrapper"), "ok": getattr(built, k, None) == v}
        for k, v in asked.items()
    ]


def megatron_logits(bm: BridgeModel, spec: HFModelSpec, device) -> torch.Tensor | None:
    from harness.models import forward_logits

    logits = forward_logits(unwrapped(bm), truth.hf_batch(spec), device)
    # a padded vocab (spec.pad_vocab) adds columns no token maps to; transformers has none
    return None if logits is None else logits[..., : spec.vocab_size].contiguous()


def adapter_state(bm: BridgeModel) -> dict:
    """The adapter-only sharded state dict, filtered with the Bridge's own
    apply_peft_adapter_filter_to_state_dict, as verl saves PEFT checkpoints."""
    from megatron.bridge.training.checkpointing import apply_peft_adapter_filter_to_state_dict

    return apply_peft_adapter_filter_to_state_dict({"model": unwrapped(bm).sharded_state_dict()}, bm.peft)
