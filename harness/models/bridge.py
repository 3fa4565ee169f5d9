"""Rank side of the Megatron-Bridge cases: build a Bridge model at a topology on CPU, give its
LoRA/DoRA adapters known weights, and hand out raw adapter shards for an independent derivation."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness.core import truth
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec
from harness.models.mcore import FUSIONS
from harness.models.vl import TextOnly, language_model, localize_te_globals

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
CANONICAL_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate", "linear_fc2")
EXPERT_LAYOUTS = ("shared", "per-expert", "shared-outer")  # AdapterSpec.experts
#: AdapterSpec.kind -> the Bridge's PEFT config class, built as users build it and handed where LoRA's goes
ADAPTER_CLASSES = {"lora": ("megatron.bridge.peft.lora", "LoRA"), "canonical_lora": ("megatron.bridge.peft.canonical_lora", "CanonicalLoRA"),
                   "dora": ("megatron.bridge.peft.dora", "DoRA")}
_EXPERT_KW = {"per-expert": {"share_expert_adapters": False}, "shared-outer": {"experts_shared_outer_loras": True}}
_NO_LAYOUT = {("canonical_lora", "shared-outer"), ("dora", "shared-outer"), ("dora", "per-expert")}


@dataclass(frozen=True)
class AdapterSpec:
    kind: str = "lora"  # ADAPTER_CLASSES: lora | canonical_lora | dora
    dim: int = 4
    alpha: int = 8
    targets: tuple[str, ...] = field(default=LORA_TARGETS)
    seed: int = 77
    #: grouped-expert adapter layout (EXPERT_LAYOUTS): the Bridge's default "shared" (one adapter shared by the
    #: experts of an EP rank), "per-expert" (share_expert_adapters=False), "shared-outer" (experts_shared_outer_loras)
    experts: str = "shared"

    def make(self):
        """The Bridge PEFT config (DoRA has no expert-layout fields: the shared layout only)."""
        if self.kind not in ADAPTER_CLASSES or self.experts not in EXPERT_LAYOUTS or (self.kind, self.experts) in _NO_LAYOUT:
            raise ValueError(f"adapter {self.kind!r} with expert layout {self.experts!r}: kinds {sorted(ADAPTER_CLASSES)}, layouts "
                             f"{EXPERT_LAYOUTS} (shared-outer is LoRA's only; DoRA has the shared one only)")
        module, name = ADAPTER_CLASSES[self.kind]
        return getattr(importlib.import_module(module), name)(target_modules=list(self.targets), dim=self.dim, alpha=self.alpha,
                                                              dropout=0.0, **_EXPERT_KW.get(self.experts, {}))


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm with a zero-centered gamma (y = norm(x) * (1 + weight) + bias): what megatron-core's
    `layernorm_zero_centered_gamma` means and transformers' NemotronLayerNorm1P computes. A CPU
    stand-in: megatron-core 0.19.2's local norm (`WrappedTorchNorm`, torch_norm.py) asserts
    `not config.layernorm_zero_centered_gamma` and the fused one needs Apex or Transformer-Engine,
    so the Nemotron provider (which sets it) builds on neither without this."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def zero_centered_local_spec(config, vp_stage: int | None = None):
    """The local layer spec with every norm (input, pre-MLP and the block's final one) a
    ZeroCenteredLayerNorm, as the block submodules of this pipeline stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(normalization="LayerNorm")
    layer.submodules.input_layernorm = ZeroCenteredLayerNorm
    layer.submodules.pre_mlp_layernorm = ZeroCenteredLayerNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=ZeroCenteredLayerNorm)


@dataclass
class BridgeModel:
    bridge: Any
    modules: list  # what the provider returns: one chunk per virtual stage (one without vpp)
    peft: Any = None
    ddp_config: Any = None
    base_path: str = ""
    local_experts_asked: int | None = None  # num_experts / ep for an MoE fixture
    provider: Any = None  # the GPTModelProvider that built `modules`


