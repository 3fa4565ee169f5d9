"""mutate_callers: a not-covered mutant in a function or method nothing installed names (outside its own
body, or only inside functions of its file that are uncalled themselves) is marked uncalled; anything else
is not, and the report keeps it in the coverage rate."""

from pathlib import Path

from harness.gate import mutate_callers, mutate_report

UTIL = '''
def used(x):
    return x


def lonely(x, depth=0):
    """Like more_itertools' lonely; calls lonely again."""
    return lonely(x, depth + 1) if depth < 2 else x


def in_a_string(x):
    return x


def only_via_dead(x):
    return x


def dead_caller():
    return only_via_dead(1)


def ping(n):
    return pong(n - 1) if n else 0


def pong(n):
    return ping(n)


class Holder:
    def method(self):
        return 1

    def called(self):
        return 2

    def __call__(self):
        return 3
'''
CALLER = '''
from pkg.util import used

NAME = "in_a_string"  # a getattr by name is a caller too


def go():
    return used(1) + Holder().called()
'''


#: another module with its own function named like one of util's: its calls are to its own
NAMESAKE = '''
def lonely(x):
    return x


def run():
    return lonely(2)
'''


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "util.py").write_text(UTIL)
    (root / "caller.py").write_text(CALLER)
    (root / "namesake.py").write_text(NAMESAKE)
    (root / "template.py").write_text("def {{ name }}():\n    used(1)\n")  # not Python: the scan must go on
    return root, root / "util.py"


def _record(path: Path, function: str, outcome: str = "not-covered") -> dict:
    return {"id": f"pkg.util:1:drop-statement:{function}", "module": "pkg.util", "path": str(path), "function": function,
            "outcome": outcome}


def test_only_a_function_named_nowhere_else_is_uncalled(tmp_path):
    mutate_callers._references.cache_clear()
    root, util = _tree(tmp_path)
    names = ("used", "lonely", "in_a_string", "only_via_dead", "dead_caller", "ping", "pong", "Holder.method",
             "Holder.called", "Holder.__call__", "Holder", "")
    found = mutate_callers.uncalled([_record(util, f) for f in names], (root,))
    # named only inside uncalled functions (dead_caller; ping and pong only each other) is uncalled too; a
    # method is found by its attribute name; a dunder is never said uncalled (the runtime calls it)
    assert sorted(k.rsplit(":", 1)[1] for k in found) == ["Holder.method", "dead_caller", "lonely", "only_via_dead",
                                                          "ping", "pong"]
    assert "pkg.util.lonely has no caller" in found["pkg.util:1:drop-statement:lonely"]
    assert mutate_callers._defs(str(root / "template.py")) == {}  # an unparsable file defines nothing, and raises nothing


def test_a_covered_mutant_and_an_empty_campaign_are_never_marked(tmp_path):
    mutate_callers._references.cache_clear()
    root, util = _tree(tmp_path)
    assert mutate_callers.uncalled([_record(util, "lonely", "survived")], (root,)) == {}
    assert mutate_callers.uncalled([], (root,)) == {}


def test_the_report_keeps_uncalled_mutants_in_the_coverage_rate(tmp_path):
    mutate_callers._references.cache_clear()
    root, util = _tree(tmp_path)
    records = mutate_callers.mark([_record(util, "lonely"), _record(util, "used"), _record(util, "used", "killed")], (root,))
    r = mutate_report.rates(records)
    assert r["coverage_rate"] == round(1 / 3, 4) and r["not-covered-uncalled"] == 1 and r["reachable_coverage_rate"] == 0.5
