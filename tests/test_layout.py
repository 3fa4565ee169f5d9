"""The house rules of harness/ and cases/, read from the code's own imports (lazy ones included:
a lazy import hides a cycle at import time, not in the design).

One import direction, bottom first: core <- compat <- judge | report | faults <- models <- run
<- backends <- cases <- orchestration <- gate <- faces (cli, pytest_plugin). A module may import
its own wing and any wing below; wings on one floor know nothing of each other; a backend knows
nothing of another backend, a case nothing of another case (shared pieces live in the contract,
in cases/ranks/ (what runs in a rank), cases/shared/ (what several cases judge with), or below).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from benchmarks.import_graph import canonical, cycles, imports_of, modules

ROOT = Path(__file__).resolve().parent.parent
#: Floors, bottom first; each floor holds one or more wings (module-name prefixes).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("harness.core",),
    ("harness.compat",),
    ("harness.judge", "harness.report", "harness.faults"),
    ("harness.models",),
    ("harness.run",),
    ("harness.backends", "harness.plan"),  # plan builds models (above models, run); nothing below orchestration uses it
    ("harness.inspect",),  # reads checkpoints' metadata and builds check-load's target through harness.plan; only the faces use it
    ("cases",),  # imported as harness.cases (the wheel's name): benchmarks.import_graph.canonical
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
    module = canonical(module)  # harness.cases.x is cases.x
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


HELPERS = ("cases.ranks", "cases.shared")  # what cases share, named by what it is: no `_` convention


def _case_arrows(g: dict[str, set[str]]) -> list[str]:
    """A case importing another case, or a rank side / shared helper importing a case."""
    top = {m for m in g if m.startswith("cases.") and m.count(".") == 1} - {"cases.contract", *HELPERS}
    helpers = [s for s in g if s.startswith(tuple(h + "." for h in HELPERS))]
    return _peer_arrows(g, "cases", {"cases.contract", *HELPERS}) + [
        f"{s} -> {d}" for s in sorted(helpers) for d in sorted(g[s]) if d in top]


def test_a_case_knows_nothing_of_another():
    assert _case_arrows(graph()) == []


def test_every_module_of_cases_is_a_case_or_named_by_what_it_is():
    """cases/*.py are cases (a CASE each) and the contract; what they share lives in ranks/ or shared/."""
    import importlib

    from harness.cases.contract import Case

    stray = sorted(p.name for p in (ROOT / "cases").glob("*.py") if p.stem not in ("__init__", "contract")
                   and not isinstance(getattr(importlib.import_module(f"harness.cases.{p.stem}"), "CASE", None), Case))
    assert stray == []
    assert sorted(p.name for p in (ROOT / "cases").iterdir() if p.is_dir() and p.name != "__pycache__") == ["ranks", "shared"]


def test_the_case_rule_can_fail():
    g = {"cases.one": {"cases.two", "cases.shared.peft", "cases.ranks"}, "cases.two": set(), "cases.contract": set(),
         "cases.ranks": set(), "cases.ranks.job": {"cases.one", "cases.shared.peft"}, "cases.shared.peft": {"cases.contract"}}
    assert _case_arrows(g) == ["cases.one -> cases.two", "cases.ranks.job -> cases.one"]


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


# ---------------------------------------------------------------- the wheel's boundary
#: Top-level names that exist only in a clone: the wheel holds `harness` alone (tests/test_wheel.py),
#: so harness code that imports one of them, or names one in a "module:attr" string a rank resolves,
#: works from a clone and breaks when installed. `cases` is there as harness.cases.
CLONE_ONLY = ("tests", "benchmarks", "cases", "doubles", "probes", "conftest")


def clone_only_refs(root: Path = ROOT) -> list[str]:
    """Every import of, or "module:attr" string naming, a clone-only top-level name in harness/ or cases/."""
    import ast
    import re

    spec = re.compile(r"(%s)(\.\w+)*:\w+" % "|".join(CLONE_ONLY))
    bad = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and spec.fullmatch(node.value):
                found = [node.value]
            else:
                continue
            bad += [f"{name}:{node.lineno} {f}" for f in found if re.split(r"[.:]", f)[0] in CLONE_ONLY]
    return sorted(bad)


def test_no_harness_module_reaches_outside_the_wheel():
    assert clone_only_refs() == []


def test_cases_sit_on_their_floor_under_either_name():
    assert wing_of("harness.cases") == wing_of("cases") == (FLOORS.index(("cases",)), "cases")
    assert wing_of("harness.cases.reshard_weights") == wing_of("cases.reshard_weights")
    g = graph()
    assert "cases" in g["harness.orchestration.runner"] or any(t.startswith("cases.") for t in g["harness.orchestration.runner"])
    assert not any(t.startswith("harness.cases") for ts in g.values() for t in ts)


def test_the_wheel_rules_can_fail(tmp_path):
    for rel, text in {"harness/__init__.py": "", "harness/backends/__init__.py": "",
                      "harness/backends/b.py": "from harness.cases.one import x\n",
                      "harness/orchestration/__init__.py": "", "harness/orchestration/o.py": "from harness.cases import one\n",
                      "harness/run/__init__.py": "",
                      "harness/run/r.py": "import tests.probes\nfrom benchmarks import w\nHOOK = 'probes:mark_hook'\n",
                      "harness/run/s.py": "from cases import one\nfrom . import r\nfrom doubles import D\n",
                      "cases/__init__.py": "", "cases/one.py": "from .two import y\n", "cases/two.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert clone_only_refs(tmp_path) == ["harness.run.r:1 tests.probes", "harness.run.r:2 benchmarks",
                                         "harness.run.r:3 probes:mark_hook", "harness.run.s:1 cases",
                                         "harness.run.s:3 doubles"]
    g = graph(tmp_path)
    assert g["harness.orchestration.o"] == {"cases", "cases.one"} and g["cases.one"] == {"cases.two"}
    assert "harness.backends.b -> cases.one" in upward(g) and not any(a.startswith("harness.orchestration") for a in upward(g))
    assert _peer_arrows(g, "cases", {"cases.contract"}) == ["cases.one -> cases.two"]


def test_a_scheduler_knows_nothing_of_another_and_every_name_has_its_module():
    """Issue 36 item 2: schedulers share only their package and its `_`-prefixed helpers; the
    registry's every name is a module of the package, and every module there is registered."""
    from harness.orchestration.schedulers import SCHEDULERS

    package = "harness.orchestration.schedulers"
    assert _peer_arrows(graph(), package, set()) == []
    folder = ROOT / "harness" / "orchestration" / "schedulers"
    assert all((folder / f"{module}.py").is_file() for module in SCHEDULERS.values()), SCHEDULERS
    assert {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")} == set(SCHEDULERS.values())


# ---------------------------------------------------------------- one shim registry

#: names of a table of shims or workarounds (the one convention: `SHIMS` in a public module of harness/compat/)
TABLE = re.compile(r"[A-Z0-9_]*(SHIMS|WORKAROUNDS|FALLBACKS)")


def tables(root: Path) -> tuple[list[str], int]:
    """(top-level names holding a table of shims or workarounds outside the convention, files read).
    The convention: `SHIMS`, a tuple of Shim records, in a public module of harness/compat/."""
    bad, seen = [], 0
    for path in sorted(p for d in ("harness", "cases", "benchmarks") for p in (root / d).rglob("*.py")):
        seen += 1
        rel = path.relative_to(root).as_posix()
        conventional = rel.startswith("harness/compat/") and not path.name.startswith("_") and path.name != "registry.py"
        for node in ast.parse(path.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Name) and TABLE.fullmatch(t.id) and not (conventional and t.id == "SHIMS"):
                    bad.append(f"{rel}: {t.id}")
    return bad, seen


def test_no_module_outside_the_convention_defines_a_table_of_shims_or_workarounds(tmp_path):
    bad, seen = tables(ROOT)
    assert seen > 50 and bad == []
    # planted: a backend's own workaround dict, a compat module's second table, a helper's SHIMS
    for d in ("harness/backends", "harness/compat", "cases", "benchmarks"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "harness/backends/x.py").write_text("FOO_WORKAROUNDS: dict[str, str] = {}\n")
    (tmp_path / "harness/compat/y.py").write_text("SHIMS = ()\nVERL_SHIMS = {}\nDEFAULT_WORKAROUNDS = ()\n")
    (tmp_path / "harness/compat/_z.py").write_text("SHIMS = ()\n")
    (tmp_path / "cases/c.py").write_text("def f():\n    WORKAROUNDS = {}\nSHIMS = ()\n")
    bad, _ = tables(tmp_path)
    assert bad == ["cases/c.py: SHIMS", "harness/backends/x.py: FOO_WORKAROUNDS", "harness/compat/_z.py: SHIMS",
                   "harness/compat/y.py: VERL_SHIMS", "harness/compat/y.py: DEFAULT_WORKAROUNDS"]