def build(hf_dir: str | Path, spec: HFModelSpec, topo: Topology, *, load_weights: bool = True,
          adapter: AdapterSpec | None = None, ddp_config=None, dtype: str = "fp32",
          peft_hook: Callable[[Any, Any], Callable] | None = None, first_stage_layers: int = 0) -> BridgeModel:
    """AutoBridge -> provider (local layer spec, fusions off) -> model at this rank.

    `first_stage_layers` > 0: the first pipeline stage holds that many decoder layers, the other
    stages share the rest (megatron-core's num_layers_in_first_pipeline_stage; Megatron-LM's
    --decoder-first-pipeline-num-layers); it means nothing at PP 1.

    Megatron-Bridge's default layer spec is Transformer-Engine's and its finalize() asserts on
    apply_rope_fusion: a CPU build needs the local spec and every fusion off.

    `dtype` bf16 is what the provider itself sets for a bf16 HF config (bf16=True, params_dtype
    bfloat16) plus pipeline_dtype bfloat16, and the model wrapped in megatron-core's Float16Module
    (the provider's default mixed_precision_wrapper), as Megatron-LM's --bf16 builds it.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from harness.compat.attention_env import fresh_attention_env
    from harness.compat.te import import_megatron_bridge
    from harness.models.architectures import HAND_WRITTEN, cpu_layer_spec
    from harness.models.hf import HF_DTYPES
    from harness.models.parallel import rank_device, seed_model_parallel

    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    from harness.models.cpu_gdn import install as gdn_stand_ins

    gdn_stand_ins()  # Core's GatedDeltaNet (Qwen3-Next, Qwen3.5) on CPU where fla is missing
    from harness.models.cpu_mamba import install as mamba_stand_ins

    mamba_stand_ins()  # Core's MambaMixer (Nemotron-H, Falcon-H1) on CPU where mamba_ssm is missing
    seed_model_parallel(spec.seed)
    torch_dtype = HF_DTYPES[dtype]
    # a remote-code family's configuration is the fixture's own file (harness.models.remote): loaded as its users load it
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=torch_dtype, trust_remote_code=bool(getattr(spec, "remote_type", "")))
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    from harness.models.cpu_hybrid import hybrid_stack, stack_spec_field

    if spec_field := stack_spec_field(provider):  # a hybrid Mamba model (Nemotron-H, Falcon-H1): its stack spec on CPU
        layer_spec = hybrid_stack(provider, spec_field)
    else:
        spec_field, layer_spec = "transformer_layer_spec", (
            cpu_layer_spec(provider, grouped_experts=_maps_only_grouped_experts(bridge)) if spec.arch not in HAND_WRITTEN or spec.overrides or getattr(spec, "remote_type", "")  # every other family: its own config's spec
            else zero_centered_local_spec if getattr(provider, "layernorm_zero_centered_gamma", False)
            else get_gpt_layer_local_spec(num_experts=getattr(spec, "num_experts", None), moe_grouped_gemm=False,
                                          qk_layernorm=bool(getattr(provider, "qk_layernorm", False)), normalization="RMSNorm"))
    if getattr(provider, "mtp_num_layers", None):  # Core builds the MTP block from TE's spec provider (gpt_provider.mtp_block_spec)
        from harness.compat.verl import mbridge_te_spec
        from harness.models.cpu_spec import te_spec_cpu_norm

        mbridge_te_spec()  # C2 where TE is absent: TE's names over local modules
        te_spec_cpu_norm()  # with TENorm's zero-centred gamma
    from harness.models.cpu_experts import te_moe_keys

    layer_spec = te_moe_keys(layer_spec)  # MoE layers: the pre-MLP norm under TE's key, as a GPU run saves it
    overrides: dict[str, Any] = {
        "tensor_model_parallel_size": topo.tp, "pipeline_model_parallel_size": topo.pp, "pipeline_dtype": torch_dtype,
        spec_field: layer_spec,
        **{name: False for name in FUSIONS},
    }
    if getattr(provider, "moe_permute_fusion", False):  # TE's fused permutation, set by Nemotron-H's provider even without experts
        overrides["moe_permute_fusion"] = False
    if first_stage_layers and topo.pp > 1:
        overrides["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if topo.vpp > 1:  # one model chunk per virtual stage, wired as Megatron-LM and Bridge's CommOverlapConfig wire it
        from harness.models.mcore import VPP_P2P

        overrides.update(virtual_pipeline_model_parallel_size=topo.vpp, **VPP_P2P)
    if getattr(spec, "num_experts", None):
        # SequentialMLP (local experts one by one): grouped GEMM and permute fusion need TE/CUDA kernels.
        # The provider's alltoall dispatcher stays: harness.compat's shims run it on CPU/gloo.
        overrides.update(expert_model_parallel_size=topo.ep, expert_tensor_parallel_size=topo.etp,
                         moe_grouped_gemm=False, moe_permute_fusion=False)
        if getattr(provider, "moe_token_dispatcher_type", None) == "flex":  # MiniMax-M3: DeepEP/HybridEP, CUDA only
            overrides["moe_token_dispatcher_type"] = "alltoall"
    if getattr(provider, "recompute_granularity", None) and not torch.cuda.is_available():
        # Sarvam's providers recompute selectively (layernorm, moe_act, ...): a training-memory knob that saves nothing.
        # megatron-core's recompute keeps the CUDA RNG state (tensor_parallel/random.py:528) and recomputes the expert
        # activation only inside grouped GEMM, which a CPU build turns off: off here, as every fusion is
        overrides.update(recompute_granularity=None, recompute_modules=None)
    if getattr(spec, "pad_vocab", False):  # the Bridge's default (no padding) otherwise
        overrides["should_pad_vocab"] = True
    peft = None
    if adapter is not None:
        peft = adapter.make()
        # peft_hook(provider, peft): a client's own pre-wrap hook (Bridge's PEFT hook loads the base first)
        provider.register_pre_wrap_hook(peft_hook(provider, peft) if peft_hook else (lambda m: peft(m, training=True)))
        from harness.models.cpu_spec import lora_reads_normed_input  # CPU fused-norm stand-ins: LoRA reads the normed input

        provider.register_pre_wrap_hook(lora_reads_normed_input)
    finalize_provider(provider, torch_dtype, overrides)
    localize_te_globals(provider)  # a VL model's own TE names (its projector's norm) -> CPU stand-ins
    # built where the rank runs (as harness.models.mcore.build_gpt moves its models): on an NCCL rank the
    # provider moves the model to its GPU itself unless told to initialise on CPU (the lent H200 showed
    # every Bridge forward failing on CPU weights with the batch on cuda:0)
    fresh_attention_env()  # the NVTE_* an earlier model of this process wrote (harness.compat.attention_env)
    modules = provider.provide_distributed_model(
        ddp_config=ddp_config, wrap_with_ddp=ddp_config is not None, use_cpu_initialization=rank_device().type == "cpu",
        mixed_precision_wrapper=Float16Module if dtype == "bf16" else None,
    )
    experts = getattr(spec, "num_experts", None)
    return BridgeModel(bridge, modules, peft, ddp_config, str(hf_dir), experts // topo.ep if experts else None, provider)


def validate_first_stage_layers(spec: HFModelSpec, topologies: tuple[Topology, ...], n: int) -> None:
    """ValueError naming option first_stage_layers unless `n` is 0 (even stages) or leaves every other
    stage of each side with PP > 1 the same number of `spec`'s layers (no vpp with it)."""
    if n == 0:
        return
    if n < 0:
        raise ValueError(f"option first_stage_layers must be >= 0 (0: even stages), got {n}")
    sides = [t for t in topologies if t.pp > 1]
    if not sides:
        raise ValueError(f"option first_stage_layers={n} means nothing: no side of {[t.id for t in topologies]} has PP > 1")
    for t in sides:
        rest = spec.num_layers - n
        if t.vpp > 1 or rest < t.pp - 1 or rest % (t.pp - 1):
            raise ValueError(f"option first_stage_layers={n}: {t.id} cannot split the other {rest} of {spec.name}'s "
                             f"{spec.num_layers} layers evenly over its other {t.pp - 1} stage(s) (vpp {t.vpp})")


