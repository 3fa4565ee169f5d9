"""The truth never comes from the code under test: harness/core/truth.py imports no module of the harness."""

import ast
from pathlib import Path

import torch

from harness.core import truth

ROOT = Path(__file__).resolve().parents[1]


def test_truth_imports_only_torch_and_the_standard_library():
    tree = ast.parse((ROOT / "harness" / "core" / "truth.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    assert imported <= {"__future__", "hashlib", "typing", "torch"}, imported
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_the_seed_derivation_is_stable():
    # a change here silently changes every canonical tensor: pinned
    assert truth.derive_seed(1234, "embedding.word_embeddings.weight") == truth.derive_seed("1234:embedding.word_embeddings.weight")
    assert truth.derive_seed(4321, "x", 0) != truth.derive_seed(4321, "x", 1)
    g = truth.canonical_tensor(type("M", (), {"seed": 1})(), "decoder.final_layernorm.weight", (4,))
    assert torch.all((g > 0.5) & (g < 1.5))
