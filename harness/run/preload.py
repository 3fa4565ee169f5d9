"""Imports paid once in the parent, so forked ranks start in ~1 s instead of ~6 s (~15 s with
the Bridge). Also what the forkserver preloads (harness.run.forkserver_preload)."""

from __future__ import annotations


def warm(bridge: bool = False, modules: tuple[str, ...] = ()) -> None:
    """Import megatron-core (and Megatron-Bridge, transformers and peft for HF cases; and what a
    backend lists in its `preload`, e.g. verl's checkpoint manager, only when a case uses it)."""
    import importlib

    from harness.compat.cuda import guard_megatron_import
    from harness.compat.noise import quiet_known_noise
    from harness.compat.te import import_megatron_bridge

    guard_megatron_import()
    quiet_known_noise()
    if bridge:
        import_megatron_bridge()
        import megatron.bridge.training.checkpointing  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    if any(name.split(".")[:2] == ["megatron", "bridge"] for name in modules):
        import_megatron_bridge()  # a backend's Bridge module (bridge_training) imports only through the TE stand-in
    for name in modules:
        importlib.import_module(name)
