"""The run report (`run --html`, `show --html`) as a browser shows it: headless chromium builds its DOM
and a screenshot; the counts, the failing cases before the passing ones, one grid cell per case,
links that land (a cell opens its collapsed case), a screenshot that is not blank. Then each of
those checks on a planted page, going red. The gate's verdict.html and a sweep page of a real gate
are checked the same way in tests/test_gate_honesty.py, where that gate's directory is."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import browser
from harness.report import grid
from harness.report import html as html_report

_MEM = {"save": {"0": {"peak_delta": 3 * 2**20, "timeline": [[0.0, 100 * 2**20], [0.4, 130 * 2**20], [0.8, 110 * 2**20]]},
                 "1": {"peak_delta": 2**20, "timeline": [[0.0, 90 * 2**20], [0.8, 95 * 2**20]]}}}


def _r(case: str, backend: str, model: str, src: str, dst: str, status: str, opts: str = "", **kw) -> dict:
    cid = f"{case}[{backend}-{model}-{src}->{dst}{'-' + opts if opts else ''}]"
    check = {"name": "loaded-canonical", "status": "failed" if status == "failed" else "passed",
             "detail": "1 mismatch(es): value" if status == "failed" else "ok", "tolerance": "bitwise"}
    return {"id": cid, "case": case, "backend": backend, "model": model, "source": src, "target": dst, "status": status,
            "checks": [check], "phases": {"save": 0.5, "load": 0.7, "total": 1.5}, "memory": _MEM, **kw}


def _doc() -> dict:
    """A run in run order as the smoke matrix's comes: passing reshard cases first, the red further down."""
    t1, t2, p2, d2, d1 = "tp1pp1dp1cp1", "tp2pp1dp1cp1", "tp1pp2dp1cp1", "tp1pp1dp2cp1", "tp1pp1dp1cp1"
    results = [
        _r("reshard-weights", "mcore_dist", "gpt-gqa", t1, t2, "passed"),
        _r("reshard-weights", "mcore_dist", "gpt-gqa", t2, p2, "passed"),
        _r("reshard-weights", "mcore_dist", "gpt-tied", t2, p2, "passed"),
        _r("reshard-optimizer", "mcore_dist", "gpt-gqa", d2, d1, "passed", "fully_reshardable"),
        _r("hf-roundtrip", "bridge_hf", "hf-llama", t1, t2, "passed"),
        _r("hf-roundtrip", "bridge_hf", "hf-qwen2", t1, p2, "failed"),
        _r("peft-export", "bridge_peft", "hf-llama", t1, p2, "xfailed", "lora", xfail_reason="Megatron-Bridge 0.6.2 <defect>"),
        _r("peft-export", "bridge_peft", "hf-llama", t1, p2, "error", "canonical_lora",
           error="rank 1 of 2 raised:\nTraceback (most recent call last):\n  File \"x.py\", line 3\nKeyError: 'step'"),
        _r("reshard-optimizer", "mcore_dist", "gpt-gqa", d2, t2, "failed", "dp_reshardable"),
        _r("resume", "mcore_dist", "gpt-gqa", t2, t2, "not-run", not_run_reason="needs 2 CUDA device(s)"),
        _r("reshard-weights", "mcore_dist", "gpt-moe", t2, p2, "passed"),
    ]
    return {"matrix": "matrices/smoke.yaml", "wall_s": 12.0, "complete": True, "versions": {"megatron-core": "0.19.2"},
            "summary": dict(Counter(r["status"] for r in results)), "results": results}


def _page(tmp_path: Path, name: str = "report.html") -> tuple[dict, Path]:
    doc = _doc()
    return doc, html_report.write(doc, tmp_path / name, "smoke <run>")


def test_the_run_report_in_a_browser(tmp_path):
    doc, page = _page(tmp_path)
    dom = browser.dump_dom(page)
    statuses = Counter(r["status"] for r in doc["results"])
    ids = [grid.anchor(r["id"]) for r in doc["results"]]
    assert dom.counts() == dict(statuses)  # the counts first, as the run's statuses
    blocks = dom.case_blocks()
    assert blocks[0] == "failed" and browser.ranked(blocks, grid.RANK), blocks  # failing before passing
    assert Counter(blocks) == statuses  # every case once
    # the red in a table before the grid, the grid before any passing case
    failing_rows = [e.attrs["data-status"] for e in dom.by_id("failing-table").walk() if "data-status" in e.attrs]
    assert sorted(failing_rows) == ["error", "failed", "failed"]
    first_passed = next(e for e in dom.elements() if e.attrs.get("data-status") == "passed" and "case" in e.classes)
    assert dom.index(dom.by_id("failing")) < dom.index(dom.by_id("grid")) < dom.index(first_passed)
    assert sorted(dom.cells("grid-kind")) == sorted(ids)  # one grid cell per case
    assert sorted(dom.cells("grid-arch")) == sorted(i for i in ids if i.startswith(("chf-roundtrip", "cpeft-export")))
    assert dom.dangling() == []
    # a cell links to its case: chromium opens the collapsed kind group around a passing case
    target = first_passed.attrs["id"]
    assert not dom.opened(target) and browser.dump_dom(page, target).opened(target)
    assert browser.not_blank(browser.screenshot(page, tmp_path / "report.png"))


def _plant(monkeypatch, plant: str) -> None:
    if plant == "run order":  # the cases as they ran, passing ones first
        monkeypatch.setattr(html_report, "ranked", list)
    elif plant in ("a cell lost", "a link to nowhere"):
        first = _doc()["results"][0]["id"]
        real = grid.Cell.html

        def cell_html(self):
            if self.case_id != first:
                return real(self)
            return "" if plant == "a cell lost" else real(self).replace(f'href="#{grid.anchor(first)}"', 'href="#nowhere"')

        monkeypatch.setattr(grid.Cell, "html", cell_html)
    elif plant == "a count off":
        real_counts = grid.counts
        monkeypatch.setattr(grid, "counts", lambda items: real_counts((a, n + (s == "passed"), s, h) for a, n, s, h in items))
    elif plant == "blank":
        real_page = grid.page
        monkeypatch.setattr(grid, "page", lambda title, body, css="": real_page(title, body, css + "html{visibility:hidden}"))


@pytest.mark.parametrize("plant", ["run order", "a cell lost", "a link to nowhere", "a count off", "blank"])
def test_each_browser_check_goes_red_on_a_planted_page(tmp_path, monkeypatch, plant):
    browser.chromium()
    _plant(monkeypatch, plant)
    doc, page = _page(tmp_path)
    if plant == "blank":
        assert not browser.not_blank(browser.screenshot(page, tmp_path / "blank.png"))
        return
    dom = browser.dump_dom(page)
    red = {
        "run order": not browser.ranked(dom.case_blocks(), grid.RANK),
        "a cell lost": sorted(dom.cells("grid-kind")) != sorted(grid.anchor(r["id"]) for r in doc["results"]),
        "a link to nowhere": dom.dangling() == ["#nowhere"],
        "a count off": dom.counts() != dict(Counter(r["status"] for r in doc["results"])),
    }
    assert red[plant]
