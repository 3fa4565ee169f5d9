"""The sweep's drivers: build (or reuse) one release set's environment and run in it, through the
gate's own steps (harness/gate/bump.py), so a sweep release is exactly a gate side.

    driver(specs, matrix, k, out_dir)          -> out_dir/results.json of the matrix run
    cross_driver(writer, reader, rollback, d)  -> results.json of the reader's golden check

Environments live in the venv cache (`--cache`, else envspec's default: $CKPT_HARNESS_HOME or
~/.cache/ckpt-harness) keyed by the pins plus the SPECs, so a release built once is reused by later
sweeps and gates. Within one process a release set is built and import-checked once (`_side`).

Each writer release writes its golden corpus once (`_CORPORA`); every reader of that release checks
the same files, so the newest release, the writer of every rollback pair, writes one corpus.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.gate.sweep.spec import release_label

if TYPE_CHECKING:
    from harness.gate.bump import Side

# bump (and through golden, torch) is imported when a release is built, not with this module:
# `ckpt-harness sweep --from-results` and the tests' fake drivers never pay for it.

#: (specs, cache) -> the built side: the matrix run and the cross pairs of a release share one build
_SIDES: dict[tuple[tuple[str, ...], Path], Side] = {}
#: (writer specs, cache) -> the corpus that writer wrote in this process
_CORPORA: dict[tuple[tuple[str, ...], Path], Path] = {}


def _side(specs: list[str], cache: Path | None, name: str | None = None) -> Side:
    from harness.gate import envspec
    from harness.gate.bump import Side, build_side

    cache = Path(cache or envspec._default_cache())
    key = (tuple(specs), cache)
    if key not in _SIDES:
        side = Side(release_label(specs), list(specs))
        build_side(side, cache)  # raises GateError naming the release when it does not build or import
        _SIDES[key] = side
    built = _SIDES[key]
    return built if name is None else Side(name, built.specs, built.venv, built.build_s, built.versions)


def _matrix_path(matrix: Path | None) -> Path:
    """The matrix as the run in the venv sees it (its cwd is the checkout): a path that exists from
    here is made absolute; otherwise it stays relative to the checkout (matrices/smoke.yaml)."""
    from harness.gate.bump import ROOT

    matrix = Path(matrix) if matrix is not None else Path("matrices/gate.yaml")
    return matrix.resolve() if matrix.exists() else (ROOT / matrix)


def driver(release_specs: list[str], matrix: Path | None, k: str | None, out_dir: Path, cache: Path | None = None,
           jobs: int = 1) -> Path:
    """Build or reuse the release set's environment, run the matrix there; out_dir/results.json."""
    from harness.gate.bump import run_matrix

    out_dir = Path(out_dir).resolve()
    run_matrix(_side(release_specs, cache), _matrix_path(matrix), k, out_dir, jobs)
    return out_dir / "results.json"


def cross_driver(writer_specs: list[str], reader_specs: list[str], rollback: bool, out_dir: Path,
                 cache: Path | None = None) -> Path:
    """The writer release writes a golden corpus under out_dir, the reader checks it (a rollback
    allows a clean refusal); the reader's results.json. A writer's corpus is written once and reused."""
    from harness.gate import envspec
    from harness.gate.bump import run_cross

    writer = _side(writer_specs, cache, "writer")  # generic names: the labels may hold '/' (paths, URLs)
    reader = _side(reader_specs, cache, "reader")
    out_dir = Path(out_dir).resolve()
    key = (tuple(writer_specs), Path(cache or envspec._default_cache()))
    corpus = _CORPORA.setdefault(key, out_dir / "written-by-writer")
    report, _ = run_cross(writer, reader, out_dir, rollback, corpus)
    return report / "results.json"
