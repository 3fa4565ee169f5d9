"""Commit subjects stay readable in `git log --oneline`: at most 72 characters, details in the body.

Checked for every commit after BASE, the last commit before the rule was kept; older subjects are
history and stay as they were written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = "26760b0"
LIMIT = 72


def long_subjects(subjects: list[str], limit: int = LIMIT) -> list[str]:
    """The subjects over `limit` characters (each with its length)."""
    return [f"{len(s)}: {s}" for s in subjects if len(s) > limit]


def subjects_since(base: str, root: Path = ROOT) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "log", "--format=%s", f"{base}..HEAD"],
                         capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


def test_the_rule_can_fail():
    assert long_subjects(["x" * 72, "y" * 73]) == [f"73: {'y' * 73}"]
    assert long_subjects([]) == []


def test_every_subject_since_the_rule_fits_in_72_characters():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to read")
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"{BASE} is not in this clone's history (a shallow clone)")
    assert long_subjects(subjects_since(BASE)) == []
