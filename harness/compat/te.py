"""Transformer-Engine absent: the stand-in Megatron-Bridge's import needs, and `import_megatron_bridge`.

Megatron-Bridge imports `transformer_engine.pytorch` unguarded (0.6.2 in peft/lora_layers.py, reading
Linear, LayerNormLinear and ops.*; 0.5.1 also in peft/lora.py, and GroupedLinear) and uses those
names only in isinstance checks and signatures. Which modules import it unguarded is found by the
import's own error (`import_with_stand_in`), not listed per release. The stand-in answers ANY name under `transformer_engine` with an inert type
that nothing is an instance of (a fresh class per name, cached; attributes of those classes and
submodules answer the same way), but only to import statements of the modules named
(`te_stand_in`), and never through sys.modules: megatron-core's own TE detection still finds TE
absent. Both Bridge shims are probed (TE not importable; Bridge's HAVE_TE flags True without TE)
and recorded by every case that imports the Bridge through `import_megatron_bridge`, not by
whichever case imported it first.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Iterator

from harness.compat._shim import ADAPTS, CALLER, Shim, note

TE_STUB = "transformer_engine stub for megatron.bridge's unguarded imports"
HAVE_TE_FALSE = "megatron.bridge peft HAVE_TE=False"
STUB_MODULE = "(ckpt-harness TE stand-in)"
_bridge_shims: list[str] = []  # what this process's Bridge import applied (a forked rank inherits it)


def te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class _StubType(type):
    """The stand-in types' metaclass: any public attribute of a stand-in type is another stand-in
    type (`transformer_engine.pytorch.ops.Sequential` when `ops` was read as an attribute)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_type(f"{cls.__qualname__}.{name}", cls.__module__)


_types: dict[str, type] = {}


def _stub_type(qualname: str, module: str) -> type:
    key = f"{module}:{qualname}"
    if key not in _types:
        # a plain class: isinstance(x, it) is False for anything not built from it
        _types[key] = _StubType(qualname.rpartition(".")[2], (), {"__module__": module, "__qualname__": qualname,
                                                                  "__doc__": STUB_MODULE})
    return _types[key]


class StubModule(types.ModuleType):
    """A `transformer_engine*` module of the stand-in: every public name is a stand-in type."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_type(name, self.__name__)


def is_stub(obj: object) -> bool:
    return isinstance(obj, (StubModule, _StubType))


@contextmanager
def te_stand_in(importers: tuple[str, ...]) -> Iterator[dict[str, StubModule]]:
    """While open, `import transformer_engine...` (any submodule, any name) made by a module in
    `importers` gets stand-in modules; they never enter sys.modules, so every other import of
    transformer_engine (megatron-core's and Bridge's TE detection) still fails as it should, even
    while the importers import. Yields the stand-in modules served, by name."""
    import builtins

    original = builtins.__import__
    served: dict[str, StubModule] = {}

    def module(name: str) -> StubModule:
        if name not in served:
            served[name] = StubModule(name, STUB_MODULE)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(module(parent), child, served[name])
        return served[name]

    def stand_in_import(name, globals=None, locals=None, fromlist=(), level=0):
        if (level == 0 and (name == "transformer_engine" or name.startswith("transformer_engine."))
                and (globals or {}).get("__name__") in importers):
            mod = module(name)  # and its parents
            return mod if fromlist else served["transformer_engine"]
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = stand_in_import
    try:
        yield served
    finally:
        builtins.__import__ = original


def _force_have_te_false() -> bool:
    import megatron.bridge.peft.module_matcher as matcher
    import megatron.bridge.peft.utils as peft_utils

    flags = [(peft_utils, "HAVE_TE")] + [(matcher, f) for f in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR",
                                                                 "HAVE_TE_ROW_LINEAR")]
    wrong = [(m, f) for m, f in flags if getattr(m, f, False) is True]
    for module, flag in wrong:
        setattr(module, flag, False)
    return bool(wrong)


#: Bridge modules the harness itself imports (LoRA): imported while the stand-in is open, so the
#: ones that read TE at import time get it then, whichever release they come from
_BRIDGE_MODULES = ("megatron.bridge", "megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")


def _te_importer(exc: ModuleNotFoundError, root: str) -> str | None:
    """The module of package `root` whose import statement raised `exc` for transformer_engine."""
    if not (exc.name or "").startswith("transformer_engine"):
        return None
    tb, found = exc.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name == root or name.startswith(root + "."):
            found = name
        tb = tb.tb_next
    return found


def _forget(root: str) -> None:
    for name in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
        del sys.modules[name]


def import_with_stand_in(modules: tuple[str, ...] = _BRIDGE_MODULES) -> dict[str, StubModule]:
    """Import the Bridge, serving the stand-in to exactly the modules that import TE unguarded: an
    import that fails on transformer_engine names its module (the error is the probe), which joins
    the importers, and the Bridge is imported again. A release that reads other TE names, or from
    other modules, imports without a harness change."""
    root = modules[0]
    importers: list[str] = []
    for _ in range(32):
        try:
            with te_stand_in(tuple(importers)) as served:
                for name in modules:
                    if name == root or importlib.util.find_spec(name) is not None:
                        importlib.import_module(name)
            return served
        except ModuleNotFoundError as exc:
            importer = _te_importer(exc, root)
            if importer is None or importer in importers:
                raise
            importers.append(importer)
            _forget(root)
    raise ImportError(f"{root} still imports transformer_engine unguarded after {len(importers)} importers: {importers}")


def import_megatron_bridge():
    """Import megatron.bridge where Transformer-Engine is absent (CPU, or a GPU install without TE),
    and record the Bridge shims this process applied for the current case (see SHIMS)."""
    if "megatron.bridge" not in sys.modules and not te_importable():
        if import_with_stand_in():
            _bridge_shims.append(TE_STUB)
        if _force_have_te_false():
            _bridge_shims.append(HAVE_TE_FALSE)
    import megatron.bridge

    for name in _bridge_shims:
        note(name)
    return megatron.bridge


#: the Bridge shims: what each is for and when it is no longer needed (applied by import_megatron_bridge)
SHIMS: tuple[Shim, ...] = (
    Shim(
        name=TE_STUB,
        upstream="megatron.bridge.peft.lora_layers",
        why="megatron-bridge peft/lora_layers.py imports transformer_engine.pytorch unguarded (0.5.1 also peft/lora.py)",
        probe="transformer_engine is not importable and a Bridge module's import raises ModuleNotFoundError for it "
        "(the error names the importer)",
        retire_when="when Bridge guards that import",
        kind=ADAPTS,
        apply=import_with_stand_in,
        needed=lambda device: not te_importable(),
        trigger=CALLER,
    ),
    Shim(
        name=HAVE_TE_FALSE,
        upstream="megatron.bridge.peft",
        why="megatron-bridge peft.utils / module_matcher HAVE_TE* come out True without TE because megatron-core "
        "leaves placeholder TE classes (LoRA then fails: 'isinstance() arg 2 must be a type')",
        probe="transformer_engine is not importable and a HAVE_TE* flag of peft.utils / module_matcher is True",
        retire_when="when Bridge detects TE by importing it",
        kind=ADAPTS,
        apply=_force_have_te_false,
        needed=lambda device: not te_importable(),
        trigger=CALLER,
    ),
)
