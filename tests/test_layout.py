"""The house rules of harness/ and cases/, read from the code's own imports (lazy ones included:
a lazy import hides a cycle at import time, not in the design).

One import direction, bottom first: core <- compat <- judge | report | faults <- models <- run
<- backends <- cases <- orchestration <- gate <- faces (cli, pytest_plugin). A module may import
its own wing and any wing below; wings on one floor know nothing of each other; a backend knows
nothing of another backend, a case nothing of another case (shared pieces live in the contract,
in `_`-prefixed modules of cases/, or below).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.import_graph import cycles, imports_of, modules

ROOT = Path(__file__).resolve().parent.parent
#: Floors, bottom first; each floor holds one or more wings (module-name prefixes).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("harness.core",),
    ("harness.compat",),
    ("harness.judge", "harness.report", "harness.faults"),
    ("harness.models",),
    ("harness.run",),
    ("harness.backends",),
    ("cases",),
    ("harness.orchestration",),
    ("harness.gate",),
    ("harness.cli", "harness.pytest_plugin"),
)
#: The most lines a module may have, and the modules allowed more, each with why.
MAX_LINES = 450
LONG_MODULES: dict[str, str] = {}


def wing_of(module: str) -> tuple[int, str]:
    """(floor, wing) of a project module: the longest wing prefix that names it."""
    best: tuple[int, str] | None = None
    for floor, wings in enumerate(FLOORS):
        for wing in wings:
            if (module == wing or module.startswith(wing + ".")) and (best is None or len(wing) > len(best[1])):
                best = (floor, wing)
    if best is None:
        raise LookupError(f"module {module} is in no wing: add it to a floor of tests/test_layout.py")
    return best


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    # `harness` itself is an empty package: `from harness import x` names x, not the package
    return {name: imports_of(name, path, known) - {"harness"} for name, path in mods.items() if name != "harness"}


def upward(g: dict[str, set[str]]) -> list[str]:
    """Arrows to a higher floor, or across wings of one floor."""
    bad = []
    for src, targets in sorted(g.items()):
        f_src, w_src = wing_of(src)
        for dst in sorted(targets):
            f_dst, w_dst = wing_of(dst)
            if f_dst > f_src or (f_dst == f_src and w_dst != w_src):
                bad.append(f"{src} -> {dst}")
    return bad


def _peer_arrows(g: dict[str, set[str]], package: str, shared: set[str]) -> list[str]:
    """Arrows between sibling modules of `package` other than to its package and shared helpers."""
    def member(m: str) -> bool:
        return m.startswith(package + ".") and m.count(".") == package.count(".") + 1

    return [f"{s} -> {d}" for s, ts in sorted(g.items()) if member(s) for d in sorted(ts)
            if member(d) and d not in shared and not d.rsplit(".", 1)[1].startswith("_")]


def test_every_module_sits_in_a_wing():
    for name in graph():
        wing_of(name)


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_arrow_points_up_or_across():
    assert upward(graph()) == []


def test_a_backend_knows_nothing_of_another():
    assert _peer_arrows(graph(), "harness.backends", set()) == []


def test_a_case_knows_nothing_of_another():
    assert _peer_arrows(graph(), "cases", {"cases.contract"}) == []


def test_no_module_is_over_the_line_limit_without_a_reason():
    long = {name: len(path.read_text().splitlines()) for name, path in modules(ROOT).items()}
    over = {n: k for n, k in long.items() if k > MAX_LINES and n not in LONG_MODULES}
    assert over == {}


def test_the_rules_can_fail(tmp_path):
    """Plant each fault in a made-up tree and watch the rules go red."""
    for pkg, files in {
        "harness": {"__init__.py": "", "core/__init__.py": "", "core/a.py": "from harness.run import w\n",
                    "run/__init__.py": "", "run/w.py": "from harness.core import a\n",
                    "backends/__init__.py": "", "backends/x.py": "from harness.backends import y\n",
                    "backends/y.py": "", "judge/__init__.py": "", "judge/j.py": "from harness.report import r\n",
                    "report/__init__.py": "", "report/r.py": ""},
        "cases": {"__init__.py": "", "one.py": "from cases import two\n", "two.py": "", "contract.py": ""},
    }.items():
        for rel, text in files.items():
            (tmp_path / pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / pkg / rel).write_text(text)
    g = graph(tmp_path)
    assert cycles(g) == [["harness.core.a", "harness.run.w"]]
    assert {"harness.core.a -> harness.run.w", "harness.judge.j -> harness.report.r"} <= set(upward(g))
    assert not any(a.startswith(("harness.run.w ->", "harness.backends.x ->")) for a in upward(g))
    assert _peer_arrows(g, "harness.backends", set()) == ["harness.backends.x -> harness.backends.y"]
    assert _peer_arrows(g, "cases", {"cases.contract"}) == ["cases.one -> cases.two"]
    with pytest.raises(LookupError, match="harness.elsewhere"):
        wing_of("harness.elsewhere")
