"""The release sweep table (harness/gate/sweep/) from canned results.json documents: change points,
changed checks, coverage holes, the --releases grammar, the writers, run_cli, `ckpt-harness sweep` and
the drivers over fake gate steps. No network, no env."""

import argparse
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness.gate import sweep
from harness.gate.sweep import (
    SweepSpecError,
    cross_pairs,
    cross_table,
    parse_releases,
    sweep_table,
)
from harness.report.grid import anchor

LABELS = ["megatron-bridge==0.4.2", "megatron-bridge==0.5.0", "megatron-bridge==0.5.1", "megatron-bridge==0.6.0", "megatron-bridge==0.7.0"]
API = "API not available in megatron-bridge 0.5.1: ImportError: cannot import name 'AutoBridge' from 'megatron.bridge'"
XPASS = "XPASS(strict): expected to fail (bridge#123 pad_vocab export) but passed; if upstream fixed it, remove the xfail from the matrix"


def _checks(**statuses):
    return [{"name": n.replace("_", "-"), "status": s, "detail": "", "max_abs_diff": None, "tolerance": "bitwise"} for n, s in statuses.items()]


def _rec(cid, status, checks=None, **kw):
    return {"id": cid, "status": status, "checks": checks if checks is not None else _checks(loaded_canonical="passed"),
            "phases": {"total": 1.0}, "error": None, **kw}


def _case_at(cid, i):
    """Case `cid`'s record in release i (0-based), or None where it is missing from that run."""
    ok = _rec(cid, "passed")
    if cid in ("reshard[a]", "reshard[b]", "reshard[c]"):
        return ok
    if cid == "arrive[x]":  # arrives failing at release 3, leaves at 5
        return _rec(cid, "failed", _checks(loaded_canonical="failed"), error=None) if i in (2, 3) else ok
    if cid == "checks[y]":  # failed throughout, but the failing check moves at release 3
        first = _checks(shapes="failed", values="passed")
        later = _checks(shapes="passed", values="failed")
        return _rec(cid, "failed", first if i < 2 else later)
    if cid == "missing[z]":  # not in release 3's run
        return None if i == 2 else ok
    if cid == "api[w]":  # the harness cannot drive release 3
        return _rec(cid, "error", [], error=API + "\nrank 0 of 2 raised:\nImportError: ...") if i == 2 else ok
    if cid == "xfail[v]":  # the named defect stops reproducing at release 4
        return _rec(cid, "xfailed", _checks(export="failed"), xfail_reason="bridge#123") if i < 3 else \
            _rec(cid, "failed", _checks(export="passed"), error=XPASS, xfail_reason="bridge#123")
    if cid == "gap[t]":  # passed, a hole at 2, failed at 3: the change lies between releases 1 and 3
        if i == 1:
            return _rec(cid, "error", [], error=API)
        return ok if i == 0 else _rec(cid, "failed", _checks(loaded_canonical="failed"))
    if cid == "notrun[s]":
        return _rec(cid, "not-run", [], not_run_reason="needs CUDA")
    if cid == "crash[q]":  # errors from release 4 on, with markup in its text
        return _rec(cid, "error", [], error="rank 1 of 2 raised:\nKeyError: '<script>alert(1)</script>'") if i >= 3 else ok
    if cid == "steady-xfail[p]":
        return _rec(cid, "xfailed", _checks(export="failed"), xfail_reason="bridge#9")
    raise KeyError(cid)


CASES = ["reshard[a]", "reshard[b]", "reshard[c]", "arrive[x]", "checks[y]", "missing[z]", "api[w]", "xfail[v]", "gap[t]",
         "notrun[s]", "crash[q]", "steady-xfail[p]"]


def _doc(i):
    results = [r for cid in CASES if (r := _case_at(cid, i)) is not None]
    return {"matrix": "matrices/smoke.yaml", "complete": True, "wall_s": 10.0,
            "versions": {"python": "3.12.1", "megatron-core": "0.18.2", "megatron-bridge": LABELS[i].split("==")[1]},
            "summary": {}, "results": results}


@pytest.fixture(scope="module")
def table():
    return sweep_table([(label, _doc(i)) for i, label in enumerate(LABELS)])


# ----------------------------------------------------------------------------- change points


