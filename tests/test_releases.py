"""Release sets (harness/gate/releases.py) from fake metadata, no network: companions from a candidate's
requirements, the Bridge->Core pairing (checked against the recorded tag evidence), conflicting pins'
dependents dropped transitively, a user pin winning over a companion, and unsolvable sets."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.gate import releases
from harness.gate.releases import (
    BRIDGE_CORE,
    Metadata,
    MetadataSource,
    SpecifierSet,
    UnsolvableReleaseSet,
    Version,
    compatible,
    core_line,
    pairing_problem,
    resolve_release_set,
)

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = json.loads((ROOT / "tests" / "data" / "bridge_core_pairing.json").read_text())


class FakeIndex(MetadataSource):
    """An index of Metadata objects: `index(req)` answers the newest matching version, like pip download."""

    def __init__(self, *metas: Metadata):
        self.metas = list(metas)
        self.asked: list[str] = []

    def index(self, requirement: str) -> Metadata:
        self.asked.append(requirement)
        req = releases.Requirement(requirement)
        hits = [m for m in self.metas if m.name == releases.normalize(req.name) and req.specifier.contains(m.version, prereleases=True)]
        if not hits:
            raise LookupError(f"no {requirement} on the fake index")
        return max(hits, key=lambda m: Version(m.version))

    def versions(self, name: str) -> list[str]:
        return sorted({m.version for m in self.metas if m.name == name}, key=Version, reverse=True)


def project(tmp_path: Path, requirements: list[str], constraints: list[str], nodeps: list[str] = ()) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "requirements.txt").write_text("# direct\n" + "".join(f"{x}\n" for x in requirements))
    (root / "constraints.txt").write_text("".join(f"{x}\n" for x in constraints))
    (root / "requirements-nodeps.txt").write_text("".join(f"{x}\n" for x in nodeps))
    return root


def venv(tmp_path: Path, dists: dict[str, tuple[str, list[str]]]) -> Path:
    """A baseline venv holding only dist-info METADATA: name -> (version, Requires-Dist lines)."""
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    for name, (version, requires) in dists.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                    + "".join(f"Requires-Dist: {r}\n" for r in requires) + "\nbody\n")
    return tmp_path / "venv"


def bridge(version: str, *requires: str) -> Metadata:
    return Metadata("megatron-bridge", version, tuple(requires), origin="fake")


def core(version: str, *requires: str) -> Metadata:
    return Metadata("megatron-core", version, tuple(requires), origin="fake")


BASE_PINS = ["megatron-core==0.19.2", "transformers==5.12.1", "peft==0.21.2", "numpy==2.5.5", "torch==2.14.1"]


# ---------------------------------------------------------------- companions


def test_bridge_moves_transformers_and_core_only_where_pins_conflict(tmp_path):
    root = project(tmp_path, BASE_PINS, BASE_PINS + ["tokenizers==0.22.2"], nodeps=["megatron-bridge==0.6.2", "mbridge==0.15.1"])
    idx = FakeIndex(bridge("0.5.1", "transformers<5.9.0,>=5.8.1", "peft>=0.18.1", "torch>=2.6.0", "megatron-core[dev,mlm]",
                           "wandb>=0.28.0", 'nemo-run; extra == "recipes"', "mbridge>=99"),
                    core("0.18.1", "numpy"), core("0.18.2", "numpy"), core("0.19.2", "numpy"),
                    Metadata("transformers", "5.8.1", ("tokenizers<=0.23.0,>=0.22.0",)))
    rs = resolve_release_set(["megatron-bridge==0.5.1"], root, None, idx)
    moved = {c.name: c for c in rs.resolved}
    # peft/torch pins satisfy Bridge's ranges; wandb is not pinned; mbridge is a --no-deps pin only the user moves
    assert set(moved) == {"transformers", "megatron-core"}
    tf = SpecifierSet(moved["transformers"].spec[len("transformers"):])
    assert tf.contains("5.8.3") and not tf.contains("5.12.1")
    assert "megatron-bridge 0.5.1" in moved["transformers"].reason and "5.12.1" in moved["transformers"].reason
    # Core comes from the pairing table, as a range pip takes the newest patch of
    cs = SpecifierSet(moved["megatron-core"].spec[len("megatron-core"):])
    assert cs.contains("0.18.2") and cs.contains("0.18.0") and not cs.contains("0.19.2") and not cs.contains("0.17.1")
    assert "pairing" in moved["megatron-core"].reason and "0.18.2" in moved["megatron-core"].reason
    assert rs.drop_names() == {"transformers", "megatron-core"}
    assert sorted(rs.extra_specs()) == sorted(c.spec for c in rs.resolved)
    assert not rs.mismatch() and not rs.conflicts


def test_bridge_keeps_a_pinned_core_of_its_own_line(tmp_path):
    root = project(tmp_path, ["megatron-core==0.18.1", "transformers==5.8.2"], [], nodeps=["megatron-bridge==0.5.0"])
    rs = resolve_release_set(["megatron-bridge==0.5.1"], root, None, FakeIndex(bridge("0.5.1", "transformers<5.9.0,>=5.8.1", "megatron-core")))
    assert rs.resolved == () and rs.dropped == ()


def test_companion_requirements_are_followed(tmp_path, monkeypatch):
    """The paired Core's own requirements move pins too (a Core 0.15 line: numpy<2)."""
    root = project(tmp_path, BASE_PINS, BASE_PINS)
    monkeypatch.setitem(releases.BRIDGE_CORE, "0.2", "0.15")
    idx = FakeIndex(bridge("0.2.0"), core("0.15.3", "numpy<2.0.0", "torch>=2.6.0"))
    rs = resolve_release_set(["megatron-bridge==0.2.0"], root, None, idx)
    moved = {c.name: c.spec for c in rs.resolved}
    assert set(moved) == {"megatron-core", "numpy"}
    assert not SpecifierSet(moved["numpy"][len("numpy"):]).contains("2.5.5")


