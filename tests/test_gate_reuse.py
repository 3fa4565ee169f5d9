"""The gate reuses a cached baseline only under the same key (harness/gate/baseline_cache.py): the
baseline env, the harness's code digest and the selection. run_gate over fake environment and
matrix steps (no venv, no case): which side ran, and what verdict.md says about the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.gate import archs, baseline_cache, bump, envspec

IDS = ["reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]",
       "hf-roundtrip[bridge_hf-hf-llama-tp2pp1dp1cp1->tp1pp2dp1cp1]"]


class World:
    """Fake gate steps: the baseline env's key, the code digest and the selection are knobs."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp, self.cache, self.env, self.digest, self.ids, self.ran = tmp, tmp / "cache", "pins1", "code1", list(IDS), []
        monkeypatch.setattr(bump, "build_side", self.build_side)
        monkeypatch.setattr(bump, "run_matrix", self.run_matrix)
        monkeypatch.setattr(bump, "code_digest", lambda: self.digest)
        monkeypatch.setattr(baseline_cache, "selection", lambda matrix, k: [i for i in self.ids if not k or k in i])
        monkeypatch.delenv("CKPT_TEST_PLANT", raising=False)

    def build_side(self, side, cache):
        key = self.env if side.name == "baseline" else "cand1"
        side.venv = self.tmp / "venvs" / f"venv-{key}"
        side.venv.mkdir(parents=True, exist_ok=True)
        (side.venv / envspec.ENV_JSON).write_text(json.dumps({"specs": side.specs, "key": key}))

    def run_matrix(self, side, matrix, k, out, jobs=2, reuse=True):
        self.ran.append(side.name)
        ids = [i for i in self.ids if not k or k in i]
        out.mkdir(parents=True, exist_ok=True)
        doc = {"complete": True, "selected": ids, "harness": self.digest, "matrix": str(matrix),
               "environment": json.loads((side.venv / envspec.ENV_JSON).read_text()),
               archs.KEY: {"architectures": ["LlamaForCausalLM"], "source": "fake", "error": None},
               "results": [{"id": i, "status": "passed", "checks": []} for i in ids]}
        (out / "results.json").write_text(json.dumps(doc))
        bump.read_imports(side, doc)
        return 1.0

    def gate(self, name: str, k: str | None = None, **kw) -> tuple[int, str]:
        self.ran.clear()
        out = self.tmp / name
        code = bump.run_gate(["megatron-bridge==9.9.9"], [], Path("matrices/smoke.yaml"), k, out, self.cache,
                             cross=False, concurrent=False, **kw)
        return code, (out / "verdict.md").read_text()


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    return World(tmp_path, monkeypatch)


def _baseline_line(verdict: str) -> str:
    return next(ln for ln in verdict.splitlines() if ln.startswith("- Baseline:"))


def test_the_second_gate_reuses_the_first_ones_baseline_and_the_verdict_names_it(world):
    code, verdict = world.gate("g1")
    assert code == 0 and world.ran == ["baseline", "candidate"], verdict
    key = baseline_cache.key_for("pins1", Path("matrices/smoke.yaml"), None, IDS, "code1", bump.ROOT)
    assert f"cached under key `{key.digest}`" in _baseline_line(verdict)
    code, verdict = world.gate("g2")
    assert code == 0 and world.ran == ["candidate"], verdict
    line = _baseline_line(verdict)
    entry = world.cache / baseline_cache.DIR / key.digest
    assert "**reused from the cache**" in line and str(entry) in line and key.digest in line and "stored 20" in line
    assert (world.tmp / "g2" / "baseline" / "reused-from").read_text().strip() == str(entry / "results.json")
    assert "- Sides:" not in verdict  # one side ran: nothing to overlap


@pytest.mark.parametrize("change", ["code digest", "env", "selection -k", "selection cases"])
def test_another_key_is_never_used(world, change):
    assert world.gate("g1")[0] == 0
    k = None
    if change == "code digest":
        world.digest = "code2"
    elif change == "env":
        world.env = "pins2"
    elif change == "selection -k":
        k = "hf-roundtrip"
    else:
        world.ids = IDS + ["resume[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp1dp2cp1-fully_reshardable]"]
    code, verdict = world.gate("g2", k)
    assert code == 0 and world.ran == ["baseline", "candidate"], (change, verdict)
    assert "no cached baseline for key" in _baseline_line(verdict)
    assert len(list((world.cache / baseline_cache.DIR).iterdir())) == 2  # both keys kept, neither replaced


def test_fresh_baseline_runs_it_again_under_the_same_key(world):
    world.gate("g1")
    code, verdict = world.gate("g2", fresh_baseline=True)
    assert code == 0 and world.ran == ["baseline", "candidate"]
    assert "(--fresh-baseline)" in _baseline_line(verdict)
    assert world.gate("g3")[1].count("**reused from the cache**") == 1 and world.ran == ["candidate"]


def test_a_planted_variable_is_part_of_the_key(world, monkeypatch):
    world.gate("g1")
    monkeypatch.setenv("CKPT_TEST_PLANT", "alpha")
    world.gate("g2")
    assert world.ran == ["baseline", "candidate"]


def test_a_partial_run_is_never_cached_and_an_entry_under_another_key_is_refused(tmp_path):
    key = baseline_cache.key_for("pins1", Path("m.yaml"), None, IDS, "code1", host="h", environ={})
    res = tmp_path / "results.json"
    res.write_text(json.dumps({"complete": False, "selected": IDS, "harness": "code1", "results": []}))
    assert baseline_cache.store(tmp_path / "c", key, res, tmp_path) is None
    res.write_text(json.dumps({"complete": True, "selected": IDS, "harness": "code1", "results": []}))
    entry = baseline_cache.store(tmp_path / "c", key, res, tmp_path)
    assert baseline_cache.lookup(tmp_path / "c", key)[0] == entry
    other = baseline_cache.key_for("pins1", Path("m.yaml"), None, IDS, "code2", host="h", environ={})
    (tmp_path / "c" / baseline_cache.DIR / other.digest).mkdir()
    for name in ("results.json", "key.json"):  # an entry copied under the other key's name
        (tmp_path / "c" / baseline_cache.DIR / other.digest / name).write_bytes((entry.path / name).read_bytes())
    found, why = baseline_cache.lookup(tmp_path / "c", other)
    assert found is None and "another key" in why


def test_concurrent_sides_run_at_once_and_say_so(world, monkeypatch):
    import threading

    started = threading.Barrier(2, timeout=10)  # both sides must be inside run_matrix together
    real = world.run_matrix

    def together(side, *a, **kw):
        started.wait()
        return real(side, *a, **kw)

    monkeypatch.setattr(bump, "run_matrix", together)
    out = world.tmp / "gc"
    code = bump.run_gate(["megatron-bridge==9.9.9"], [], Path("matrices/smoke.yaml"), None, out, world.cache,
                         cross=False, concurrent=True)
    verdict = (out / "verdict.md").read_text()
    assert code == 0 and sorted(world.ran) == ["baseline", "candidate"], verdict
    assert "- Sides: the baseline and candidate matrix runs went at once (--concurrent)." in verdict