def test_arrives_at_release_3_and_leaves_at_5(table):
    row = table.case("arrive[x]")
    assert row.outcomes == ["passed", "passed", "failed", "failed", "passed"]
    assert [(c.release, c.kind) for c in row.changes] == [(LABELS[2], "arrived"), (LABELS[4], "left")]
    assert [(c.name, c.old, c.new) for c in row.changes[0].checks] == [("loaded-canonical", "passed", "failed")]
    assert [(c.name, c.old, c.new) for c in row.changes[1].checks] == [("loaded-canonical", "failed", "passed")]
    assert row.story().startswith(f"failed arrived in {LABELS[2]}")
    assert f"failed left in {LABELS[4]}" in row.story()


def test_checks_change_while_status_does_not(table):
    row = table.case("checks[y]")
    assert set(row.outcomes) == {"failed"}
    assert len(row.changes) == 1
    ch = row.changes[0]
    assert (ch.release, ch.kind, ch.old, ch.new) == (LABELS[2], "checks", "failed", "failed")
    assert {(c.name, c.old, c.new) for c in ch.checks} == {("shapes", "failed", "passed"), ("values", "passed", "failed")}


def test_missing_case_is_a_hole_not_a_change(table):
    row = table.case("missing[z]")
    assert row.outcomes[2] == "absent" and not row.changed and row.holes == [2]


def test_api_not_available_is_a_coverage_hole(table):
    row = table.case("api[w]")
    assert row.outcomes == ["passed", "passed", "api-missing", "passed", "passed"]
    assert not row.changed
    assert row.why[2].startswith("API not available in megatron-bridge 0.5.1")
    holes = {(o, why.split(":")[0]): (rel, ids) for rel, o, why, ids in table.holes()}
    assert holes[("api-missing", "API not available in megatron-bridge 0.5.1")] == ([1, 2], ["gap[t]", "api[w]"])
    assert holes[("absent", "no record of the case in this run")] == ([2], ["missing[z]"])
    assert holes[("not-run", "needs CUDA")] == ([0, 1, 2, 3, 4], ["notrun[s]"])  # one group, not one per release


def test_xfail_that_starts_passing_is_fixed_upstream(table):
    row = table.case("xfail[v]")
    assert row.outcomes == ["xfailed"] * 3 + ["xpassed"] * 2
    assert [(c.release, c.kind) for c in row.changes] == [(LABELS[3], "fixed-upstream")]
    assert "drop the xfail" in row.story()


def test_change_across_a_hole_names_the_covered_releases_either_side(table):
    ch, = table.case("gap[t]").changes
    assert (ch.since, ch.release, ch.exact, ch.kind) == (LABELS[0], LABELS[2], False, "arrived")
    assert f"between {LABELS[0]} and {LABELS[2]}" in ch.sentence()


def test_changed_cases_come_first_by_first_change(table):
    assert [r.id for r in table.changed] == ["arrive[x]", "checks[y]", "gap[t]", "crash[q]", "xfail[v]"]
    assert {r.id for r in table.unchanged} == {"reshard[a]", "reshard[b]", "reshard[c]", "missing[z]", "api[w]", "notrun[s]",
                                              "steady-xfail[p]"}
    assert table.unchanged_counts() == {"passed": 5, "xfailed": 1, "never-covered": 1}


def test_per_release_counts(table):
    r3 = table.releases[2]
    assert r3.counts == {"passed": 4, "failed": 3, "xfailed": 2, "api-missing": 1, "not-run": 1, "absent": 1}
    assert table.releases[1].counts["api-missing"] == 1  # gap[t]
    assert sum(table.releases[0].counts.values()) == len(CASES)
    assert table.releases[0].versions["megatron-bridge"] == "0.4.2"


def test_cases_only_in_later_runs_and_bad_input():
    t = sweep_table([("a", {"results": [_rec("x", "passed")]}), ("b", {"cases": [_rec("x", "passed"), _rec("new", "failed")]})])
    assert t.case("new").outcomes == ["absent", "failed"] and not t.case("new").changed
    with pytest.raises(sweep.SweepInputError, match="'b'.*twice"):
        sweep_table([("a", {"results": []}), ("b", {"results": [_rec("x", "passed"), _rec("x", "failed")]})])
    with pytest.raises(sweep.SweepInputError, match="repeat"):
        sweep_table([("a", {"results": []}), ("a", {"results": []})])


