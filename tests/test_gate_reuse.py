"""The gate reuses a cached baseline only under the same key (harness/gate/baseline_cache.py): the
baseline env, the harness's code digest and the selection; and only when its files are the ones
stored (sha256.json): a changed, missing or added file ends the gate with exit 2. run_gate over fake
environment and matrix steps (no venv, no case): which side ran, and what verdict.md says."""

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
    staged = world.tmp / "g2" / baseline_cache.STAGE / "results.json"  # the verified copy, read instead of the cache
    assert (world.tmp / "g2" / "baseline" / "reused-from").read_text().strip() == str(staged)
    assert staged.read_bytes() == (entry / "results.json").read_bytes()
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


def test_a_baseline_of_the_whole_matrix_serves_a_gate_on_a_slice_cut_down_to_it(world):
    assert world.gate("whole")[0] == 0  # its DIR/baseline: a run of both cases
    whole = world.tmp / "whole" / "baseline"
    code, verdict = world.gate("slice", "hf-roundtrip", baseline_results=whole)
    assert code == 0 and world.ran == ["candidate"], verdict
    assert f"--baseline-results `{whole}`" in _baseline_line(verdict) and "its 2 cases cut down" in _baseline_line(verdict)
    doc = json.loads((world.tmp / "slice" / "baseline" / "results.json").read_text())
    assert doc["selected"] == [IDS[1]] and [r["id"] for r in doc["results"]] == [IDS[1]]
    assert doc["restricted_from"] == 2 and doc["summary"]["passed"] == 1 and sum(doc["summary"].values()) == 1
    # the same selection is handed on as it was: nothing cut, nothing said
    code, verdict = world.gate("same", baseline_results=whole)
    assert code == 0 and world.ran == ["candidate"] and "cut down" not in _baseline_line(verdict)
    assert "restricted_from" not in json.loads((world.tmp / "same" / "baseline" / "results.json").read_text())


@pytest.mark.parametrize("change, words", [
    ("a case it did not run", "did not run 1 of this gate's 3 case(s) (resume[mcore_dist"),
    ("another matrix file", "ran the matrix 'matrices/other.yaml'"),
    ("another environment", "was run in another environment than the baseline's venv-pins2"),
    ("other harness code", "was run by other harness code (code1, this checkout is code2)"),
])
def test_a_baseline_results_that_is_not_this_gates_run_is_refused_naming_why(world, change, words):
    assert world.gate("first")[0] == 0
    given = world.tmp / "first" / "baseline"
    if change == "a case it did not run":
        world.ids = IDS + ["resume[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp1dp2cp1-fully_reshardable]"]
    elif change == "another matrix file":
        doc = json.loads((given / "results.json").read_text())
        doc["matrix"] = "matrices/other.yaml"
        (given / "results.json").write_text(json.dumps(doc))
        world.ids = IDS[:1]  # a slice of what it ran: the matrix file is what then tells them apart
    elif change == "another environment":
        world.env = "pins2"
    else:
        world.digest = "code2"
    code, verdict = world.gate("second", baseline_results=given)
    assert code == 2 and world.ran == [], (change, verdict)
    assert words in verdict, (change, verdict)


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
    for name in ("results.json", "key.json", baseline_cache.SHA256):  # an entry copied under the other key's name
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


# --------------------------------------------------------------------------- the entry's sha256.json
def _corpus(where: Path) -> Path:
    """A stand-in golden corpus: a manifest and a nested shard (the cache never reads their content)."""
    (where / "model" / "ckpt").mkdir(parents=True)
    (where / "manifest.json").write_text(json.dumps({"format": 1, "artefacts": {}}))
    (where / "model" / "ckpt" / "__0_0.distcp").write_bytes(b"\x80\x04weights" * 1000)
    (where / "model" / "ckpt" / ".metadata").write_bytes(b"\x80\x04metadata")
    return where


def _entry_with_corpus(world: World) -> Path:
    assert world.gate("g1")[0] == 0
    key = baseline_cache.key_for("pins1", Path("matrices/smoke.yaml"), None, IDS, "code1", bump.ROOT)
    entry, _ = baseline_cache.lookup(world.cache, key)
    baseline_cache.store_corpus(entry, _corpus(world.tmp / "written"))
    assert baseline_cache.lookup(world.cache, key)[0].corpus == entry.path / "corpus"
    return entry.path