def _maps_only_grouped_experts(bridge: Any) -> bool:
    """The Bridge maps experts only under TEGroupedMLP's names (`experts.linear_fc1.weight*`), none
    under SequentialMLP's (`experts.local_experts.*`): GLM-4.5, EXAONE-MoE, OLMoE, MiniMax-M2."""
    names = [m.megatron_param for m in bridge._model_bridge.mapping_registry().mappings]
    return any(".experts.linear_fc" in n for n in names) and not any(".local_experts." in n for n in names)


def finalize_provider(provider: Any, dtype: torch.dtype, overrides: dict[str, Any]) -> None:
    """The provider's dtype and fields set as verl sets them (transformer_impl.py): through
    `apply_overrides_and_finalize`, which refuses a field the provider does not have (a bump that
    renames one is an error, never a silently created attribute); a Bridge without it (before 0.5)
    gets the same refusal here, then `finalize()`."""
    if hasattr(provider, "apply_overrides_and_finalize"):
        provider.apply_overrides_and_finalize(dtype=dtype, overrides=overrides)
        return
    unknown = sorted(k for k in overrides if not hasattr(provider, k))
    if unknown:
        raise AttributeError(f"{type(provider).__name__} has no attribute {unknown[0]!r}"
                             + (f" (also: {unknown[1:]})" if unknown[1:] else ""))
    provider.params_dtype, provider.fp16, provider.bf16 = dtype, dtype == torch.float16, dtype == torch.bfloat16
    for name, value in overrides.items():
        setattr(provider, name, value)
    provider.finalize()


