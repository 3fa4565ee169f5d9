"""Not-covered mutants in functions nothing installed calls (issue 41's blind-spot list).

A mutant no selected case runs asks for a case that runs it, unless no code a user runs reaches it.
A function or method whose name appears nowhere in the installed stacks the gate serves (Megatron-Core,
Megatron-Bridge, Megatron-LM's training, peft, transformers, verl, mbridge, torch, and the targets' own
packages) outside its own body, or only inside other functions that are themselves uncalled, is such
code: Megatron-Core 0.19.2's dist_checkpointing.dict_utils has `inspect_types`, `map_reduce`, and
`dict_map` / `dict_map_with_key` with the `nested_items_iter` only they call; mapping.py has
`ShardedTensor.max_allowed_chunks`. A case could only call it directly, which tests the utility, not a
checkpoint path.

The scan is textual: the name anywhere else (a call, an attribute, an import, a getattr string, a
docstring, a comment) counts as a caller, so it can only under-state what is uncalled; torch is scanned
because it calls modules' methods by name (`state_dict`, `forward`). Dunder methods are never said
uncalled, nor a name bound other than by a def of the mutant's file. A name built at run time
(`getattr(obj, f"_{kind}")`) would escape the scan; the report therefore keeps these mutants in the
coverage rate and gives the rate without them beside it.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

#: the installed packages a caller is looked for in, besides the targets' own top-level packages
STACKS = ("megatron", "peft", "transformers", "verl", "mbridge", "nemo", "accelerate", "trl", "torchtitan", "torch")


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
def _defs(path: str) -> dict[str, range]:
    """The lines (decorators, def, body) of each module-level function and each method of a module-level
    class in `path`, by qualified name: a name used inside its own span (recursion, its docstring) is no caller."""
    import ast

    out: dict[str, range] = {}

    def span(node: ast.AST) -> range:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        return range(first, (node.end_lineno or node.lineno) + 1)

    try:
        body = ast.parse(Path(path).read_text(errors="replace")).body
    except (SyntaxError, ValueError, OSError):  # a template or another Python's file among the scanned
        return out
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = span(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = span(item)
    return out


def _enclosing(path: str, line: int) -> str | None:
    """The function or method of `path` whose span holds `line` (None: module or class level)."""
    inside = [(len(r), q) for q, r in _defs(path).items() if line in r]
    return min(inside)[1] if inside else None


def _own_namesake(path: str, line: int, name: str) -> bool:
    """Whether line `line` of `path` names `name` as that file's own module-level function (the file defines
    one of that name and the line neither imports it nor reaches it as an attribute, `mod.name`)."""
    if name not in _defs(path):
        return False
    text = _lines(path)[line - 1] if line <= len(_lines(path)) else ""
    return not re.search(rf"\bimport\b|\.\s*{re.escape(name)}\b", text)


@lru_cache(maxsize=256)
def _lines(path: str) -> list[str]:
    return Path(path).read_text(errors="replace").splitlines()


def _short(qualname: str) -> str | None:
    name = qualname.rsplit(".", 1)[-1]
    return name if name.isidentifier() and not (name.startswith("__") and name.endswith("__")) else None


def uncalled(records: list[dict[str, Any]], where: tuple[Path, ...]) -> dict[str, str]:
    """{mutant id: why} for each not-covered mutant in a function or method that no file under `where`
    names outside its own body, except inside functions of its file that are uncalled themselves."""
    candidates = [r for r in records if r["outcome"] == "not-covered" and r.get("function")
                  and r["function"] in _defs(str(Path(r["path"]).resolve())) and _short(r["function"])]
    refs: dict[str, list[tuple[str, int]]] = {}
    asked = {(str(Path(r["path"]).resolve()), r["function"]) for r in candidates}
    while True:  # the names, then the functions of their files that name them, and so on (usually two scans)
        new = frozenset(n for _, q in asked if (n := _short(q)) and n not in refs)
        if not new:
            break
        refs.update(_references(new, tuple(where)))
        for path, q in list(asked):
            for f, n in refs.get(_short(q) or "", []):
                caller = _enclosing(path, n) if f == path else None
                if caller is not None:
                    asked.add((path, caller))

    def dead(path: str, qual: str, seen: frozenset[str]) -> bool:
        name, own = _short(qual), _defs(path).get(qual)
        if not name or own is None:
            return False
        for f, n in refs.get(name, []):
            if f == path and n in own:
                continue
            if f != path and "." not in qual and _own_namesake(f, n, name):
                continue  # another module's own function of that name (transformers' ESM has a dict_map)
            caller = _enclosing(f, n) if f == path else None
            if caller is not None and (caller in seen or dead(path, caller, seen | {qual})):
                continue  # named only inside a function nothing calls either
            return False
        return True

    out = {}
    for r in candidates:
        path, qual = str(Path(r["path"]).resolve()), r["function"]
        if dead(path, qual, frozenset({qual})):
            out[r["id"]] = (f"{r['module']}.{qual} has no caller: no installed file of {', '.join(sorted({p.name for p in where}))} "
                            "names it outside its own body and functions that are uncalled themselves")
    return out


def mark(records: list[dict[str, Any]], where: tuple[Path, ...] | None = None) -> list[dict[str, Any]]:
    """The records with each uncalled not-covered mutant carrying `uncalled` (why)."""
    where = roots(r["module"] for r in records) if where is None else where
    found = uncalled(records, where)
    return [{**r, "uncalled": found[r["id"]]} if r["id"] in found else r for r in records]