def test_unknown_bridge_minor_and_vcs_leave_core_with_a_note(tmp_path):
    root = project(tmp_path, BASE_PINS, [])
    rs = resolve_release_set(["megatron-bridge==9.9.0"], root, None, FakeIndex(bridge("9.9.0", "megatron-core")))
    assert rs.resolved == () and any("no Core pairing" in n for n in rs.notes)
    idx = FakeIndex()
    rs = resolve_release_set(["megatron-bridge @ git+https://example.invalid/b.git@0123456"], root, None, idx)
    assert idx.asked == [] and any("VCS" in n for n in rs.notes)


# ---------------------------------------------------------------- dependents


def test_dependents_of_a_moved_pin_are_dropped_transitively(tmp_path):
    cons = BASE_PINS + ["contourpy==1.4.0", "matplotlib==3.11.2", "pandas==3.1.1", "foo==1.0", "bar==2.0",
                        "winonly==1.0", "extraonly==1.0", "linuxonly==1.0"]
    root = project(tmp_path, BASE_PINS + ["pandas==3.1.1"], cons)
    base = venv(tmp_path, {
        "contourpy": ("1.4.0", ["numpy>=2.0"]),
        "matplotlib": ("3.11.2", ["numpy>=1.25", "contourpy>=1.0.1"]),
        "pandas": ("3.1.1", ['numpy>=2.0.2; python_version < "3.14"', 'numpy>=2.3.3; python_version >= "3.14"']),
        "foo": ("1.0", ["contourpy==1.4.0"]),  # needs exactly the pin contourpy must leave
        "bar": ("2.0", ["contourpy>=1.0"]),
        "winonly": ("1.0", ['numpy>=2; sys_platform == "win32"']),
        "extraonly": ("1.0", ['numpy>=2; extra == "fast"']),
        "linuxonly": ("1.0", ['numpy>=2; sys_platform == "linux"']),
    })
    rs = resolve_release_set(["megatron-core==0.15.3"], root, base, FakeIndex(core("0.15.3", "numpy<2.0.0", "torch>=2.6.0")))
    dropped = {d.name: d for d in rs.dropped}
    assert set(dropped) == {"contourpy", "pandas", "foo", "linuxonly"}
    assert dropped["contourpy"].why.startswith("dependent-of-numpy") and dropped["foo"].why.startswith("dependent-of-contourpy")
    assert dropped["contourpy"].pinned == "1.4.0" and dropped["contourpy"].files == ("constraints.txt",)
    # a dropped direct requirement stays installed, unpinned; a constraints-only one just goes
    assert "pandas" in rs.extra_specs() and "contourpy" not in rs.extra_specs()
    assert {"numpy", "contourpy", "pandas", "foo"} <= rs.drop_names()


