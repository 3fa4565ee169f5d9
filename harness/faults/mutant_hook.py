"""One mutant active in this process and in every process it starts (issue 41).

`activate(mutant)` puts a meta_path finder first: the mutant's module, when imported, is compiled
from the installed file's text with the mutant's one span replaced, under the installed file's own
name (coverage lines and tracebacks are the installed file's; the file itself is only read, and a
file whose bytes are not the ones the mutant was made from is refused). The mutant also goes into
CKPT_HARNESS_MUTANT, so every child inherits it: a forked rank inherits the finder and the mutated
module, and a spawned or torchrun rank activates it again when it imports harness (harness/__init__
calls `activate_from_env`), before anything imports the target. Without that variable nothing here
runs: a normal run has no hook.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType

from harness.faults.mutants import Mutant

ENV = "CKPT_HARNESS_MUTANT"


class MutantError(RuntimeError):
    """The mutant cannot be activated as made (its module already imported, its file changed)."""


class _Loader(Loader):
    def __init__(self, mutant: Mutant, source: str):
        self.mutant, self.source = mutant, source

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(compile(self.source, self.mutant.path, "exec", dont_inherit=True), module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.source


class _Finder(MetaPathFinder):
    def __init__(self, mutant: Mutant, source: str):
        self.mutant, self.source = mutant, source

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != self.mutant.module:
            return None
        real = PathFinder.find_spec(fullname, path)
        if real is None or real.origin != self.mutant.path:
            raise MutantError(f"mutant {self.mutant.id}: {fullname} resolves to {real and real.origin}, "
                              f"not the file it was made from ({self.mutant.path})")
        spec = ModuleSpec(fullname, _Loader(self.mutant, self.source), origin=real.origin,
                          is_package=real.submodule_search_locations is not None)
        spec.submodule_search_locations = real.submodule_search_locations
        spec.has_location = True
        return spec


def active() -> Mutant | None:
    """The mutant this process runs with (None: none, the normal case)."""
    for f in sys.meta_path:
        if isinstance(f, _Finder):
            return f.mutant
    return None


def activate(mutant: Mutant) -> None:
    """Make `mutant` the code of its module here and in every child; refused when the module is
    already imported (it would keep its real code) or its file is not the bytes it was made from."""
    current = active()
    if current is not None:
        if current == mutant:
            return
        raise MutantError(f"mutant {current.id} is already active here; one mutant per process")
    text = Path(mutant.path).read_text()
    if hashlib.sha256(text.encode()).hexdigest() != mutant.sha256:
        raise MutantError(f"mutant {mutant.id}: {mutant.path} changed since the mutant was made")
    if mutant.module in sys.modules:
        raise MutantError(f"mutant {mutant.id}: {mutant.module} is imported already; activate it before")
    sys.meta_path.insert(0, _Finder(mutant, mutant.apply(text)))
    os.environ[ENV] = json.dumps(mutant.to_dict())


def activate_from_env() -> Mutant | None:
    """The mutant CKPT_HARNESS_MUTANT names, activated (a forked child already has it)."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    mutant = Mutant.from_dict(json.loads(raw))
    if active() != mutant:
        activate(mutant)
    return mutant
