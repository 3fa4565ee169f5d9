"""The plugin: matrix cases become marked test items, runnable under -m reshard and xdist."""

import textwrap

import pytest

pytest_plugins = ["pytester"]

MATRIX = textwrap.dedent(
    """
    name: x
    entries:
      - case: reshard-weights
        models: [gpt-tied]
        markers: [tied]
        pairs: ["tp1 -> pp2", "tp2 -> tp1"]
      - case: reshard-weights
        models: [gpt-gqa]
        pairs: ["dp2 -> tp2"]
    """
)


def _project(pytester):
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "x.yaml").write_text(MATRIX)


def test_cases_collected_with_readable_ids_and_markers(pytester):
    _project(pytester)
    result = pytester.runpytest("--collect-only", "-q", "-m", "reshard and tied", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        [
            "matrices/x.yaml::reshard-weights[[]mcore_dist-gpt-tied-tp1pp1dp1cp1->tp1pp2dp1cp1[]]",
            "matrices/x.yaml::reshard-weights[[]mcore_dist-gpt-tied-tp2pp1dp1cp1->tp1pp1dp1cp1[]]",
            "*2/3 tests collected (1 deselected)*",
        ]
    )


def test_a_bad_matrix_is_a_collection_error_naming_it(pytester):
    pytester.mkdir("matrices")
    (pytester.path / "matrices" / "bad.yaml").write_text("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp3']}]")
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*bad.yaml*entries[[]0[]]*tp3*"])
    assert result.ret != 0


@pytest.mark.slow  # 23 s: a second pytest under xdist; the default suite itself runs every matrix item under
# xdist (scripts/test -n 2) and CI's test groups with --ckpt-report, the per-worker JSONL this counts
def test_reshard_cases_run_under_xdist(pytester):
    _project(pytester)
    result = pytester.runpytest_subprocess("-m", "reshard", "-n", "2", "-p", "no:cacheprovider", "--ckpt-report", "rep")
    result.assert_outcomes(passed=3)
    lines = [ln for f in (pytester.path / "rep").glob("results-*.jsonl") for ln in f.read_text().splitlines()]
    assert len(lines) == 3