def _change_results(e: Path) -> str:
    doc = json.loads((e / "results.json").read_text())
    doc["results"][0]["status"] = "failed"  # still a whole, well-formed run: only its sha256 tells
    (e / "results.json").write_text(json.dumps(doc))
    return "results.json"


def _change_corpus_file(e: Path) -> str:
    p = e / "corpus" / "model" / "ckpt" / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:-1] + b"!")
    return "corpus/model/ckpt/__0_0.distcp"


def _delete_file(e: Path) -> str:
    (e / "corpus" / "model" / "ckpt" / ".metadata").unlink()
    return "corpus/model/ckpt/.metadata"


def _add_file(e: Path) -> str:
    (e / "corpus" / "model" / "ckpt" / "extra.pt").write_bytes(b"\x80\x04planted")
    return "corpus/model/ckpt/extra.pt"


def _delete_list(e: Path) -> str:
    (e / baseline_cache.SHA256).unlink()
    return baseline_cache.SHA256


def _change_key(e: Path) -> str:
    with open(e / "key.json", "a") as f:
        f.write(" ")  # a byte more: still the same key when parsed, not the file stored
    return "key.json"


@pytest.mark.parametrize("plant, words", [
    (_change_results, "changed since it was stored"), (_change_corpus_file, "changed since it was stored"),
    (_delete_file, "is missing"), (_add_file, "was not stored with the entry"), (_delete_list, "is missing"),
    (_change_key, "changed since it was stored"),
])
def test_a_changed_missing_or_added_file_in_the_entry_is_refused_with_exit_2(world, plant, words):
    entry = _entry_with_corpus(world)
    name = plant(entry)
    code, verdict = world.gate("g2")
    assert code == 2 and world.ran == [], verdict  # neither used nor quietly run again
    assert f"the cached baseline {entry} is refused: {name} {words}" in verdict, verdict
    assert "--fresh-baseline" in verdict
    assert not (world.tmp / "g2" / baseline_cache.STAGE).exists()  # no half-verified copy left to read
    code, verdict = world.gate("g3", fresh_baseline=True)  # what the message offers: run it and store it again
    assert code == 0 and world.ran == ["baseline", "candidate"], verdict
    assert world.gate("g4")[0] == 0 and world.ran == ["candidate"]


def test_the_untouched_entry_with_its_corpus_is_reused_from_a_verified_copy(world):
    entry = _entry_with_corpus(world)
    code, verdict = world.gate("g2")
    assert code == 0 and world.ran == ["candidate"], verdict
    staged = world.tmp / "g2" / baseline_cache.STAGE / "corpus"
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()) == \
        ["manifest.json", "model/ckpt/.metadata", "model/ckpt/__0_0.distcp"]
    shard = Path("model") / "ckpt" / "__0_0.distcp"
    assert (staged / shard).read_bytes() == (entry / "corpus" / shard).read_bytes()


