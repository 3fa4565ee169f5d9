"""Mutants of installed code (harness/faults/mutants.py) and the hook that loads one in every process
of a world (harness/faults/mutant_hook.py), on tests/mutation_target.py and on megatron-core as
installed: each operator finds its point, lines never move, the same seed gives the same mutants, a
mutant the compiler cannot tell from the original is equivalent, and a mutant reaches a forked and a
spawned child without the installed file ever changing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.faults import mutant_hook
from harness.faults.mutants import OPERATORS, Mutant, generate, locate, sample

TARGET = "mutation_target"  # tests/ is on every child's PYTHONPATH (conftest.py)


@pytest.fixture(scope="module")
def mutants() -> list[Mutant]:
    return generate(TARGET)


def _one(mutants: list[Mutant], operator: str, original: str, replacement: str) -> Mutant:
    found = [m for m in mutants if (m.operator, m.original.strip(), m.replacement.strip()) == (operator, original, replacement)]
    assert len(found) == 1, (operator, original, replacement, [(m.operator, m.original, m.replacement) for m in mutants])
    return found[0]


def test_each_operator_finds_its_point_and_annotations_are_left_alone(mutants):
    assert _one(mutants, "compare-flip", "<", ">=").function == "shard_range"
    _one(mutants, "bool-flip", "and", "or")
    _one(mutants, "constant", "True", "False")  # strict's default
    _one(mutants, "off-by-one", "end", "(end) - 1")  # values[start:end]
    _one(mutants, "swap-args", "numel, world", "world, numel")
    _one(mutants, "drop-statement", "out.update(b)", "pass")
    _one(mutants, "drop-dict-entry", '"version": 2,', "")
    _one(mutants, "return-none", "out", "None")
    found = {m.operator for m in mutants}
    assert found >= set(OPERATORS) - {"not-dropped", "return-arg", "flag-invert"}, found
    assert not [m for m in mutants if m.original in ("float", "str", "int", "dict")], "an annotation was mutated"
    assert not [m for m in mutants if "print" in m.original], "a statement that only prints is no mutant"
    # what runs at import (module level, a default) and what runs when called
    assert _one(mutants, "drop-statement", "DEBUG = False", "pass").at_import
    assert _one(mutants, "constant", "True", "False").at_import  # strict's default: evaluated by the def
    assert not _one(mutants, "swap-args", "numel, world", "world, numel").at_import


def test_the_rest_of_the_operators_on_a_source_of_their_own(tmp_path):
    src = tmp_path / "flags.py"
    src.write_text("def f(x, ok, load):\n    if not ok:\n        return g(x, strict=ok, is_loading=load)\n"
                   "    return h(x)\n")
    found = {(m.operator, m.original, m.replacement) for m in generate("flags", src)}
    assert ("not-dropped", "not ", "") in found
    assert ("flag-invert", "ok", "not (ok)") in found and ("flag-invert", "load", "not (load)") in found
    assert ("return-arg", "h(x)", "x") in found


def test_a_keyword_that_only_changes_how_a_value_prints_is_left_alone(tmp_path):
    src = tmp_path / "shown.py"
    src.write_text("import logging\nfrom dataclasses import field\nlogger = logging.getLogger(__name__)\n"
                   "x = field(repr=False, default=False)\n")
    assert not [m for m in generate("shown", src) if "getLogger" in m.original]  # the logger only serves log lines
    found = {(m.original, m.replacement, m.col) for m in generate("shown", src) if m.operator == "constant"}
    assert found == {("False", "True", 30)}  # default=False only: repr=False prints, nothing more


def test_lines_never_move_and_every_mutant_compiles(mutants):
    text = locate(TARGET).read_text()
    for m in mutants:
        out = m.apply(text)
        assert out.count("\n") == text.count("\n"), m.id
        compile(out, m.path, "exec")
    # and on installed megatron-core: a sample of its dist_checkpointing mapping, none imported to make them
    core = generate("megatron.core.dist_checkpointing.mapping")
    assert len(core) > 100
    core_text = Path(core[0].path).read_text()
    for m in sample(core, 40, 3):
        assert m.apply(core_text).count("\n") == core_text.count("\n")
        compile(m.apply(core_text), m.path, "exec")


def test_the_same_seed_gives_the_same_mutants_and_another_seed_others(mutants):
    again = generate(TARGET)
    assert [m.id for m in again] == [m.id for m in mutants]
    assert [m.id for m in sample(mutants, 10, 7)] == [m.id for m in sample(again, 10, 7)]
    assert [m.id for m in sample(mutants, 10, 7)] != [m.id for m in sample(mutants, 10, 8)]
    assert sample(mutants, None, 1) == mutants and len(sample(mutants, 10, 1)) == 10
    assert len({m.id for m in mutants}) == len(mutants), "two mutants share an id"


def test_a_mutant_the_compiler_cannot_tell_apart_is_equivalent(mutants):
    text = locate(TARGET).read_text()
    dead = _one(mutants, "drop-statement", "dump(state)", "pass")  # inside `if False:`
    assert dead.equivalent(text)
    live = [m for m in mutants if m is not dead and m.equivalent(text)]
    assert live == [], [(m.operator, m.original) for m in live]


def _child(script: Path, mutant: Mutant | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != mutant_hook.ENV}
    if mutant is not None:
        env[mutant_hook.ENV] = json.dumps(mutant.to_dict())
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


RUN = """
import multiprocessing as mp
import harness  # activates CKPT_HARNESS_MUTANT, as every process of a world does
import mutation_target as t

def child(q):
    import mutation_target as t2
    q.put(t2.take([1.0, 2.0, 3.0, 4.0], 1, 2))

if __name__ == "__main__":
    out = [t.take([1.0, 2.0, 3.0, 4.0], 1, 2)]
    for method in ("fork", "spawn"):
        q = mp.get_context(method).Queue()
        p = mp.get_context(method).Process(target=child, args=(q,))
        p.start(); out.append(q.get(timeout=60)); p.join()
    print(out)
"""


def test_a_mutant_reaches_this_process_and_its_forked_and_spawned_children_and_the_file_stays(mutants, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    before = hashlib.sha256(locate(TARGET).read_bytes()).hexdigest()
    assert _child(script, None) == "[[3.0, 4.0], [3.0, 4.0], [3.0, 4.0]]"
    shifted = _one(mutants, "off-by-one", "end", "(end) - 1")
    assert _child(script, shifted) == "[[3.0], [3.0], [3.0]]"
    assert hashlib.sha256(locate(TARGET).read_bytes()).hexdigest() == before


def test_a_mutant_is_refused_once_its_module_is_imported_or_its_file_changed(mutants, tmp_path, monkeypatch):
    code = "import mutation_target, harness.faults.mutant_hook as h, json, os\n" \
           "try:\n    h.activate(h.Mutant.from_dict(json.loads(os.environ['M'])))\nexcept h.MutantError as e:\n    print(e)\n"
    m = mutants[0]
    env = {**os.environ, "M": json.dumps(m.to_dict())}
    env.pop(mutant_hook.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "is imported already" in out, out
    changed = Mutant(**{**m.__dict__, "sha256": "0" * 64})
    with pytest.raises(mutant_hook.MutantError, match="changed since the mutant was made"):
        mutant_hook.activate(changed)
    assert mutant_hook.active() is None and mutant_hook.ENV not in os.environ
