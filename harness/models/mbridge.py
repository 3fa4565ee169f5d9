"""verl's vanilla bridge path (verl engine option `vanilla_mbridge`; verl_manager option `bridge: vanilla`):
a model built with the separate `mbridge` package exactly as verl's Megatron engine builds it.

verl (workers/engine/megatron/transformer_impl.py, `_build_tf_config` and `_build_megatron_module`)
makes `mbridge.AutoBridge.from_config(hf_config, dtype)`, passes its override_transformer_config to
`set_extra_args`, builds the chunks with `verl.utils.megatron_utils.make_megatron_module(bridge=...,
provider=None)` (-> `bridge.get_model`) and fills them with `bridge.load_weights(model, hf_path)`. Its
checkpoint manager then writes and reads the HF tree with `bridge.save_weights` / `load_weights`:
mbridge's own name maps and TP split/merge, not Megatron-Bridge's.

mbridge builds megatron-core's Transformer-Engine layer spec, whose norms are fused into linear_qkv
and linear_fc1 (parameters `...linear_qkv.layer_norm_weight`), and its name maps expect those names.
Transformer-Engine does not install on CPU, so there `TESpecProvider` is None; the on-demand shim
`compat.MBRIDGE_TE_SPEC` (a record of compat.verl.SHIMS) sets it to `LocalTESpecProvider` (harness.compat.te_spec): megatron-core's local modules, with the
norm folded into the column-parallel linear under TE's parameter names (the checkpoint keys are the
same either way: the local spec maps `input_layernorm.` to `self_attention.linear_qkv.layer_norm_`).
With TE installed nothing is replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec

#: HF model types mbridge 0.15.1 registers (mbridge/models) that the zoo has fixtures of
MBRIDGE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def build(hf_dir: str | Path, spec: HFModelSpec, topo: Topology, *, load_weights: bool = True, ddp_config=None):
    """mbridge AutoBridge -> verl's make_megatron_module -> the model at this rank (a
    harness.models.bridge.BridgeModel with provider None, which is how verl's manager tells the vanilla path).

    The override_transformer_config is what a CPU run of verl needs: CPU initialisation, every fusion
    off, and sequence_parallel off (mbridge turns it on for TP > 1; gloo has no reduce-scatter of the
    kind it uses), as a verl user would set `override_transformer_config`."""
    from transformers import AutoConfig
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    from harness.models.bridge import BridgeModel
    from harness.models.mcore import FUSIONS
    from harness.models.parallel import seed_model_parallel

    if topo.vpp > 1 or topo.ep > 1 or topo.cp > 1:
        raise ValueError(f"the vanilla mbridge path is built here at TP/PP/DP only, got {topo.id}")
    from harness.models.cpu_experts import te_spec_grouped_experts

    te_spec_grouped_experts()  # the CPU TE spec's experts under TE's grouped names, which mbridge maps
    seed_model_parallel(spec.seed)
    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
    bridge.set_extra_args(use_cpu_initialization=not torch.cuda.is_available(), sequence_parallel=False,
                          **{f: False for f in FUSIONS})
    tf_config = bridge.config
    tf_config.fp16 = tf_config.bf16 = False  # verl: param_dtype float32
    wrap = McoreModuleWrapperConfig(wrap_with_ddp=ddp_config is not None,
                                    use_distributed_optimizer=bool(getattr(ddp_config, "use_distributed_optimizer", False)))
    override_ddp = {"grad_reduce_in_fp32": True}  # verl's _resolve_override_ddp_config for a conventional optimizer
    for knob in ("overlap_grad_reduce", "overlap_param_gather", "bucket_size"):
        if ddp_config is not None and getattr(ddp_config, knob, None):
            override_ddp[knob] = getattr(ddp_config, knob)
    modules, _ = make_megatron_module(wrap_config=wrap, tf_config=tf_config, hf_config=hf_config, bridge=bridge,
                                      provider=None, override_ddp_config=override_ddp)
    if load_weights:
        bridge.load_weights(modules, str(hf_dir))
    return BridgeModel(bridge, modules, None, ddp_config, str(hf_dir), None, provider=None)


def hf_config_of(bridge: Any):
    """The HF config either bridge flavour carries (mbridge: .hf_config; Megatron-Bridge: .hf_pretrained.config)."""
    return getattr(bridge, "hf_config", None) or bridge.hf_pretrained.config