def test_a_user_pin_moves_dependents_too(tmp_path):
    root = project(tmp_path, BASE_PINS, BASE_PINS + ["contourpy==1.4.0"])
    base = venv(tmp_path, {"contourpy": ("1.4.0", ["numpy>=2.0"])})
    rs = resolve_release_set(["numpy==1.26.4"], root, base, FakeIndex(Metadata("numpy", "1.26.4", ())))
    assert [d.name for d in rs.dropped] == ["contourpy"]
    rs = resolve_release_set(["numpy==2.4.0"], root, base, FakeIndex(Metadata("numpy", "2.4.0", ())))
    assert rs.dropped == ()


def test_a_dropped_dependent_gets_the_newest_release_that_fits_and_its_requirements_move(tmp_path):
    """datasets 5.2.0 needs huggingface-hub>=1.31, which an old transformers moves below 1.0: left unpinned,
    pip kept the fsspec pin and backtracked to an ancient datasets with no bounds (it then failed at
    import); the set names the newest datasets that accepts the moved hub and follows its requirements."""
    pins = ["megatron-core==0.19.2", "transformers==5.12.1", "huggingface-hub==1.33.0", "datasets==5.2.0", "fsspec==2026.9.0"]
    root = project(tmp_path, ["transformers==5.12.1", "datasets==5.2.0"], pins, nodeps=["megatron-bridge==0.6.2"])
    base = venv(tmp_path, {"datasets": ("5.2.0", ["huggingface-hub>=1.31.0,<3.0", "fsspec<=2026.9.0"]),
                           "transformers": ("5.12.1", ["huggingface-hub>=1.3.0"])})
    ds = [Metadata("datasets", "5.2.0", ("huggingface-hub>=1.31.0,<3.0", "fsspec<=2026.9.0")),
          Metadata("datasets", "5.0.1", ("huggingface-hub>=0.25.0,<2.0", "fsspec>=2023.1.0,<=2026.6.0")),
          Metadata("datasets", "2.2.1", ("huggingface-hub", "fsspec"))]
    others = [bridge("0.3.1", "transformers<5.0.0", "megatron-core"), core("0.16.1"),
              Metadata("transformers", "4.57.6", ("huggingface-hub<1.0,>=0.34.0",)), Metadata("huggingface-hub", "0.36.2", ()),
              Metadata("fsspec", "2026.6.0", ()), Metadata("fsspec", "2026.9.0", ())]
    idx = FakeIndex(*others, *ds)
    rs = resolve_release_set(["megatron-bridge==0.3.1"], root, base, idx)
    moved = {c.name: c for c in rs.resolved}
    assert SpecifierSet(moved["datasets"].spec[len("datasets"):]) == SpecifierSet("==5.0.1")
    assert "5.0.1" in moved["datasets"].reason and "huggingface-hub" in moved["datasets"].reason
    assert not SpecifierSet(moved["fsspec"].spec[len("fsspec"):]).contains("2026.9.0")  # followed: the fsspec pin moves too
    assert "datasets" not in {d.name for d in rs.dropped}
    # a source that cannot list releases leaves the dependent to pip (dropped, as before)
    plain = FakeIndex(*others, *ds)
    plain.versions = lambda name: []
    rs = resolve_release_set(["megatron-bridge==0.3.1"], root, base, plain)
    assert "datasets" in {d.name for d in rs.dropped} and "datasets" not in {c.name for c in rs.resolved}


# ---------------------------------------------------------------- the user wins