def forward_module(bm: BridgeModel, chunk: int = 0):
    """The module a forward pass runs: the DDP wrapper peeled off, Float16Module kept (it casts
    inputs to bf16 on the first stage and logits back to fp32 on the last)."""
    from megatron.core.distributed import DistributedDataParallel

    m = bm.modules[chunk]
    return m.module if isinstance(m, DistributedDataParallel) else m


def unwrapped(bm: BridgeModel, chunk: int | None = None):
    """The bare GPTModel under DDP and Float16Module (whose state dicts delegate without prefix).
    Without `chunk`, the model must be one chunk: a path that reads one would otherwise silently
    miss the other virtual stages' layers."""
    from megatron.core.transformer.module import Float16Module

    if chunk is None:
        if len(bm.modules) > 1:
            raise NotImplementedError(f"this path reads one model chunk; the model has {len(bm.modules)} (vpp): "
                                      "it needs harness.models.bridge.chunks")
        chunk = 0
    m = forward_module(bm, chunk)
    return m.module if isinstance(m, Float16Module) else m


def chunks(bm: BridgeModel) -> list:
    """Every model chunk of this rank, bare (one per virtual pipeline stage; one without vpp): what
    a dist checkpoint of the model holds (harness.models.mcore.sharded_state_dict lays several out
    under `model0`, `model1`, ... as Megatron-LM does)."""
    return [unwrapped(bm, i) for i in range(len(bm.modules))]


def _decoder_of(chunk: Any) -> Any:
    return (language_model(chunk) or chunk).decoder


def _stage_layers_asked(provider: Any) -> int:
    """The decoder layers this pipeline stage should hold: the first stage's `num_layers_in_first_pipeline_stage`
    where set, the rest shared evenly by the other stages; else an even share."""
    from megatron.core import parallel_state as ps

    layers, pp = provider.num_layers, ps.get_pipeline_model_parallel_world_size()
    first = getattr(provider, "num_layers_in_first_pipeline_stage", None)
    if pp == 1 or not first:
        return layers // pp
    return first if ps.get_pipeline_model_parallel_rank() == 0 else (layers - first) // (pp - 1)


def _chunk_offsets(bm: BridgeModel, spec: HFModelSpec) -> list[tuple[Any, int]]:
    """(bare chunk, global number of its first decoder layer) for every chunk of this rank, read from
    the chunk's first TransformerLayer (layer_number is global and 1-based: megatron-core's
    get_transformer_layer_offset for the stage, its vp_stage and an uneven first stage alike)."""
    out = []
    for c in chunks(bm):
        layers = _decoder_of(c).layers
        out.append((c, layers[0].layer_number - 1 if len(layers) else 0))
    return out


