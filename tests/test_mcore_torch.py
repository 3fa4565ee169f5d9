"""Backend mcore_torch (Megatron-LM's --ckpt-format torch): what it refuses before any world starts, and
what it reads back. Its saves and loads run as the matrix's torch-format cases (extended.yaml)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from harness.backends import get_backend
from harness.backends.mcore_torch import MODEL_FILE, tracked_iteration
from harness.core.topology import Topology


@pytest.fixture
def backend():
    return get_backend("mcore_torch")


def _root(tmp_path, ranks, step=7, state=None):
    it = tmp_path / f"iter_{step:07d}"
    for r in ranks:
        (it / r).mkdir(parents=True)
        torch.save(state or {"model": {"w": torch.arange(4.0)}, "iteration": step}, it / r / MODEL_FILE)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(step))
    return tmp_path


def test_the_tracker_names_the_iteration_and_a_root_without_one_is_refused_by_name(tmp_path):
    assert tracked_iteration(_root(tmp_path / "a", ["mp_rank_00"], step=12)) == tmp_path / "a" / "iter_0000012"
    (tmp_path / "b").mkdir()
    with pytest.raises(FileNotFoundError, match=r"b: no latest_checkpointed_iteration.txt"):
        tracked_iteration(tmp_path / "b")


def test_read_full_reads_a_single_rank_checkpoint_and_refuses_model_parallel_ones(backend, tmp_path):
    root = _root(tmp_path / "one", ["mp_rank_00"], state={"model0": {"w": torch.ones(2)}, "model1": {"w": torch.zeros(3)},
                                                          "optimizer": {"param_groups": []}, "iteration": 7,
                                                          "args": argparse.Namespace(ckpt_format="torch")})
    import megatron.core  # noqa: F401  (registers its safe globals process-wide; a safe_globals context may have undone that)

    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:  # Megatron-LM's pickled args still read: the backend names Core's safe classes for its own load
        one = backend.read_full(None, root)
    finally:
        torch.serialization.add_safe_globals(saved)
    assert sorted(one) == ["model0.w", "model1.w"] and one["model1.w"].shape == (3,)
    with pytest.raises(ValueError, match=r"2 model-parallel rank directories \(mp_rank_00, mp_rank_01"):
        backend.read_full(None, _root(tmp_path / "two", ["mp_rank_00", "mp_rank_01"]))


class Foreign:
    """Not a class megatron-core registers with torch's weights-only unpickler."""


def test_read_full_never_unpickles_arbitrary_objects(backend, tmp_path):
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        backend.read_full(None, _root(tmp_path, ["mp_rank_00"], state={"model": {"w": torch.ones(1)}, "x": Foreign()}))


@pytest.mark.parametrize("opts, message", [
    (SimpleNamespace(sharding="fully_reshardable"), "sharding 'fully_reshardable' does not apply"),
    (SimpleNamespace(sharding="dp_zero_gather_scatter", use_distributed_optimizer=False), "--use-distributed-optimizer"),
])
def test_a_case_asking_another_optimizer_form_is_refused_at_matrix_load(backend, opts, message):
    t = Topology.parse("dp2")
    with pytest.raises(ValueError, match=message):
        backend.validate_case(None, t, t, opts)
    backend.validate_case(None, t, t, SimpleNamespace(sharding="dp_zero_gather_scatter"))  # the torch format's own form