def test_user_core_wins_over_the_paired_one_and_the_mismatch_is_noted(tmp_path):
    root = project(tmp_path, BASE_PINS, [], nodeps=["megatron-bridge==0.6.2"])
    idx = FakeIndex(bridge("0.5.1", "megatron-core"), core("0.18.2"), core("0.19.2"))
    rs = resolve_release_set(["megatron-bridge==0.5.1", "megatron-core==0.19.2"], root, None, idx)
    assert all(c.name != "megatron-core" for c in rs.resolved)
    assert len(rs.mismatch()) == 1 and "0.5.1" in rs.mismatch()[0] and "0.19.2" in rs.mismatch()[0]
    assert "megatron-core>=0.18.0,<0.19.0" not in idx.asked  # the paired line was not even looked up


def test_core_alone_reports_the_pinned_bridge_mismatch(tmp_path):
    root = project(tmp_path, BASE_PINS, [], nodeps=["megatron-bridge==0.6.2"])
    rs = resolve_release_set(["megatron-core==0.15.3"], root, None, FakeIndex(core("0.15.3")))
    assert len(rs.mismatch()) == 1 and "0.6.2" in rs.mismatch()[0]
    assert all(c.name != "megatron-bridge" for c in rs.resolved)  # the Bridge is not moved unasked
    rs = resolve_release_set(["megatron-core==0.19.0"], root, None, FakeIndex(core("0.19.0")))
    assert rs.mismatch() == []


def test_user_pin_beats_a_no_deps_candidates_declared_range_and_is_recorded(tmp_path):
    root = project(tmp_path, BASE_PINS, [], nodeps=["megatron-bridge==0.6.2"])
    idx = FakeIndex(bridge("0.5.1", "transformers<5.9.0,>=5.8.1"), core("0.18.2"), Metadata("transformers", "5.12.1", ()))
    rs = resolve_release_set(["megatron-bridge==0.5.1", "transformers==5.12.1"], root, None, idx)
    assert all(c.name != "transformers" for c in rs.resolved)
    assert len(rs.overridden) == 1 and "transformers==5.12.1" in rs.overridden[0] and "<5.9.0" in rs.overridden[0]
    assert "transformers==5.12.1" in rs.markdown()
    with pytest.raises(UnsolvableReleaseSet) as exc:
        resolve_release_set(["megatron-bridge==0.5.1", "transformers==5.12.1"], root, None, idx, strict=True)
    assert len(exc.value.lines) == 1 and "5.12.1" in exc.value.lines[0] and "<5.9.0" in exc.value.lines[0]


# ---------------------------------------------------------------- unsolvable


def test_unsolvable_set_names_each_conflict_on_one_line(tmp_path):
    root = project(tmp_path, BASE_PINS, BASE_PINS)
    idx = FakeIndex(core("0.15.3", "numpy<2.0.0", "torch<2.0"), Metadata("numpy", "2.5.5", ()), Metadata("torch", "2.14.1", ()))
    with pytest.raises(UnsolvableReleaseSet) as exc:
        resolve_release_set(["megatron-core==0.15.3", "numpy==2.5.5", "torch==2.14.1"], root, None, idx)
    lines = exc.value.lines
    assert len(lines) == 2 and str(exc.value).count("\n") == 1
    record = releases.ReleaseSet.failed(["megatron-core==0.15.3"], exc.value)
    assert record.to_dict()["conflicts"] == lines and all(ln in record.markdown() for ln in lines)
    assert any("numpy==2.5.5" in ln and "numpy<2.0.0" in ln for ln in lines)
    assert any("torch==2.14.1" in ln and "torch<2.0" in ln for ln in lines)


def test_two_candidates_contradicting_on_a_pin_are_unsolvable(tmp_path):
    root = project(tmp_path, BASE_PINS, BASE_PINS)
    idx = FakeIndex(core("0.15.3", "numpy<2.0.0"), Metadata("foo", "1.0", ("numpy>=2.6",)), Metadata("numpy", "1.26.4", ()))
    with pytest.raises(UnsolvableReleaseSet) as exc:
        resolve_release_set(["megatron-core==0.15.3", "foo==1.0"], root, None, idx)
    assert len(exc.value.lines) == 1 and "numpy<2.0.0" in exc.value.lines[0] and "numpy>=2.6" in exc.value.lines[0]
    # the same two without the contradiction resolve
    idx.metas[1] = Metadata("foo", "1.0", ("numpy>=1.20",))
    rs = resolve_release_set(["megatron-core==0.15.3", "foo==1.0"], root, None, idx)
    assert [c.name for c in rs.resolved] == ["numpy"]