# ----------------------------------------------------------------------------- the grammar


def test_grammar_abbreviation_and_sets():
    assert parse_releases("megatron-bridge==0.4.2,0.5.0, 0.5.1") == [["megatron-bridge==0.4.2"], ["megatron-bridge==0.5.0"],
                                                                      ["megatron-bridge==0.5.1"]]
    assert parse_releases("megatron-bridge==0.5.1+megatron-core==0.18.2,megatron-core==0.19.0,0.20.0") == [
        ["megatron-bridge==0.5.1", "megatron-core==0.18.2"], ["megatron-core==0.19.0"], ["megatron-core==0.20.0"]]
    # '+' inside git+https and in a local version does not split a set
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert parse_releases(f"megatron-core==0.18.2+cu12,megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@{sha}") == [
        ["megatron-core==0.18.2+cu12"], [f"megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@{sha}"]]
    assert parse_releases("megatron-bridge==0.5.0+./trees/Megatron-LM") == [["megatron-bridge==0.5.0", "./trees/Megatron-LM"]]


@pytest.mark.parametrize("arg, token", [
    ("", "empty"),
    ("0.5.0", "'0.5.0'"),  # a bare version with nothing to continue
    ("megatron-bridge==0.4.2,,0.5.0", "set #2 is empty"),
    ("megatron-bridge==0.4.2,", "set #2 is empty"),
    ("megatron-bridge==0.5.1+megatron-core==0.18.2,0.5.2", "'0.5.2'"),  # ambiguous after a two-package set
    ("megatron-bridge==0.4.2,megatron-bridge==0.4.2", "repeats set #1"),
    ("megatron-bridge==0.4.2+Megatron_Bridge==0.5.0", "pins megatron-bridge twice"),
    ("megatron-bridge==0.4.2,bridge-latest", "'bridge-latest'"),
    ("megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@main", "@<commit sha>"),
])
def test_grammar_errors_name_the_token(arg, token):
    with pytest.raises(SweepSpecError, match="--releases") as info:
        parse_releases(arg)
    assert isinstance(info.value, ValueError)
    assert token in str(info.value)


# ----------------------------------------------------------------------------- the writers


def test_markdown_lists_changed_cases_and_only_counts_unchanged(table):
    md = sweep.markdown(table)
    changed_part = md.split("## Unchanged cases")[0]
    for cid in ("arrive[x]", "checks[y]", "gap[t]", "crash[q]", "xfail[v]"):
        assert f"`{cid}`" in changed_part
    for cid in ("reshard[a]", "reshard[b]", "reshard[c]", "steady-xfail[p]"):
        assert cid not in md  # counted, never listed
    assert "notrun[s]" not in md.split("## Coverage holes")[0]  # a hole case is listed under holes only
    assert "| 1-5 | nr | needs CUDA | 1: `notrun[s]` |" in md
    assert "7 case(s) kept one outcome in every release they ran: 5 passed, 1 xfailed, 1 never-covered" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| `arrive[x]`"))
    assert row.split(" | ")[1:6] == ["ok", "ok", "**FAIL**", "FAIL", "**ok**"]
    assert "loaded-canonical: passed -> failed" in row
    assert "| 1 | `megatron-bridge==0.4.2` |" in md  # the per-release summary row
    assert "## Coverage holes" in md and "`api[w]`" in md.split("## Coverage holes")[1]
    assert "<script>" not in md


def test_html_is_self_contained_and_escapes(table):
    html = sweep.render_html(table)

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.external, self.cells, self.ids = [], [], [], set()

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            self.tags.append(tag)
            self.external += [v for k, v in attrs if k in ("src", "href") and not v.startswith("#")]
            self.cells += [a] if "gc" in (a.get("class") or "").split() else []
            self.ids |= {a["id"]} if "id" in a else set()

    p = Tags()
    p.feed(html)
    assert "script" not in p.tags and not p.external
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    # the release x case grid: one cell per case and release, each a link to its case's row
    assert len(p.cells) == len(table.releases) * len(table.cases)
    assert {c["href"] for c in p.cells} == {f"#{anchor(r.id)}" for r in table.cases} and all(c["href"][1:] in p.ids for c in p.cells)
    assert html.count("<details>") == 1 and "reshard[a]" in html.split("<details>")[1]  # unchanged, collapsed


