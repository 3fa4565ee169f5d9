"""The user-facing docs hold together: README.md stays a short guide, every relative link in
README.md and docs/*.md points at a file (and, for `#anchor`, a heading) that exists, docs/index.md
lists every page, and no page but the dated log (docs/measurements.md) names this project's own
issues.

Each check is a function of a root directory that returns its problems (an empty list: none), so
the tests below run it on this checkout and on a planted copy in tmp_path, where it must report the
planted fault; a root without the docs is a problem, never a pass.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 220
#: the dated log: the one page allowed history and issue numbers
LOG_PAGE = "measurements.md"

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ISSUE = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)


def _pages(root: Path) -> list[Path]:
    """README.md and docs/*.md that exist under root."""
    readme = root / "README.md"
    return ([readme] if readme.is_file() else []) + sorted((root / "docs").glob("*.md"))


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def check_readme_length(root: Path, limit: int = README_MAX_LINES) -> list[str]:
    readme = root / "README.md"
    if not readme.is_file():
        return [f"{readme}: missing"]
    n = len(readme.read_text(encoding="utf-8").splitlines())
    if n == 0:
        return [f"{readme}: empty"]
    return [f"README.md: {n} lines, more than {limit}"] if n > limit else []


def check_links(root: Path) -> list[str]:
    """Every relative link of README.md and docs/*.md resolves: the file exists and, for an anchor
    into a .md file, the heading does. http(s) and mailto links are skipped."""
    pages = _pages(root)
    if not pages:
        return [f"{root}: no README.md and no docs/*.md"]
    problems, links = [], 0
    for page in pages:
        for n, line in _prose_lines(page.read_text(encoding="utf-8")):
            for target in _LINK.findall(line):
                if re.match(r"^(https?:|mailto:)", target):
                    continue
                links += 1
                where = f"{page.relative_to(root)}:{n}: [{target}]"
                path_part, _, anchor = target.partition("#")
                dest = (page.parent / path_part).resolve() if path_part else page
                if not dest.exists():
                    problems.append(f"{where}: no such file {path_part}")
                    continue
                if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root.resolve())}")
    if links == 0:
        problems.append(f"{root}: no relative link in README.md or docs/*.md")
    return problems


def check_index(root: Path) -> list[str]:
    """docs/index.md links every docs/*.md page."""
    index = root / "docs" / "index.md"
    if not index.is_file():
        return [f"{index}: missing"]
    pages = [p for p in sorted((root / "docs").glob("*.md")) if p.name != "index.md"]
    if not pages:
        return [f"{root / 'docs'}: no pages besides index.md"]
    linked = {(index.parent / t.partition("#")[0]).resolve()
              for _, line in _prose_lines(index.read_text(encoding="utf-8")) for t in _LINK.findall(line)}
    return [f"docs/index.md does not link docs/{p.name}" for p in pages if p.resolve() not in linked]


def check_no_issue_numbers(root: Path) -> list[str]:
    """No "issue 12" / "issues 10 and 12" reference in README.md or docs/*.md but the dated log."""
    pages = [p for p in _pages(root) if p.name != LOG_PAGE]
    if not pages:
        return [f"{root}: no README.md and no docs/*.md"]
    problems = []
    for page in pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in _ISSUE.finditer(line):
                problems.append(f"{page.relative_to(root)}:{n}: {m.group(0)!r}")
    return problems


CHECKS = (check_readme_length, check_links, check_index, check_no_issue_numbers)


# -- this checkout ---------------------------------------------------------------------------------

def test_readme_is_short():
    assert check_readme_length(ROOT) == []


def test_every_relative_link_resolves():
    assert check_links(ROOT) == []


def test_index_lists_every_page():
    assert check_index(ROOT) == []


def test_no_issue_numbers_outside_the_log():
    assert check_no_issue_numbers(ROOT) == []


# -- each check can fail ---------------------------------------------------------------------------

@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """README.md and docs/ of this checkout, copied: the checks pass on it until a fault is planted."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for check in CHECKS:
        assert check(tmp_path) == [], check.__name__
    return tmp_path


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_a_long_readme_is_reported(copy: Path):
    lines = (copy / "README.md").read_text(encoding="utf-8").splitlines()
    (copy / "README.md").write_text("\n".join(lines + ["filler"] * (221 - len(lines))) + "\n", encoding="utf-8")
    assert check_readme_length(copy) == ["README.md: 221 lines, more than 220"]


def test_a_broken_link_is_reported(copy: Path):
    _append(copy / "docs" / "gate.md", "\nSee [the missing page](no-such-page.md).\n")
    problems = check_links(copy)
    assert len(problems) == 1 and "no such file no-such-page.md" in problems[0], problems


def test_a_broken_anchor_is_reported(copy: Path):
    _append(copy / "README.md", "\nSee [gate](docs/gate.md#no-such-heading) and [ok](docs/gate.md#exit-codes).\n")
    problems = check_links(copy)
    assert len(problems) == 1 and "no heading #no-such-heading" in problems[0], problems


def test_a_link_in_a_code_block_is_not_a_link(copy: Path):
    _append(copy / "docs" / "cli.md", "\n```\n[not a link](nowhere.md)\n```\n")
    assert check_links(copy) == []


def test_a_page_missing_from_the_index_is_reported(copy: Path):
    (copy / "docs" / "new-topic.md").write_text("# New topic\n", encoding="utf-8")
    assert check_index(copy) == ["docs/index.md does not link docs/new-topic.md"]


def test_an_issue_number_is_reported_but_not_in_the_log(copy: Path):
    _append(copy / "docs" / "checks.md", "\nAdded for Issue 12.\n")
    _append(copy / "docs" / LOG_PAGE, "\nMeasured for issue 12.\n")
    problems = check_no_issue_numbers(copy)
    assert len(problems) == 1 and problems[0].startswith("docs/checks.md:") and "Issue 12" in problems[0], problems


def test_upstream_references_are_not_issue_numbers():
    assert not _ISSUE.search("verl #5705, Megatron-LM #6920, Megatron-Bridge#4188")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_no_docs_is_a_failure(tmp_path: Path, check):
    assert check(tmp_path) != []


def test_empty_docs_are_a_failure(tmp_path: Path):
    (tmp_path / "README.md").write_text("", encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Index\n", encoding="utf-8")
    assert check_readme_length(tmp_path) != []
    assert check_links(tmp_path) != []  # no link at all
    assert check_index(tmp_path) != []  # no page to list


@pytest.mark.parametrize("heading, anchor", [
    ("Save/load strategies and gradient buckets", "saveload-strategies-and-gradient-buckets"),
    ("Verdict rules (harness/gate/compare.py, classify.py)", "verdict-rules-harnessgatecomparepy-classifypy"),
    ("SAFE is earned (issue 32), 2026-11-27", "safe-is-earned-issue-32-2026-11-27"),
    ("Precision: the `dtype` axis (fp32 | bf16)", "precision-the-dtype-axis-fp32--bf16"),
])
def test_slug_follows_github(heading: str, anchor: str):
    assert slug(heading) == anchor