# ---------------------------------------------------------------- the pairing table vs the tags


def test_pairing_table_matches_the_recorded_bridge_tags():
    """Each Bridge tag's 3rdparty/Megatron-LM Core (tests/data/bridge_core_pairing.json) is of the
    table's Core minor, every table row has tags behind it, and the declared pyproject range (when
    the tag has one) admits that line."""
    rows = [r for r in EVIDENCE["tags"] if r.get("core_version")]
    covered = set()
    for r in rows:
        bv, cv = r["tag"].lstrip("v"), r["core_version"]
        line = core_line(bv)
        if line is None:
            continue
        covered.add(".".join(bv.split(".")[:2]))
        assert SpecifierSet(line[len("megatron-core"):]).contains(Version(cv).base_version), (r["tag"], cv, line)
        assert pairing_problem(bv, cv) is None
        declared = r["pyproject_megatron_core"].split("]", 1)[-1]
        assert not declared.strip() or compatible(SpecifierSet(declared), SpecifierSet(line[len("megatron-core"):])), r
    assert covered == set(BRIDGE_CORE), f"table rows without tag evidence: {set(BRIDGE_CORE) - covered}"


def test_pairing_problem_names_another_line():
    for bminor, cminor in BRIDGE_CORE.items():
        major, minor = (int(x) for x in cminor.split("."))
        assert pairing_problem(f"{bminor}.1", f"{major}.{minor}.7") is None
        problem = pairing_problem(f"{bminor}.1", f"{major}.{minor + 1}.0")
        assert problem and f"{bminor}.1" in problem and f"{major}.{minor + 1}.0" in problem


# ---------------------------------------------------------------- metadata readers, probes, output


def test_wheel_and_tree_metadata(tmp_path):
    whl = tmp_path / "megatron_bridge-0.5.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("megatron_bridge-0.5.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: megatron-bridge\nVersion: 0.5.1\nRequires-Dist: transformers<5.9.0,>=5.8.1\n\n")
    m = releases.read_wheel(whl)
    assert (m.name, m.version, m.requires) == ("megatron-bridge", "0.5.1", ("transformers<5.9.0,>=5.8.1",))
    tree = tmp_path / "Megatron-Bridge"
    (tree / "3rdparty" / "Megatron-LM" / "megatron" / "core").mkdir(parents=True)
    (tree / "src" / "megatron" / "bridge").mkdir(parents=True)
    (tree / "pyproject.toml").write_text('[project]\nname = "megatron-bridge"\ndynamic = ["version"]\ndependencies = ["transformers>=5.0.0,<=5.3.0"]\n')
    (tree / "src" / "megatron" / "bridge" / "package_info.py").write_text("MAJOR = 0\nMINOR = 5\nPATCH = 9\nPRE_RELEASE = 'rc1'\n")
    (tree / "3rdparty" / "Megatron-LM" / "megatron" / "core" / "package_info.py").write_text('MAJOR = 0\nMINOR = 17\nPATCH = 1\nPRE_RELEASE = ""\n')
    t = releases.read_tree(tree)
    assert (t.name, t.version, t.core_version) == ("megatron-bridge", "0.5.9rc1", "0.17.1")
    # the tree's own checked-out Core line wins over the table's (0.5 -> 0.18)
    root = project(tmp_path, BASE_PINS + ["transformers==5.2.0"], [])
    rs = resolve_release_set([str(tree)], root, None, FakeIndex(core("0.17.1"), core("0.18.2")))
    spec = {c.name: c.spec for c in rs.resolved}["megatron-core"]
    assert SpecifierSet(spec[len("megatron-core"):]).contains("0.17.1") and "3rdparty" in rs.resolved[0].reason