def test_write_outputs_full_matrix_json(tmp_path, table):
    paths = sweep.write(table, tmp_path / "out")
    assert {p.name for p in paths.values()} == {"sweep.md", "sweep.html", "sweep.json"}
    doc = json.loads(paths["json"].read_text())
    assert len(doc["cases"]) == len(CASES)
    x = next(c for c in doc["cases"] if c["id"] == "arrive[x]")
    assert x["outcomes"][LABELS[2]] == "failed" and [c["kind"] for c in x["changes"]] == ["arrived", "left"]
    assert next(c for c in doc["cases"] if c["id"] == "api[w]")["holes"] == [LABELS[2]]
    assert doc["legend"]["api-missing"]["hole"] is True


# ----------------------------------------------------------------------------- cross


def _golden(direction, **outcomes):
    recs = []
    for name, how in outcomes.items():
        cid = f"golden[{name.replace('_', '-')}@tp2->pp2-{direction}]"
        if how == "ok":
            recs.append(_rec(cid, "passed"))
        elif how == "refused":
            recs.append(_rec(cid, "passed", _checks(refusal="passed")))
        elif how == "wrong":
            recs.append(_rec(cid, "failed", _checks(loaded_canonical="failed")))
        elif how == "unwritten":
            recs.append(_rec(cid, "error", [], error="not written: the writer could not make this artefact: KeyError: 'x'"))
    return {"results": recs}


def test_cross_pairs_and_grid():
    a, b, c = "r1", "r2", "r3"
    assert cross_pairs([a, b, c]) == [(a, c, False), (b, c, False), (c, a, True), (c, b, True)]
    x = cross_table([(a, c, _golden("a->c", model_dist="ok", hf_export="ok")),
                     (b, c, _golden("b->c", model_dist="wrong", hf_export="ok")),
                     (c, a, _golden("c->a", model_dist="refused", hf_export="ok")),
                     (c, b, _golden("c->b", model_dist="unwritten", hf_export="ok"))], [a, b, c])
    assert x.cells[(a, c)].glyph() == "ok 2/2" and not x.cells[(a, c)].rollback
    assert x.cells[(b, c)].glyph() == "FAIL 1/2"
    assert x.cells[(b, c)].problems == [("model-dist", "failed", "checks failed: loaded-canonical")]
    assert x.cells[(c, a)].rollback and x.cells[(c, a)].glyph() == "ok 2/2 (1 refused)"
    assert x.cells[(c, b)].glyph() == "hole 1/2"
    md = sweep.markdown(sweep_table([(a, {"results": []}), (b, {"results": []}), (c, {"results": []})], x))
    assert "| `r2` |  |  | FAIL 1/2 |" in md and "| `r3` | *ok 2/2 (1 refused)* | *hole 1/2* |  |" in md


# ----------------------------------------------------------------------------- run_cli


def _args(argv):
    parser = argparse.ArgumentParser()
    sweep.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["sweep", *argv])


def test_run_cli_from_results(tmp_path, capsys):
    argv = []
    for i, label in enumerate(LABELS):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(_doc(i)))
        argv.append(f"{label}={d if i % 2 else d / 'results.json'}")  # a report dir or the file itself
    assert sweep.run_cli(_args(["--from-results", *argv, "--out", str(tmp_path / "out")])) == 0
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "## Changed cases (5)" in md and "| 5 | `megatron-bridge==0.7.0` |" in md
    assert (tmp_path / "out" / "sweep.html").is_file() and (tmp_path / "out" / "sweep.json").is_file()
    assert sweep.run_cli(_args(["--from-results", f"x={tmp_path / 'nope.json'}", "--out", str(tmp_path / "o2")])) == 2
    assert "not a readable results.json" in capsys.readouterr().err
    assert sweep.run_cli(_args(["--from-results", "no-equals-sign", "--out", str(tmp_path / "o3")])) == 2


