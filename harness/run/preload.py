"""Imports paid once in the parent, so forked ranks start in ~1 s instead of ~6 s (~15 s with
the Bridge). Also what the forkserver preloads (harness.run.forkserver_preload)."""

from __future__ import annotations

from typing import Iterable


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


#: distributions whose top-level name is a namespace shared with others: their import name
_NAMESPACED = {"megatron-core": ("megatron.core",), "megatron-bridge": ("megatron.bridge",)}


def modules_of(dist: str) -> list[str]:
    """The importable top-level modules of an installed distribution (empty when it is not installed)."""
    from importlib import metadata

    if dist in _NAMESPACED:
        return list(_NAMESPACED[dist])
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return []
    top = (d.read_text("top_level.txt") or "").split() or sorted(
        {f.parts[0] for f in d.files or [] if f.suffix == ".py" and len(f.parts) > 1 and "." not in f.parts[0]})
    return [t for t in top if t.isidentifier() and not t.startswith("_")]


def import_problems(dists: Iterable[str] = ()) -> dict[str, str]:
    """{module: its import traceback} for megatron.core, megatron.bridge and the modules of `dists`
    (the packages this environment moved from the pins) that do not import here, each tried on its
    own through the guards the cases use. A gate's candidate whose package does not import breaks
    every user; the run records this before any case, and the imports that worked stay warm."""
    import importlib
    import traceback

    from harness.compat.cuda import guard_megatron_import
    from harness.compat.noise import quiet_known_noise
    from harness.compat.te import import_megatron_bridge

    guard_megatron_import()
    quiet_known_noise()
    problems: dict[str, str] = {}
    for name in dict.fromkeys(["megatron.core", "megatron.bridge", *(m for d in sorted(dists) for m in modules_of(d))]):
        try:
            if name.split(".")[:2] == ["megatron", "bridge"]:
                import_megatron_bridge()
            importlib.import_module(name)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - whatever the package raised on import is the finding
            problems[name] = traceback.format_exc()
    return problems