def test_pip_index_reads_a_downloaded_wheel_and_caches_exact_pins(tmp_path):
    """PipIndex with pip replaced by a stub that 'downloads' a wheel (counts its calls)."""
    stub = tmp_path / "pip_stub.py"
    stub.write_text(
        "import sys, zipfile, pathlib\n"
        "d = pathlib.Path(sys.argv[sys.argv.index('-d') + 1]); name, v = sys.argv[-1].split('==')\n"
        "open(pathlib.Path(sys.argv[0]).with_suffix('.calls'), 'a').write(sys.argv[-1] + '\\n')\n"
        "with zipfile.ZipFile(d / f'{name}-{v}-py3-none-any.whl', 'w') as z:\n"
        "    z.writestr(f'{name}-{v}.dist-info/METADATA', f'Name: {name}\\nVersion: {v}\\nRequires-Dist: numpy<2\\n\\n')\n")
    src = releases.PipIndex(tmp_path / "cache", pip=[sys.executable, str(stub)])
    for _ in range(2):
        m = src.index("megatron-core==0.15.3")
        assert (m.name, m.version, m.requires) == ("megatron-core", "0.15.3", ("numpy<2",))
    assert stub.with_suffix(".calls").read_text().splitlines() == ["megatron-core==0.15.3"]  # second answer from the cache
    assert json.loads((tmp_path / "cache" / "metadata" / "megatron-core-0.15.3.json").read_text())["version"] == "0.15.3"
    listing = releases.PipIndex(tmp_path / "cache", pip=[sys.executable, "-c", "print('datasets (5.2.0)'); "
                                "print('Available versions: 5.0.1, 5.2.0, 5.3.0rc1, 2.2.1')"])
    assert listing.versions("datasets") == ["5.2.0", "5.0.1", "2.2.1"]  # newest first, no pre-release
    bad = releases.PipIndex(tmp_path / "cache", pip=[sys.executable, "-c", "import sys; print('no such version', file=sys.stderr); sys.exit(1)"])
    with pytest.raises(LookupError, match="no such version"):
        bad.index("nothing==1.0")


@pytest.mark.parametrize("a, b, expected", [
    ("<2.0.0", ">=2.0", False), ("<2", ">=1.25", True), (">1.0", "<1.1", True), ("==1.4.0", "!=1.4.0", False),
    (">=1.4", "!=1.4.0", True), ("<=5.3.0,>=5.0.0", ">=5.8.1,<5.9.0", False), ("~=1.4.2", "<1.5", True), ("", "<1", True),
    (">=0.15.0a0,<0.17.0", ">=0.16.0,<0.17.0", True), ("<0.16.0", ">=0.16.0,<0.17.0", False),
])
def test_compatible(a, b, expected):
    assert compatible(SpecifierSet(a), SpecifierSet(b)) is expected


def test_outputs_carry_asked_resolved_and_why(tmp_path):
    root = project(tmp_path, BASE_PINS, BASE_PINS + ["contourpy==1.4.0"])
    base = venv(tmp_path, {"contourpy": ("1.4.0", ["numpy>=2.0"])})
    rs = resolve_release_set(["megatron-core==0.15.3"], root, base, FakeIndex(core("0.15.3", "numpy<2.0.0"), Metadata("numpy", "1.26.4", ())))
    doc = json.loads(json.dumps(rs.to_dict()))
    assert doc["asked"] == ["megatron-core==0.15.3"] and doc["candidates"][0]["version"] == "0.15.3"
    assert [c["name"] for c in doc["resolved"]] == ["numpy"] and "megatron-core 0.15.3" in doc["resolved"][0]["reason"]
    assert [d["name"] for d in doc["dropped"]] == ["contourpy"]
    md = rs.markdown()
    for piece in ("megatron-core==0.15.3", "numpy<2.0.0", "contourpy", "dependent-of-numpy"):
        assert piece in md and piece in rs.text()


def test_runs_under_a_bare_isolated_interpreter(tmp_path):
    """envspec runs `python -I` (its tests `-I -S`): the module must import without site-packages."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from harness.gate import releases as r; "
            "print(r.compatible(r.SpecifierSet('<2'), r.SpecifierSet('>=2')))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
