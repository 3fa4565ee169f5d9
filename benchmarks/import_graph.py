"""The project's own import graph: modules, arrows, cycles, the largest modules.

`python -m benchmarks.import_graph [ROOT]` prints the numbers the design review and issue 8 ask
for (before/after a refactor), from the code's own `import` statements, lazy ones included: a
lazy import hides a cycle at import time, not in the design.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("harness", "cases")
#: Import names of a top-level package: the wheel installs cases/ as harness/cases (pyproject's
#: package-dir) and harness/__init__.py names the clone's cases/ the same, so code imports it as
#: `harness.cases`; the graph keys it by its directory, `cases`.
ALIASES = {"harness.cases": "cases"}


def canonical(name: str) -> str:
    for alias, real in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return real + name[len(alias):]
    return name


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports (anywhere in the file), resolved to the longest known name."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in map(canonical, targets):
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def report(root: Path) -> str:
    mods = modules(root)
    known = set(mods)
    graph = {m: imports_of(m, p, known) for m, p in mods.items()}
    # A package's __init__ importing its own submodules (registries) is not a dependency arrow.
    graph = {m: {t for t in ts if not (m and t.startswith(m + ".") and mods[m].name == "__init__.py")} for m, ts in graph.items()}
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    cyc = cycles(graph)
    case_lines = sum(n for m, n in lines.items() if m.startswith("cases"))
    out = [
        f"modules: {len(mods)}, import arrows: {sum(len(v) for v in graph.values())}, cycles: {len(cyc)}",
        *(f"  cycle: {' -> '.join(c)}" for c in cyc),
        f"lines in cases/: {case_lines}",
        "largest modules: " + ", ".join(f"{m} {n}" for m, n in sorted(lines.items(), key=lambda kv: -kv[1])[:5]),
        "cases importing other cases: "
        + (", ".join(sorted(f"{m}->{t}" for m, ts in graph.items() if m.startswith("cases.") for t in ts if t.startswith("cases."))) or "none"),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
