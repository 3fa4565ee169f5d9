"""CPU stand-in C2 for megatron-core's Transformer-Engine layer spec, which mbridge (verl's vanilla
bridge) builds and whose fused names its maps read (`linear_qkv.layer_norm_weight`): megatron-core's
local modules with the input norm folded into the column-parallel linear under TE's parameter
names. Applied on demand (compat.verl.MBRIDGE_TE_SPEC) and only without TE; tests/test_mbridge.py
proves it against transformers' logits at tp1 and tp2."""

from __future__ import annotations

import torch

from harness.compat._shim import Shim

#: no records here (harness.compat.registry's convention: every compat module lists its own)
SHIMS: tuple[Shim, ...] = ()


def _norm_linear_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        """TE's LayerNormColumnParallelLinear on CPU: the input norm (RMSNorm or LayerNorm, zero-centered
        gamma as configured) as parameters `layer_norm_weight` (+ `layer_norm_bias`), replicated over TP
        like TE's, then megatron-core's ColumnParallelLinear."""

        def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                     skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                     tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1, name: str | None = None):
            super().__init__(input_size, output_size, config=config, init_method=init_method, gather_output=gather_output,
                             bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                             skip_weight_param_allocation=skip_weight_param_allocation,
                             tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, stride=stride)
            self.rms = config.normalization == "RMSNorm"
            self.zero_centered = bool(config.layernorm_zero_centered_gamma)
            self.eps = config.layernorm_epsilon
            init = torch.zeros if self.zero_centered else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = None if self.rms else torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:
                    setattr(p, "sequence_parallel", config.sequence_parallel)

        def forward(self, x, *args, **kwargs):
            w = self.layer_norm_weight + 1 if self.zero_centered else self.layer_norm_weight
            if self.rms:
                x = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, self.eps)
            else:
                x = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, self.layer_norm_bias, self.eps)
            return super().forward(x, *args, **kwargs)

        @property
        def tp_size(self) -> int:
            """TE's linears keep their TP size as `tp_size` (megatron-core's do not); Megatron-Bridge's
            Mamba LoRA reads it off the wrapped in_proj (peft/adapter_wrapper.py:55)."""
            return self.tp_group.size()

    return NormColumnParallelLinear


def _te_norm_class() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class TENormStandIn:
        """TENorm on CPU: torch's norm (WrappedTorchNorm), which refuses `persist_layer_norm`. TE takes
        it (a choice of kernel, the same numbers), and verl's MoE configs set it (config_converter.py)."""

        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            if config.persist_layer_norm:
                import copy

                config = copy.copy(config)
                config.persist_layer_norm = False
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)

    return TENormStandIn


def install_te_spec_stand_in() -> None:
    """Point megatron-core's TE spec builder at local modules under TE's names (see the module doc)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.models.backends import LocalSpecProvider

    norm_linear, norm = _norm_linear_class(), _te_norm_class()

    class LocalTESpecProvider(LocalSpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
            return norm

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return norm_linear

    specs.TESpecProvider = LocalTESpecProvider
    specs.TENorm = norm  # the block's final norm
