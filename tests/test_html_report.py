"""The HTML report: self-contained, escaped, failures open with their text, a memory chart per phase."""

from html.parser import HTMLParser

from harness.report import grid
from harness.report import html as html_report


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.links, self.srcs = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "a":
            self.links.append(a.get("href"))
        if "src" in a or (tag == "link" and "href" in a):
            self.srcs.append(a)


def _doc():
    mem = {"save": {"0": {"peak_delta": 3 * 2**20, "timeline": [[0.0, 100 * 2**20], [0.1, 103 * 2**20]]},
                    "1": {"peak_delta": 2**20, "timeline": [[0.0, 90 * 2**20], [0.1, 91 * 2**20]]}}}
    failed = {"id": "reshard-weights[x-<tp2>->tp1]", "status": "failed", "memory": mem, "phases": {"total": 1.0},
              "checks": [{"name": "loaded-canonical", "status": "failed", "detail": "1 mismatch(es): value", "max_abs_diff": 1e-3,
                          "tolerance": "bitwise", "mismatches": [{"key": "w<1>", "kind": "value", "expected": "canonical",
                                                                   "actual": "tp1", "detail": "not bitwise equal"}]}]}
    error = {"id": "resume[y]", "status": "error", "error": "rank 1 of 2 raised:\nKeyError: 'step' <script>", "checks": [], "phases": {}}
    ok = {"id": "hf[z]", "status": "passed", "checks": [{"name": "logits", "status": "passed", "detail": "ok"}], "phases": {}}
    return {"matrix": "m.yaml", "wall_s": 3.0, "complete": False, "summary": {"passed": 1, "failed": 1, "error": 1},
            "versions": {"megatron-core": "0.19.2"}, "results": [failed, error, ok]}


def test_report_is_self_contained_escaped_and_shows_failures_and_memory():
    text = html_report.render(_doc(), "smoke <run>")
    p = _Collect()
    p.feed(text)
    assert not p.srcs and "<script>" not in text  # nothing external, and user text is escaped
    assert "&lt;script&gt;" in text and "w&lt;1&gt;" in text and "smoke &lt;run&gt;" in text
    details = [a for t, a in p.tags if t == "details" and a.get("class") == "case"]
    assert [("open" in a) for a in details] == [True, True, False]  # failures and errors open, passes closed
    assert [a["data-status"] for a in details] == ["failed", "error", "passed"]
    anchors = {a.get("id") for t, a in p.tags if a.get("id")}
    assert p.links and all(link.lstrip("#") in anchors for link in p.links)  # every link lands: cells, rows, counts
    cells = [a for t, a in p.tags if t == "a" and a.get("class", "").startswith("gc")]
    assert sorted(a["href"] for a in cells) == sorted(f"#{grid.anchor(r['id'])}" for r in _doc()["results"])  # a cell a case
    assert sum(t == "polyline" for t, _ in p.tags) == 2 and "rank 0: peak Δ 3.0 MiB" in text
    assert "(incomplete run)" in text and "KeyError" in text
