"""Not-covered mutants in functions nothing installed calls (issue 41's blind-spot list).

A mutant no selected case runs asks for a case that runs it, unless no code a user runs reaches it.
A module-level function whose name appears nowhere in the installed stacks the gate serves (Megatron-Core,
Megatron-Bridge, Megatron-LM's training, peft, transformers, verl, mbridge, and the targets' own packages)
but on its own `def` line is such code: Megatron-Core 0.19.2's dist_checkpointing.dict_utils has four
(`inspect_types`, `nested_items_iter`, `dict_map_with_key`, `map_reduce`). A case could only call it
directly, which tests the utility, not a checkpoint path.

The scan is textual: the name anywhere else (a call, an import, a getattr string, a docstring, a comment)
counts as a caller, so it can only under-state what is uncalled. Methods and nested functions are never
called uncalled (their name is reached through an object). A user's own code may still call such a
function: the report keeps these mutants in the coverage rate and gives the rate without them beside it.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

#: the installed packages a caller is looked for in, besides the targets' own top-level packages
STACKS = ("megatron", "peft", "transformers", "verl", "mbridge", "nemo", "accelerate", "trl", "torchtitan")


def roots(modules: Iterable[str]) -> tuple[Path, ...]:
    """The directories of STACKS and of the modules' top-level packages that are installed (a namespace
    package such as `megatron` has several), found without importing them."""
    out: list[Path] = []
    for name in sorted(set(STACKS) | {m.split(".")[0] for m in modules}):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if Path(loc).is_dir() and Path(loc) not in out:
                out.append(Path(loc))
    return tuple(out)


@lru_cache(maxsize=4)
def _references(names: frozenset[str], where: tuple[Path, ...]) -> dict[str, list[tuple[str, int]]]:
    """For each name, the (file, line number) of every line of a .py file under `where` that holds it as a word."""
    found: dict[str, list[tuple[str, int]]] = {n: [] for n in names}
    if not names:
        return found
    word = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    for root in where:
        for f in root.rglob("*.py"):
            try:
                text = f.read_text(errors="replace")
            except OSError:
                continue
            if not word.search(text):
                continue
            for i, line in enumerate(text.splitlines(), 1):
                for n in set(word.findall(line)):
                    found[n].append((str(f.resolve()), i))
    return found


@lru_cache(maxsize=None)
def _own_span(path: str, name: str) -> range:
    """The lines of the module-level function `name` in `path` (its decorators, def, body): a name used
    there (recursion, its docstring) is not a caller."""
    import ast

    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return range(first, (node.end_lineno or node.lineno) + 1)
    return range(0)


def uncalled(records: list[dict[str, Any]], where: tuple[Path, ...]) -> dict[str, str]:
    """{mutant id: why} for each not-covered mutant in a module-level function no file under `where`
    names outside the function itself."""
    def top_level(r: dict[str, Any]) -> str | None:
        f = r.get("function") or ""
        return f if f and "." not in f and f.isidentifier() else None

    candidates = [r for r in records if r["outcome"] == "not-covered" and top_level(r)]
    refs = _references(frozenset(top_level(r) for r in candidates), tuple(where))
    out = {}
    for r in candidates:
        name, path = top_level(r), str(Path(r["path"]).resolve())
        span = _own_span(path, name)
        if not span:  # not a module-level def of this file (a name bound otherwise): never said uncalled
            continue
        if not [(f, n) for f, n in refs[name] if not (f == path and n in span)]:
            out[r["id"]] = (f"{r['module']}.{name} has no caller: no installed file of {', '.join(sorted({p.name for p in where}))} "
                            "names it outside the function itself")
    return out


def mark(records: list[dict[str, Any]], where: tuple[Path, ...] | None = None) -> list[dict[str, Any]]:
    """The records with each uncalled not-covered mutant carrying `uncalled` (why)."""
    where = roots(r["module"] for r in records) if where is None else where
    found = uncalled(records, where)
    return [{**r, "uncalled": found[r["id"]]} if r["id"] in found else r for r in records]
