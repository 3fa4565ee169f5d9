"""CPU builds of the hybrid models' specs: megatron-core's gated-DeltaNet hybrid block (Qwen3-Next, Qwen3.5),
which asserts Transformer-Engine, and the Mamba-2 hybrid stacks (Nemotron-H, Falcon-H1), every TE class
swapped for harness.models.cpu_spec's stand-ins under TE's names."""

from __future__ import annotations

from typing import Any

from harness.models.cpu_spec import Norm, _copy_tree, local_te_spec_provider, localize, localize_globals

#: megatron-core's hybrid block spec (gated DeltaNet / standard attention per layer), TE-only by assertion
HYBRID_BLOCK_SPEC = "get_transformer_block_with_experimental_attention_variant_spec"


def hybrid_block(config, vp_stage: int | None = None):
    """Core's `get_transformer_block_with_experimental_attention_variant_spec` on CPU (it asserts
    transformer_impl "transformer_engine" first): the per-layer specs from Core's own
    `get_transformer_layer_with_experimental_attention_variant_spec`, given a backend of local modules
    under TE's names (`_LocalTEBackend`), sliced to this stage's layers and closed with a CPU norm as
    the block function does. Its standard-attention layers come from
    `get_gpt_layer_with_transformer_engine_spec`, which instantiates gpt_layer_specs' own TESpecProvider
    (None without TE): that name points at the same backend for the duration of the call only. The
    gated DeltaNet's kernels: harness.models.cpu_gdn."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    with local_te_spec_provider() as backend:
        layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend())
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = layers[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=Norm)


#: A hybrid provider's stack-spec field -> the Core/Bridge module whose block builds its final norm from TENorm itself
STACK_SPEC_FIELDS = {"hybrid_stack_spec": "megatron.core.models.hybrid.hybrid_block",  # Nemotron-H (HybridModelProvider)
                     "falconh1_stack_spec": "megatron.bridge.models.falcon_h1.modeling_falconh1.falconh1_block"}  # Falcon-H1


def stack_spec_field(provider: Any) -> str | None:
    """The stack-spec field of a hybrid (Mamba) provider, None for a GPT provider (`transformer_layer_spec`)."""
    return next((f for f in STACK_SPEC_FIELDS if hasattr(provider, f)), None)


def hybrid_stack(provider: Any, field: str = "hybrid_stack_spec"):
    """A hybrid provider's stack spec on CPU (Nemotron-H, Falcon-H1): the one the provider would build (its
    own spec or spec function, else Bridge's default for its config), every TE class localized; its Mamba
    mixer runs on harness.models.cpu_mamba's kernels where mamba_ssm is missing."""
    import inspect

    own = getattr(provider, field)
    if own is None:
        from megatron.bridge.models.hybrid.hybrid_provider import get_default_hybrid_stack_spec

        own = get_default_hybrid_stack_spec(provider)
    elif callable(own) and not hasattr(own, "module"):  # a spec function, with or without the provider
        own = own(provider) if inspect.signature(own).parameters else own()
    import importlib

    localize_globals(importlib.import_module(STACK_SPEC_FIELDS[field]))  # the block builds its final norm from TENorm itself
    return localize(_copy_tree(own), lenient=True)
