"""The generic CPU spec's experts under TEGroupedMLP's names, for a Bridge that maps only those
(GLM-4.5, EXAONE-MoE, OLMoE, MiniMax-M2): `grouped_expert_names(spec)` turns every SequentialMLP
of a spec into `GroupedNamesMLP` (the same experts, parameters registered as
`experts.linear_fc1.weight<i>` / `linear_fc2.weight<i>`, as TEGroupedMLP's)."""

from __future__ import annotations

from typing import Any

import torch

from harness.models import cpu_spec

_CACHE: dict[str, Any] = {}


def grouped_expert_names(spec: Any) -> Any:
    """Every SequentialMLP of the spec -> GroupedNamesMLP (in place; returned)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    cls = grouped_names_mlp()
    return cpu_spec._walk(spec, lambda v, _p: cls if v is SequentialMLP else v, {})


def grouped_names_mlp() -> type:
    if "grouped" in _CACHE:
        return _CACHE["grouped"]
    from megatron.core.transformer.moe.experts import SequentialMLP

    class _Holder(torch.nn.Module):
        tensor_model_parallel = True

        def __init__(self, partition_dim: int):
            super().__init__()
            self.partition_dim = partition_dim

    class GroupedNamesMLP(SequentialMLP):
        """SequentialMLP (local experts one by one, megatron-core's local path) whose parameters are
        registered under TEGroupedMLP's names, `linear_fc1.weight<i>` / `linear_fc2.weight<i>` (and
        bias<i>): the same Parameter objects, so the forward is SequentialMLP's. For the Bridges that
        map only the grouped names (GLM-4.5, EXAONE-MoE, OLMoE, MiniMax-M2)."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
            experts = self._modules.pop("local_experts")
            object.__setattr__(self, "local_experts", experts)  # kept for forward, off the module tree
            self.linear_fc1, self.linear_fc2 = _Holder(0), _Holder(1)
            for i, e in enumerate(experts):
                for fc in ("linear_fc1", "linear_fc2"):
                    lin = getattr(e, fc)
                    getattr(self, fc).register_parameter(f"weight{i}", lin.weight)
                    if getattr(lin, "bias", None) is not None:
                        getattr(self, fc).register_parameter(f"bias{i}", lin.bias)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """SequentialMLP's (experts.experts.linear_fc1.weight etc., one expert axis: the layout
            TEGroupedMLP also saves), under this module's state-dict names (`linear_fc1.weight<i>`)
            so the loaded dict goes back through load_state_dict; the local experts' `_extra_state`
            (always None on local linears) is left out: the holders have none."""
            import re

            pat = re.compile(re.escape(prefix) + r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
            out = {}
            for key, value in super().sharded_state_dict(prefix, sharded_offsets, metadata).items():
                if m := pat.match(key):
                    out[f"{prefix}{m[2]}.{m[3]}{m[1]}"] = value
                elif not key.startswith(f"{prefix}local_experts."):
                    out[key] = value
            return out

    _CACHE["grouped"] = GroupedNamesMLP
    return GroupedNamesMLP
