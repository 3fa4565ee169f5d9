"""A world's own temp directory. What the ranks' libraries write to the system temp stays there for
good otherwise: verl's checkpoint manager leaves a `ckpt_<hash>.lock` per save directory in
tempfile.gettempdir() (verl/utils/fs.py local_mkdir_safe), multiprocessing its `pymp-*` folders
(megatron-core's async results-queue Manager) and torchrun its `torchelastic_*` ones when a world is
killed. The launcher makes one directory per world, the ranks use it as their temp, and it goes
with the world: the harness writes nowhere but its own temp, cache and report dirs."""

from __future__ import annotations

import os
import shutil
import tempfile

PREFIX = "ckpt-harness-tmp-"


def make() -> str:
    """A new world temp directory (short, under the launcher's own temp: unix socket paths fit)."""
    return tempfile.mkdtemp(prefix=PREFIX)


def use(path: str) -> None:
    """In a rank: `path` is the temp of this process (tempfile caches the first answer it gives, and a
    forked rank inherits the parent's) and of every process it starts (TMPDIR)."""
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
