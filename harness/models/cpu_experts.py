"""The generic CPU spec's experts as megatron-core's TEGroupedMLP over CPU grouped linears, for a
Bridge that maps experts only under TEGroupedMLP's names (GLM-4.5, EXAONE-MoE, OLMoE, MiniMax-M2):
`grouped_expert_names(spec)` turns every SequentialMLP of a spec into `GroupedNamesMLP`.

GroupedNamesMLP is megatron-core's own TEGroupedMLP (its forward, activation, probs and bias
handling, its sharded_state_dict: one expert axis, the keys SequentialMLP also saves) built with
`GroupedColumnLinear` / `GroupedRowLinear` in place of TE's TEColumnParallelGroupedLinear /
TERowParallelGroupedLinear (megatron/core/extensions/transformer_engine.py). The stand-ins keep
what the Bridge and its LoRA read of TE's: parameters `weight<i>` / `bias<i>`, forward
`(x, m_splits) -> (out, bias)` (bias a per-expert list when skip_bias_add), in/out_features per
expert-TP partition, `explicit_expert_comm` and `parallel_mode` None when the MoE dispatcher owns
the communication. They subclass megatron-core's Column/RowParallelLinear because Bridge's
`get_adapter_attributes_from_linear` (peft/utils.py:622-629) recognizes exactly those without TE
(its TE branches read the TE classes, absent here): LoRA then wraps linear_fc1/linear_fc2 with one
ParallelLinearAdapter per module shared by the local experts, as it wraps TE's grouped linears on GPU.
"""

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


def grouped_linears() -> tuple[type, type]:
    """(GroupedColumnLinear, GroupedRowLinear): TE's grouped expert linears on CPU."""
    if "linears" in _CACHE:
        return _CACHE["linears"]
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class _Grouped:
        """What TEGroupedLinear holds and computes (transformer_engine.py:2106-2510), on CPU."""

        parallel: str = ""  # "column" | "row"
        # no `_extra_state` (Column/RowParallelLinear define one; TE's grouped linears keep FP8 state there,
        # which TEGroupedMLP checkpoints per expert): torch's own hooks leave it out of the state dict
        get_extra_state = torch.nn.Module.get_extra_state
        set_extra_state = torch.nn.Module.set_extra_state

        def _grouped_init(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                          skip_bias_add: bool, is_expert: bool, pg_collection=None, **_):
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.core.utils import divide, get_pg_size

            torch.nn.Module.__init__(self)
            if not is_expert:
                raise ValueError("a grouped linear is an expert linear (TEGroupedLinear asserts is_expert)")
            self.config, self.num_gemms, self.is_expert = config, num_gemms, True
            self._pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
            self._tp_group = self.tp_group = self._pg_collection.expt_tp
            tp = get_pg_size(self._tp_group)
            self.input_size, self.output_size = input_size, output_size  # full sizes, as ColumnParallelLinear's
            self.explicit_expert_comm = tp > 1 or config.expert_model_parallel_size > 1
            self.parallel_mode = None if self.explicit_expert_comm else self.parallel
            self.in_features = divide(input_size, tp) if self.parallel == "row" else input_size
            self.out_features = divide(output_size, tp) if self.parallel == "column" else output_size
            self.use_bias, self.skip_bias_add, self.te_return_bias = bias, skip_bias_add, skip_bias_add and bias
            self.tensor_model_parallel, self.partition_dim = True, 0 if self.parallel == "column" else 1
            dtype = config.params_dtype
            for i in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype))
                if config.perform_initialization:
                    init_method(w)
                self.register_parameter(f"weight{i}", w)
                if bias:
                    self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype)))
            # marked once registered, as TE marks them (_set_expert_parameter_attributes over named_parameters):
            # a registration hook (accelerate's init_empty_weights) rebuilds a Parameter with its attributes as keywords
            for name, p in self.named_parameters(recurse=False):
                self._mark(p, partitioned=name.startswith("weight") or self.parallel == "column")

        def _mark(self, p: torch.nn.Parameter, partitioned: bool) -> None:
            """TE's _set_expert_parameter_attributes: expert-DP gradients, TP partition metadata."""
            p.allreduce = False
            p.tensor_model_parallel = partitioned
            if partitioned:
                p.partition_dim, p.partition_stride = self.partition_dim, 1

        def forward(self, x: torch.Tensor, m_splits: list[int], *_, **__):
            weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None
            outs = []
            for i, part in enumerate(torch.split(x, list(m_splits))):
                out = torch.nn.functional.linear(part, weights[i])
                outs.append(out + biases[i] if biases is not None and not self.te_return_bias else out)
            out = torch.cat(outs) if outs else x.new_zeros(0, self.out_features)
            return out, (biases if self.te_return_bias else None)

        def backward_dw(self) -> None:
            return None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
            """TE's _sharded_state_dict_grouped without FP8 extra state: per expert `weight<i>` under
            the key `<prefix>weight` with the global expert axis; replica ids over expert-DP."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
            from megatron.core.utils import get_pg_rank, get_pg_size

            pgs = self._pg_collection
            experts, first = get_pg_size(pgs.ep) * self.num_gemms, get_pg_rank(pgs.ep) * self.num_gemms
            axis = {f"{i}.{k}": (0 if self.parallel == "column" else 1) for i in range(self.num_gemms) for k in ("weight", "bias")
                    if k == "weight" or self.parallel == "column"}
            out = {}
            for i in range(self.num_gemms):
                state = {f"{i}.weight": getattr(self, f"weight{i}")}
                if self.use_bias:
                    state[f"{i}.bias"] = getattr(self, f"bias{i}")
                offsets = (*sharded_offsets, (len(sharded_offsets), first + i, experts))
                sub = make_sharded_tensors_for_checkpoint(state, "", axis, offsets, tp_group=self._tp_group,
                                                          dp_cp_group=(metadata or {}).get("dp_cp_group"))
                for k, sh in sub.items():
                    sh.key = f"{prefix}{k.split('.', 1)[1]}"
                    sh.replica_id = (*sh.replica_id[:2], get_pg_rank(pgs.expt_dp))
                    out[f"{prefix}{k.split('.', 1)[1]}{i}"] = sh
            return out

    class GroupedColumnLinear(_Grouped, ColumnParallelLinear):
        """TEColumnParallelGroupedLinear on CPU (expert fc1: output split over expert-TP)."""

        parallel = "column"

        def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
            self._grouped_init(num_gemms, input_size, output_size, **kwargs)


    class GroupedRowLinear(_Grouped, RowParallelLinear):
        """TERowParallelGroupedLinear on CPU (expert fc2: input split over expert-TP, bias replicated)."""

        parallel = "row"

        def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
            self._grouped_init(num_gemms, input_size, output_size, **kwargs)


    _CACHE["linears"] = (GroupedColumnLinear, GroupedRowLinear)
    return _CACHE["linears"]


def grouped_names_mlp() -> type:
    """GroupedNamesMLP: megatron-core's TEGroupedMLP over the CPU grouped linears."""
    if "grouped" in _CACHE:
        return _CACHE["grouped"]
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    import inspect

    column, row = grouped_linears()
    # megatron-core 0.19 gives experts a `name` (TEGroupedMLP.__init__'s keyword); 0.17 has none: pass it only where
    # the installed class takes it (can go when the oldest Core the gate sweeps takes `name`)
    takes_name = "name" in inspect.signature(TEGroupedMLP.__init__).parameters

    class GroupedNamesMLP(TEGroupedMLP):
        """TEGroupedMLP with GroupedColumnLinear / GroupedRowLinear: whatever submodules the spec
        gave (SequentialMLP's MLPSubmodules) are replaced by the grouped linears."""

        def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, name=None):
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
            super().__init__(num_local_experts, config, GroupedMLPSubmodules(linear_fc1=column, linear_fc2=row),
                             pg_collection=pg_collection, **({"name": name} if takes_name else {}))

    _CACHE["grouped"] = GroupedNamesMLP
    return GroupedNamesMLP


