"""The test suite split across CI runners (`scripts/test --splits N --group I`, pytest-split): the
groups are disjoint and together run every item the unsplit suite would, under xdist (`-n 2`, as
scripts/test runs them), with harness.pytest_plugin's matrix cases among the items, after `-m` has
deselected the opt-in tiers, and balanced by a durations file (.test_durations) when one is given."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

@pytest.mark.parametrize("i", range(7))
def test_unit(i):
    pass

@pytest.mark.slow
def test_an_opt_in_tier():
    pass
"""
# four matrix cases the machine cannot run (not-run: skipped at once, before any world starts)
MATRIX = """
entries:
  - case: reshard-weights
    models: [gpt-gqa, gpt-tied]
    pairs: ['tp1 -> tp1', 'dp2 -> tp2']
    requires: [host-memory-gib>=1000000]
"""
# each worker logs the items it sets up (per --group); a collect-only run logs what it keeps
CONFTEST = """
def pytest_runtest_setup(item):
    with open(item.config.rootpath / f"ran-{item.config.getoption('group')}.txt", "a") as f:
        f.write(item.nodeid + "\\n")

def pytest_collection_finish(session):
    if session.config.option.collectonly:
        (session.config.rootpath / "collected.txt").write_text("".join(i.nodeid + "\\n" for i in session.items))
"""
MARKS = "not slow and not memory and not gpu"  # scripts/test's default tiers
SPLIT = ("--splitting-algorithm", "least_duration")  # what scripts/test adds to --splits


def _suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_units=TESTS)
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "tiny.yaml").write_text(MATRIX)
    pytester.makeconftest(CONFTEST)


def _selected(pytester: pytest.Pytester, *args: str) -> list[str]:
    """What a collect-only run (in process) keeps after -m and the split."""
    log = pytester.path / "collected.txt"
    log.unlink(missing_ok=True)
    pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", "-m", MARKS, *args)
    return log.read_text().split()


def _disjoint_cover(groups: list[list[str]], items: list[str]) -> None:
    assert all(len(set(g)) == len(g) for g in groups) and not set(groups[0]) & set(groups[1])
    assert sorted(groups[0] + groups[1]) == sorted(items)


def test_split_groups_are_disjoint_and_cover_the_suite(pytester):
    """CI's case: no durations file; matrix cases and tests dealt out, the opt-in tier in neither."""
    _suite(pytester)
    items = _selected(pytester)
    assert len(items) == 11 and sum("tiny.yaml::" in i for i in items) == 4 and not any("opt_in" in i for i in items)
    groups = [_selected(pytester, "--splits", "2", "--group", str(g), *SPLIT) for g in (1, 2)]
    _disjoint_cover(groups, items)
    assert all(any("tiny.yaml::" in i for i in g) and any("test_unit" in i for i in g) for g in groups)


def test_under_xdist_a_group_runs_exactly_what_it_selects(pytester):
    """scripts/test runs a group with `-n 2`: each worker applies the same split, and xdist hands out
    that group's items, each once."""
    _suite(pytester)
    selected = _selected(pytester, "--splits", "2", "--group", "2", *SPLIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-m", MARKS, "--splits", "2", "--group", "2", *SPLIT)
    assert result.ret == 0, result.stdout.str()[-3000:]
    ran = (pytester.path / "ran-2.txt").read_text().split()
    assert sorted(ran) == sorted(selected) and not (pytester.path / "ran-1.txt").exists()
    result.stdout.fnmatch_lines([f"*2 workers [[]{len(selected)} items[]]*"])


def test_a_durations_file_balances_the_groups(pytester):
    _suite(pytester)
    items = _selected(pytester)
    heavy = next(i for i in items if "tiny.yaml::" in i)  # a matrix case's node id, as --store-durations keys it
    (pytester.path / ".test_durations").write_text(json.dumps({i: 100.0 if i == heavy else 1.0 for i in items}))
    groups = [_selected(pytester, "--splits", "2", "--group", str(g), *SPLIT) for g in (1, 2)]
    _disjoint_cover(groups, items)
    assert sorted(map(len, groups)) == [1, 10] and [heavy] in groups
