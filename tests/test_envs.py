"""`ckpt-harness envs list|prune` on a made-up cache: own bytes count hard links once, prune keeps
the baseline of the pins, the env it runs in and one a build holds, and removes the rest."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from harness.gate import envs, envspec

ROOT = Path(__file__).resolve().parent.parent


def make_env(cache: Path, key: str, specs: list[str], payload: int, shared: Path | None = None) -> Path:
    venv = cache / f"venv-{key}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "own.bin").write_bytes(b"x" * payload)
    if shared is not None:
        os.link(shared, venv / "shared.bin")
    (venv / envspec.ENV_JSON).write_text(json.dumps({"specs": specs}))
    (venv / ".complete").touch()
    return venv


def test_list_counts_a_hard_linked_file_as_nobodys_own(tmp_path):
    store = tmp_path / "uv-cache"
    store.mkdir()
    (store / "pkg").write_bytes(b"s" * 5000)
    make_env(tmp_path, "aaaa", ["megatron-bridge==0.5.1"], 100, shared=store / "pkg")
    (e,) = envs.scan(tmp_path)
    assert e.specs == ("megatron-bridge==0.5.1",) and e.complete
    assert e.own_bytes == 100 + len(json.dumps({"specs": ["megatron-bridge==0.5.1"]}))
    assert e.total_bytes == e.own_bytes + 5000


def test_prune_keeps_the_baseline_the_running_env_and_a_locked_build(tmp_path, monkeypatch):
    baseline = make_env(tmp_path, envspec.resolve(ROOT, []).key, [], 10)
    running = make_env(tmp_path, "running0000", ["megatron-core==0.18.2"], 10)
    building = make_env(tmp_path, "building000", ["megatron-core==0.17.1"], 10)
    old = make_env(tmp_path, "old00000000", ["megatron-bridge==0.4.2"], 10)
    monkeypatch.setattr(envs.sys, "prefix", str(running))
    with open(tmp_path / ".lock-building000", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dry = dict((e.key, what) for e, what in envs.prune(tmp_path, ROOT, dry_run=True))
        assert dry["old00000000"] == "would remove" and old.exists()
        done = dict((e.key, what) for e, what in envs.prune(tmp_path, ROOT))
    assert done["old00000000"] == "removed" and not old.exists()
    assert "baseline" in done[baseline.name.removeprefix("venv-")] and baseline.exists()
    assert "runs in it" in done["running0000"] and running.exists()
    assert "lock" in done["building000"] and building.exists()


def test_prune_older_than_keeps_recently_used_envs(tmp_path):
    recent = make_env(tmp_path, "recent00000", ["peft==0.19.0"], 10)
    stale = make_env(tmp_path, "stale000000", ["peft==0.18.1"], 10)
    for p in (stale / ".complete", stale / envspec.ENV_JSON, stale / "bin" / "python"):
        os.utime(p, (1, 1))
    done = dict((e.key, what) for e, what in envs.prune(tmp_path, ROOT, older_than_days=7))
    assert done["stale000000"] == "removed" and not stale.exists()
    assert done["recent00000"].startswith("kept: used in the last 7") and recent.exists()