def test_the_corpus_the_gate_uses_is_the_copy_it_verified_not_the_cache_later(tmp_path):
    """lookup copies each file in the read that hashes it; a file changed in the cache afterwards
    (another gate, a disk) is not what restore_corpus hands to the cross-version step."""
    key = baseline_cache.key_for("pins1", Path("m.yaml"), None, IDS, "code1", host="h", environ={})
    res = tmp_path / "results.json"
    res.write_text(json.dumps({"complete": True, "selected": IDS, "harness": "code1", "results": []}))
    stored = baseline_cache.store(tmp_path / "c", key, res, tmp_path)
    baseline_cache.store_corpus(stored, _corpus(tmp_path / "written"))
    shard = stored.path / "corpus" / "model" / "ckpt" / "__0_0.distcp"
    good = shard.read_bytes()
    entry, _ = baseline_cache.lookup(tmp_path / "c", key, tmp_path / "gate" / baseline_cache.STAGE)
    shard.write_bytes(b"planted after the check")
    assert baseline_cache.restore_corpus(entry, tmp_path / "gate" / "cross" / "written-by-baseline")
    assert (tmp_path / "gate" / "cross" / "written-by-baseline" / "model" / "ckpt" / "__0_0.distcp").read_bytes() == good
    unstaged = baseline_cache.Entry(stored.path, key, "?", "?", entry.files)  # no stage: copied from the cache...
    with pytest.raises(baseline_cache.Refused, match="corpus/model/ckpt/__0_0.distcp"):  # ...and checks that copy
        baseline_cache.restore_corpus(unstaged, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_the_cross_step_writes_the_baseline_corpus_once_and_then_reads_the_verified_copy(world, monkeypatch):
    """run_gate end to end with a fake cross-version step: the first gate's baseline corpus is stored
    (its files listed in sha256.json); the second gate's comes from its verified stage, not a new write
    and not the cache; a corpus file changed in the cache then ends the third gate with exit 2."""
    writes: list[str] = []

    def run_cross(writer, reader, out, rollback, corpus=None):
        corpus = out / f"written-by-{writer.name}"
        if not (corpus / "manifest.json").exists():
            writes.append(writer.name)
            _corpus(corpus)
        report = out / f"{writer.name}-to-{reader.name}"
        report.mkdir(parents=True)
        (report / "results.json").write_text(json.dumps({"results": []}))
        return report, 0.0

    monkeypatch.setattr(bump, "run_cross", run_cross)

    def gate(name: str) -> tuple[int, str]:
        world.ran.clear()
        out = world.tmp / name
        code = bump.run_gate(["megatron-bridge==9.9.9"], [], Path("matrices/smoke.yaml"), None, out, world.cache,
                             cross=True, concurrent=False)
        return code, (out / "verdict.md").read_text()

    assert gate("g1")[0] == 0 and writes == ["baseline", "candidate"]
    key = baseline_cache.key_for("pins1", Path("matrices/smoke.yaml"), None, IDS, "code1", bump.ROOT)
    entry = world.cache / baseline_cache.DIR / key.digest
    listed = json.loads((entry / baseline_cache.SHA256).read_text())["files"]
    assert sorted(listed) == ["corpus/manifest.json", "corpus/model/ckpt/.metadata", "corpus/model/ckpt/__0_0.distcp",
                              "key.json", "results.json"]
    writes.clear()
    code, verdict = gate("g2")
    assert code == 0 and world.ran == ["candidate"] and writes == ["candidate"], verdict
    assert (world.tmp / "g2" / "cross" / "written-by-baseline" / "model" / "ckpt" / "__0_0.distcp").is_file()
    assert not (world.tmp / "g2" / baseline_cache.STAGE / "corpus").exists()  # moved into place, not copied again
    _change_corpus_file(entry)
    code, verdict = gate("g3")
    assert code == 2 and world.ran == [] and "corpus/model/ckpt/__0_0.distcp changed since it was stored" in verdict


def test_the_baselines_scale_plans_are_cached_with_it_and_reused_verified(world, monkeypatch):
    """The second gate on unchanged pins plans no production shape on the baseline side: the plan the
    first one made comes from the entry (listed in its sha256.json); a changed plan file is refused."""
    from harness.gate import scale

    planned: list[str] = []

    def harness(side, args, log, on_line=None):
        planned.append(side.name)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({"keys": {}, "side": side.name}))
        return 0

    monkeypatch.setattr(bump, "_harness", harness)
    monkeypatch.setattr(scale, "diff", lambda plan, b, c, bl, cl: [])
    plan = scale.PLANS[0]

    def gate(name: str) -> int:
        world.ran.clear()
        return bump.run_gate(["megatron-bridge==9.9.9"], [], Path("matrices/smoke.yaml"), None, world.tmp / name,
                             world.cache, cross=False, concurrent=False, scale_plans=(plan,))

    assert gate("g1") == 0 and planned == ["baseline", "candidate"]
    key = baseline_cache.key_for("pins1", Path("matrices/smoke.yaml"), None, IDS, "code1", bump.ROOT)
    entry = world.cache / baseline_cache.DIR / key.digest
    listed = json.loads((entry / baseline_cache.SHA256).read_text())["files"]
    stored = [rel for rel in listed if rel.startswith("scale/")]
    assert len(stored) == 1 and stored[0].endswith("/plan.json"), listed
    planned.clear()
    assert gate("g2") == 0 and planned == ["candidate"] and world.ran == ["candidate"]
    reused = world.tmp / "g2" / "scale" / "baseline" / stored[0].split("/")[1] / "plan.json"
    assert json.loads(reused.read_text())["side"] == "baseline"
    (entry / stored[0]).write_text("{}")
    planned.clear()
    assert gate("g3") == 2 and planned == [] and world.ran == []  # refused before anything ran