def test_run_cli_with_a_driver(tmp_path, capsys):
    seen = []

    def driver(specs, matrix, k, out_dir):
        seen.append((specs, str(matrix), k))
        if specs == ["megatron-bridge==0.5.0"]:
            raise RuntimeError("pip could not resolve megatron-bridge==0.5.0")
        i = LABELS.index(specs[0])
        out_dir.mkdir(parents=True)
        (out_dir / "results.json").write_text(json.dumps(_doc(i)))
        return out_dir / "results.json"

    def cross_driver(writer, reader, rollback, out_dir):
        out_dir.mkdir(parents=True)
        p = out_dir / "results.json"
        p.write_text(json.dumps(_golden(f"{writer[0]}->{reader[0]}", model_dist="refused" if rollback else "ok")))
        return p

    args = _args(["m.yaml", "--releases", "megatron-bridge==0.4.2,0.5.0,0.5.1", "-k", "tp2", "--cross", "--out", str(tmp_path / "s")])
    assert sweep.run_cli(args, driver, cross_driver) == 0
    assert seen == [(["megatron-bridge==0.4.2"], "m.yaml", "tp2"), (["megatron-bridge==0.5.0"], "m.yaml", "tp2"),
                    (["megatron-bridge==0.5.1"], "m.yaml", "tp2")]
    doc = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert doc["releases"][1]["error"].startswith("RuntimeError: pip could not resolve")
    assert next(c for c in doc["cases"] if c["id"] == "arrive[x]")["changes"][0]["release"] == LABELS[2]
    assert len(doc["cross"]["cells"]) == 4
    assert "run failed: RuntimeError" in (tmp_path / "s" / "sweep.md").read_text()
    assert sweep.run_cli(_args(["--releases", "0.5.0", "--out", str(tmp_path / "t")]), driver) == 2
    assert "continues no package" in capsys.readouterr().err
    assert sweep.run_cli(_args(["--releases", "megatron-bridge==0.4.2,0.5.1", "--cross", "--out", str(tmp_path / "u")]), driver) == 2


# ----------------------------------------------------------------------------- ckpt-harness sweep


def test_ckpt_harness_sweep_from_results(tmp_path, capsys):
    from harness import cli

    argv = []
    for i in (0, 2):
        (tmp_path / f"run{i}.json").write_text(json.dumps(_doc(i)))
        argv.append(f"{LABELS[i]}={tmp_path / f'run{i}.json'}")
    out = tmp_path / "out"
    assert cli.main(["sweep", "--from-results", *argv, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"sweep.md", "sweep.html", "sweep.json"}  # nothing built or run
    md = (out / "sweep.md").read_text()
    changed = md.split("## Changed cases")[1].split("## Unchanged")[0]
    assert "`arrive[x]`" in changed and "failed arrived in megatron-bridge==0.5.1" in changed
    assert "arrive[x]" in (out / "sweep.html").read_text()
    doc = json.loads((out / "sweep.json").read_text())
    assert next(c for c in doc["cases"] if c["id"] == "arrive[x]")["changed"]
    assert "sweep: 2 release(s)" in capsys.readouterr().out


def test_ckpt_harness_sweep_calls_the_driver_once_per_release_in_order(tmp_path, monkeypatch):
    from harness import cli
    from harness.gate.sweep import driver as sweep_driver

    calls, crosses = [], []

    def fake_driver(specs, matrix, k, out_dir, cache=None, jobs=1):
        calls.append((specs, matrix, k, cache, jobs))
        out_dir.mkdir(parents=True)
        (out_dir / "results.json").write_text(json.dumps(_doc(2 * (len(calls) - 1))))
        return out_dir / "results.json"

    def fake_cross(writer, reader, rollback, out_dir, cache=None):
        crosses.append((writer, reader, rollback))
        out_dir.mkdir(parents=True)
        (out_dir / "results.json").write_text(json.dumps(_golden("x", model_dist="refused" if rollback else "ok")))
        return out_dir / "results.json"

    def no_build(*a, **kw):
        raise AssertionError("a sweep with a fake driver built an environment")

    monkeypatch.setattr(sweep_driver, "driver", fake_driver)
    monkeypatch.setattr(sweep_driver, "cross_driver", fake_cross)
    monkeypatch.setattr(sweep_driver, "_side", no_build)
    out, cache = tmp_path / "s", tmp_path / "venvs"
    assert cli.main(["sweep", "--releases", "PKG==1,2", "-k", "tp2", "--cross", "--cache", str(cache), "-j", "2", "m.yaml",
                     "--out", str(out)]) == 0
    assert calls == [(["PKG==1"], Path("m.yaml"), "tp2", cache, 2), (["PKG==2"], Path("m.yaml"), "tp2", cache, 2)]
    assert crosses == [(["PKG==1"], ["PKG==2"], False), (["PKG==2"], ["PKG==1"], True)]
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["label"] for r in doc["releases"]] == ["PKG==1", "PKG==2"] and len(doc["cross"]["cells"]) == 2
    assert next(c for c in doc["cases"] if c["id"] == "arrive[x]")["changes"][0]["release"] == "PKG==2"
    assert (out / "sweep.md").is_file() and (out / "sweep.html").is_file()