def _layer_offset(spec: HFModelSpec) -> int:
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_rank() * (spec.num_layers // parallel_state.get_pipeline_model_parallel_world_size())


_EXPERT = ".experts.local_experts."  # ERNIE-4.5-VL's pools: .mlp.text_moe_layer.experts.local_experts.


def global_name(local: str, offset: int, expert_offset: int = 0) -> str:
    """decoder.layers.<local>.… -> decoder.layers.<global>.… (a VL model's language_model.decoder…, an omni one's
    thinker.language_model.decoder… too),
    and an expert's mlp.experts.local_experts.<local>.… -> its global expert index (EP rank x experts
    per rank + local)."""
    parts = local.split(".")
    at = 2 if parts[:2] == ["thinker", "language_model"] else 1 if parts[:1] == ["language_model"] else 0
    if len(parts) > at + 2 and parts[at] == "decoder" and parts[at + 1] == "layers" and parts[at + 2].isdigit():
        parts[at + 2] = str(int(parts[at + 2]) + offset)
    if _EXPERT in local:
        i = parts.index("local_experts") + 1
        parts[i] = str(int(parts[i]) + expert_offset)
    return ".".join(parts)


def _expert_offset(spec: HFModelSpec) -> int:
    from megatron.core import parallel_state

    experts = getattr(spec, "num_experts", None)
    if not experts:
        return 0
    return parallel_state.get_expert_model_parallel_rank() * (experts // parallel_state.get_expert_model_parallel_world_size())


def _tp_of(name: str) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that splits this parameter: expert-TP for an expert's."""
    from megatron.core import parallel_state as ps

    # a local expert's, or a grouped expert linear's (cpu_experts: experts.linear_fc1 / linear_fc2)
    if _EXPERT in name or ".mlp.experts.linear_fc" in name:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@torch.no_grad()
def fill_adapters(bm: BridgeModel, spec: HFModelSpec, adapter: AdapterSpec) -> int:
    """Give every adapter parameter its truth.adapter_tensor values (non-zero, per TP rank; an
    expert's per expert-TP rank, under its global expert index), a DoRA magnitude truth.magnitude_tensor's."""
    eoffset, n = _expert_offset(spec), 0
    for chunk, offset in _chunk_offsets(bm, spec):
        for name, p in chunk.named_parameters():
            if name.endswith(".weight_magnitude"):  # DoRA: a row-parallel base's is replicated over TP (dora_layers.py)
                tp_rank = 0 if chunk.get_submodule(name.rsplit(".", 1)[0]).input_is_parallel else _tp_of(name)[0]
                p.copy_(truth.magnitude_tensor(adapter.seed, global_name(name, offset, eoffset), tp_rank, tuple(p.shape)))
            elif ".adapter." in name:
                p.copy_(truth.adapter_tensor(adapter.seed, global_name(name, offset, eoffset), _tp_of(name)[0], tuple(p.shape)))
            n += ".adapter." in name
    return n


def adapter_pieces(bm: BridgeModel, spec: HFModelSpec) -> list[dict]:
    """This rank's adapter tensors as they are, with where they sit (global name, (expert-)TP rank); a Mamba
    in_proj's linear_out with its local part sizes from the HF config (peft_mapping.gather's de-interleave)."""
    from harness.models.peft_mapping import mamba_in_proj_parts

    eoffset = _expert_offset(spec)
    out, mamba = [], None
    for chunk, offset in _chunk_offsets(bm, spec):
        for n, p in chunk.named_parameters():
            if ".adapter." in n:
                tp_rank, tp = _tp_of(n)
                piece = {"name": global_name(n, offset, eoffset), "tp_rank": tp_rank, "tp": tp, "data": p.detach().clone().cpu()}
                if "mixer.in_proj.adapter.linear_out." in n:  # Nemotron-H mixer, Falcon-H1 mamba_mixer
                    mamba = mamba or mamba_in_proj_parts(spec)
                    piece["parts"] = tuple(size // tp for size in mamba)
                out.append(piece)
    return out


def ddp_propagation(bm: BridgeModel, asked: dict[str, Any], dtype: str = "fp32") -> list[dict[str, Any]]:
    """Asked DDP knobs vs the built DDP module's ddp_config (verl PR #5775 on the provider path),
    and the precision asked vs the built model's: its parameter dtypes and, for bf16, the
    Float16Module wrapper (a bf16 case that silently built fp32 would prove nothing about bf16)."""
    from megatron.core.transformer.module import Float16Module

    from harness.models.hf import HF_DTYPES

    built = getattr(bm.modules[0], "ddp_config", None)
    records = [
        {"knob": k, "asked": v, "actual": getattr(built, k, "no DDP wrapper"), "ok": getattr(built, k, None) == v}
        for k, v in asked.items()
    ]
    want = str(HF_DTYPES[dtype]).removeprefix("torch.")
    held = sorted({str(p.dtype).removeprefix("torch.") for c in chunks(bm) for p in c.parameters()})
    wrapped = all(isinstance(forward_module(bm, i), Float16Module) for i in range(len(bm.modules)))
    records.append({"knob": "params_dtype", "asked": want, "actual": ",".join(held), "ok": held == [want]})
    records.append({"knob": "Float16Module", "asked": dtype == "bf16", "actual": wrapped, "ok": wrapped == (dtype == "bf16")})
    vpp = getattr(bm.provider, "virtual_pipeline_model_parallel_size", None) or 1
    records.append({"knob": "model chunks (vpp)", "asked": vpp, "actual": len(bm.modules), "ok": len(bm.modules) == vpp})
    if bm.provider is not None:  # the stage holds the layers asked (an uneven first stage really built)
        want, held = _stage_layers_asked(bm.provider), sum(len(_decoder_of(c).layers) for c in chunks(bm))
        records.append({"knob": "decoder layers on this stage", "asked": want, "actual": held, "ok": held == want})
    if bm.local_experts_asked is not None:  # the provider really split the experts over EP
        import re

        # SequentialMLP's local_experts.<i>.*, or TEGroupedMLP's names linear_fc1.weight<i> (cpu_experts.GroupedNamesMLP)
        pat = re.compile(r"layers\.\d+\.mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc1\.weight(\d+)$)")
        local = {m.group(1) or m.group(2) for c in chunks(bm) for n, _ in c.named_parameters() if (m := pat.search(n))}
        # a stage of dense layers only (the dense first layer of DeepSeek-style families on an uneven first stage) holds none
        moe_here = bool(local) or any(".mlp.router." in n for c in chunks(bm) for n, _ in c.named_parameters())
        asked = bm.local_experts_asked if moe_here else 0
        records.append({"knob": "local experts (num_experts/ep)" if moe_here else "local experts (no MoE layer on this stage)",
                        "asked": asked, "actual": len(local), "ok": len(local) == asked})
    return records


def megatron_logits(bm: BridgeModel, spec: HFModelSpec, device) -> torch.Tensor | None:
    from harness.models.mcore import forward_logits

    if len(bm.modules) > 1:  # vpp: every chunk through the interleaved schedule (a VL model's each behind TextOnly)
        module = [forward_module(bm, i) for i in range(len(bm.modules))]
        module = [TextOnly(m) for m in module] if language_model(unwrapped(bm, 0)) is not None else module
    else:
        module = forward_module(bm)
        if language_model(unwrapped(bm)) is not None:  # a VL model: keyword forward, text tokens alone (harness.models.vl)
            module = TextOnly(module)
    logits = forward_logits(module, truth.hf_batch(spec), device)
    # a padded vocab (spec.pad_vocab) adds columns no token maps to; transformers has none
    return None if logits is None else logits[..., : spec.vocab_size].contiguous()


def adapter_state(bm: BridgeModel) -> dict:
    """The adapter-only sharded state dict, filtered with the Bridge's own
    apply_peft_adapter_filter_to_state_dict, as verl saves PEFT checkpoints."""
    from megatron.bridge.training.checkpointing import (
        apply_peft_adapter_filter_to_state_dict,
    )

    if len(bm.modules) == 1:
        return apply_peft_adapter_filter_to_state_dict({"model": unwrapped(bm).sharded_state_dict()}, bm.peft)
    # vpp: one section per chunk, as Bridge's generate_state_dict lays them out (and the filter knows)
    return apply_peft_adapter_filter_to_state_dict({f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks(bm))},
                                                   bm.peft)


def load_adapter_state(bm: BridgeModel, state: dict) -> None:
    """Put a loaded `adapter_state(bm)`-shaped state into the model (non-strict: the base is not in it). A stage
    holding no adapter (Nemotron-H's first stage of Mamba layers only) has no section: the filter drops it."""
    if len(bm.modules) == 1:
        unwrapped(bm).load_state_dict(state.get("model", {}), strict=False)
        return
    for i, c in enumerate(chunks(bm)):
        c.load_state_dict(state.get(f"model{i}", {}), strict=False)