def te_spec_grouped_experts() -> bool:
    """Where harness.compat.te_spec stands in for TE's spec provider (mbridge, verl's model merger):
    grouped-GEMM experts as TESpecProvider gives them, TEGroupedMLP under `weight<i>` names
    (GroupedNamesMLP), not the local provider's SequentialMLP (`local_experts.<i>.`), whose names
    neither mbridge nor verl's merger maps. False where no stand-in is installed (real TE)."""
    from functools import partial

    from megatron.core.models.backends import LocalSpecProvider

    mlp = grouped_names_mlp()

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        return partial(mlp) if moe_use_grouped_gemm else LocalSpecProvider.grouped_mlp_modules(self, moe_use_grouped_gemm)

    return cpu_spec.extend_te_stand_in("grouped_experts", grouped_mlp_modules=grouped_mlp_modules)


def te_moe_keys(spec: Any) -> Any:
    """A CPU layer spec whose MoE layers save their pre-MLP norm under Transformer-Engine's key.

    megatron-core's local spec files `pre_mlp_layernorm.` under `mlp.linear_fc1.layer_norm_`, TE's
    fused dense-MLP name, on every layer (gpt_layer_specs.py:459-462), MoE layers too; TE's MoE layer
    keeps `pre_mlp_layernorm.weight` (:157, no such map), and so does every checkpoint of a GPU run. Without
    this, a CPU-saved MoE checkpoint does not load into a TE-spec model (verl's model merger builds one).
    A spec given as a function of the config (cpu_layer_spec's) is wrapped."""
    if callable(spec) and not hasattr(spec, "submodules"):
        import functools

        @functools.wraps(spec)  # its signature too: the provider passes vp_stage only to a spec function that takes it
        def wrapped(*args, **kwargs):
            return te_moe_keys(spec(*args, **kwargs))

        return wrapped
    from megatron.core.transformer.moe.moe_layer import MoELayer

    sub = getattr(spec, "submodules", None)
    layers = [spec] if hasattr(sub, "mlp") else getattr(sub, "layer_specs", None) or getattr(spec, "layer_specs", None) or []
    for layer in layers:
        sub = layer.submodules
        keys = getattr(sub, "sharded_state_dict_keys_map", None) or {}
        mlp = getattr(sub.mlp, "module", None) or getattr(sub.mlp, "func", None)  # a ModuleSpec, or Core 0.19's partial
        if mlp is MoELayer and keys.get("pre_mlp_layernorm.") == "mlp.linear_fc1.layer_norm_":
            sub.sharded_state_dict_keys_map = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
    return spec
