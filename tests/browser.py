"""Headless Debian chromium for the tests of the HTML pages (the run report, verdict.html, the sweep
page): the DOM the browser built from a page, a screenshot, and what the tests read off them. No
Python dependency: chromium's own `--dump-dom` and `--screenshot`, parsed with the stdlib; the
screenshot decoded with Pillow (matplotlib's dependency, in the pins).

Where chromium is missing the tests skip, saying how to install it (.ci/run installs it too)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

#: the machine's notes: no sandbox as root, no GPU, nothing fetched, a new empty profile each start
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
INSTALL = "apt-get install -y chromium (Debian's package; .ci/run installs it where apt-get can)"
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def chromium() -> str:
    """The chromium binary, or a skip saying how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(f"chromium is not installed: {INSTALL}")
    return found


def _run(args: list[str], timeout: float = 120) -> str:
    with tempfile.TemporaryDirectory(prefix="ckpt-chromium-") as profile:
        r = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                           timeout=timeout, check=False)
    assert r.returncode == 0, f"chromium {args[0]} exited {r.returncode}: {r.stderr[-2000:]}"
    return r.stdout


def dump_dom(page: Path, fragment: str = "") -> "Dom":
    """The DOM chromium built from `page` (opened at `#fragment` when given), after layout."""
    return Dom.parse(_run(["--dump-dom", page.resolve().as_uri() + (f"#{fragment}" if fragment else "")]))


def screenshot(page: Path, png: Path, size: tuple[int, int] = (1280, 1400)) -> Path:
    """`page` rendered at `size` into `png`."""
    _run([f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", "--hide-scrollbars", page.resolve().as_uri()])
    assert png.is_file(), f"chromium wrote no screenshot of {page}"
    return png


def spread(png: Path) -> tuple[float, int]:
    """(standard deviation of the grey levels, number of distinct colors): a blank page is ~(0, 1)."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        rgb = np.asarray(im.convert("RGB"))
    return float(rgb.mean(axis=2).std()), len(np.unique(rgb.reshape(-1, 3), axis=0))


def not_blank(png: Path) -> bool:
    """The screenshot shows something: grey levels that vary, and more than a handful of colors."""
    std, colors = spread(png)
    return std > 5.0 and colors > 8


@dataclass
class El:
    tag: str
    attrs: dict[str, str]
    parent: "El | None" = None
    children: list["El"] = field(default_factory=list)
    text: str = ""

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def all_text(self) -> str:
        return self.text + "".join(c.all_text() for c in self.children)

    def ancestors(self):
        p = self.parent
        while p is not None:
            yield p
            p = p.parent


class Dom(HTMLParser):
    """The dumped DOM as a tree of El, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.root = El("#document", {})
        self._open = self.root

    @classmethod
    def parse(cls, text: str) -> "Dom":
        dom = cls()
        dom.feed(text)
        return dom

    def handle_starttag(self, tag, attrs):
        el = El(tag, {k: v or "" for k, v in attrs}, self._open)
        self._open.children.append(el)
        if tag not in _VOID:
            self._open = el

    def handle_endtag(self, tag):
        node = self._open
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self._open = node.parent

    def handle_data(self, data):
        self._open.text += data

    def elements(self) -> list[El]:
        return list(self.root.walk())

    def by_id(self, element_id: str) -> El:
        found = [e for e in self.elements() if e.attrs.get("id") == element_id]
        assert len(found) == 1, f"{len(found)} element(s) with id {element_id!r}"
        return found[0]

    def index(self, el: El) -> int:
        return next(i for i, e in enumerate(self.elements()) if e is el)

    # ---------------------------------------------------------------- what the tests read
    def counts(self) -> dict[str, int]:
        """The counts strip: each box's label (a status on the run report) -> its number."""
        return {e.attrs["data-key"]: int(e.attrs["data-n"]) for e in self.by_id("counts").walk() if "data-n" in e.attrs}

    def cells(self, grid_id: str, flagged: bool = False) -> list[str]:
        """The anchor each cell of one grid links to (harness.report.grid.anchor of its case), in
        document order; `flagged`: only the outlined ones."""
        return [e.attrs["href"].lstrip("#") for e in self.by_id(grid_id).walk()
                if "gc" in e.classes and (not flagged or "flag" in e.classes)]

    def case_blocks(self, attr: str = "data-status") -> list[str]:
        """`attr` of each case's details block (class `case`), in document order."""
        return [e.attrs.get(attr, "") for e in self.elements() if e.tag == "details" and "case" in e.classes]

    def dangling(self) -> list[str]:
        """Links within the page whose target id is not on the page."""
        ids = {e.attrs["id"] for e in self.elements() if "id" in e.attrs}
        return [h for e in self.elements() if (h := e.attrs.get("href", "")).startswith("#") and h[1:] not in ids]

    def opened(self, element_id: str) -> bool:
        """Whether the element and every <details> around it are open (a link to it shows it)."""
        el = self.by_id(element_id)
        return all("open" in d.attrs for d in el.ancestors() if d.tag == "details")


def ranked(seq: list[str], order: tuple[str, ...]) -> bool:
    """`seq` never goes back in `order` (what needs a reader first comes first)."""
    idx = [order.index(s) if s in order else len(order) for s in seq]
    return idx == sorted(idx)