def test_the_drivers_run_the_gate_steps_once_per_release_set(tmp_path, monkeypatch):
    """driver/cross_driver over fake bump steps: each release set is built once, the matrix run
    writes into the absolute out dir, the cross pair names its sides writer/reader."""
    from harness.gate import bump
    from harness.gate.sweep import driver as sweep_driver

    built, ran, crossed = [], [], []

    def build_side(side, cache):
        built.append((side.name, side.specs, cache))
        side.venv = cache / f"venv-{len(built)}"

    def run_matrix(side, matrix, k, out, jobs=1):
        ran.append((side.venv, matrix, k, out))
        return 1.0

    def run_cross(writer, reader, out, rollback, corpus=None):
        crossed.append((writer.name, writer.venv, reader.name, reader.venv, out, rollback, corpus))
        return out / "writer-to-reader", 1.0

    monkeypatch.setattr(sweep_driver, "_SIDES", {})
    monkeypatch.setattr(sweep_driver, "_CORPORA", {})
    for name, fake in (("build_side", build_side), ("run_matrix", run_matrix), ("run_cross", run_cross)):
        monkeypatch.setattr(bump, name, fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text("")
    cache = tmp_path / "venvs"
    assert sweep_driver.driver(["PKG==1"], Path("m.yaml"), "tp2", Path("r1"), cache=cache) == tmp_path / "r1" / "results.json"
    assert sweep_driver.driver(["PKG==2"], None, None, Path("r2"), cache=cache) == tmp_path / "r2" / "results.json"
    got = sweep_driver.cross_driver(["PKG==1"], ["PKG==2"], True, Path("x"), cache=cache)
    assert got == tmp_path / "x" / "writer-to-reader" / "results.json"
    assert built == [("PKG==1", ["PKG==1"], cache), ("PKG==2", ["PKG==2"], cache)]  # the cross pair reuses both builds
    assert ran == [(cache / "venv-1", tmp_path / "m.yaml", "tp2", tmp_path / "r1"),
                   (cache / "venv-2", bump.ROOT / "matrices" / "gate.yaml", None, tmp_path / "r2")]
    assert crossed == [("writer", cache / "venv-1", "reader", cache / "venv-2", tmp_path / "x", True, tmp_path / "x" / "written-by-writer")]
    # the same writer for another reader: its corpus is reused, not written again
    sweep_driver.cross_driver(["PKG==1"], ["PKG==3"], False, Path("y"), cache=cache)
    assert crossed[-1][-1] == tmp_path / "x" / "written-by-writer"


def test_a_label_and_a_path_may_both_hold_equals_signs(tmp_path):
    """A sweep's own run directories are named r01-megatron-bridge==0.4.2: `--from-results
    megatron-bridge==0.4.2=<that dir>/results.json` must split before the path, not at its last '='."""
    from harness.gate.sweep.cli import _cross_labelled, _labelled

    run = tmp_path / "r01-megatron-bridge==0.4.2"
    run.mkdir()
    (run / "results.json").write_text("{}")
    assert _labelled(f"megatron-bridge==0.4.2={run}/results.json") == ("megatron-bridge==0.4.2", run / "results.json")
    assert _cross_labelled(f"megatron-bridge==0.4.2>megatron-bridge==0.6.2={run}") == (
        "megatron-bridge==0.4.2", "megatron-bridge==0.6.2", run)
    assert _labelled("a==1=missing.json") == ("a==1", Path("missing.json"))  # nothing exists: the last '=' as before
