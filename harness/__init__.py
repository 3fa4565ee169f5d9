"""ckpt-harness. Its import-time job: give the cases one name, `harness.cases`, everywhere (and,
only under a mutation campaign, measure its targets or activate its mutant: the end of this file).

The wheel holds the cases as harness/cases (pyproject's package-dir maps cases/ there, so the wheel
installs no generic top-level `cases`); a clone keeps them at its top level, cases/ beside harness/,
and the finder below names that directory `harness.cases` (an editable install maps it the same
way). Every process that imports harness (spawn and torchrun children included, unpickling a case's
rank function by its module name) therefore resolves a case exactly as its parent did.
"""

import os as _os
import sys as _sys

_CLONE_CASES = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "cases")


class _CloneCases:
    """meta_path finder: `harness.cases` is the clone's cases/ (first, ahead of a stale editable
    install that points at another checkout)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "harness.cases":
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(name, _os.path.join(_CLONE_CASES, "__init__.py"),
                                       submodule_search_locations=[_CLONE_CASES])


if (not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "cases"))
        and _os.path.isfile(_os.path.join(_CLONE_CASES, "__init__.py"))
        and not any(getattr(f, "__name__", "") == "_CloneCases" for f in _sys.meta_path)):  # once, even on reload
    _sys.meta_path.insert(0, _CloneCases)

# a remote-code fixture's configuration is imported by transformers from HF_MODULES_CACHE, read once at its
# import: the harness's cache unless the user named one (harness/models/remote.py)
from harness.models.remote import modules_cache as _modules_cache

_modules_cache()
if _os.environ.get("CKPT_HARNESS_COVERAGE"):  # a mutation campaign's instrumented run: which target lines
    # each case runs (harness/faults/coverage_hook.py), measured from before anything imports them
    from harness.faults.coverage_hook import start_process as _measure

    _measure()
if _os.environ.get("CKPT_HARNESS_MUTANT"):  # a mutation campaign's mutant (harness/faults/mutant_hook.py): in
    # every process of its world, before anything imports its module; unset, nothing is imported here
    from harness.faults.mutant_hook import activate_from_env as _activate_mutant

    _activate_mutant()
