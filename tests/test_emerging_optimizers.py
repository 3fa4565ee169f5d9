"""Muon and Lion (megatron-core's emerging optimizers) in the training cases: the optimizer is built as
Megatron-LM builds it, its own state (Muon's momentum buffer) is primed and judged, and a lost knob
or a corrupted momentum goes red."""

import types

import pytest
from doubles import use_doubles

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.models.training.build import optimizer_built
from harness.orchestration.runner import RunOptions, run_case

pytest.importorskip("emerging_optimizers")

_doubles = use_doubles(test_corrupt_momentum="doubles:CorruptMomentumAfterLoad")

MUON = dict(optimizer_type="muon", muon_fp32_matmul_prec="highest", use_distributed_optimizer=False)


def _spec(src="dp2", dst="dp1", case="reshard-optimizer", **opts):
    opts.setdefault("sharding", "fully_reshardable")
    return CaseSpec(case, "gpt-gqa", opts.pop("backend", "mcore_dist"), Topology.parse(src), Topology.parse(dst),
                    options=tuple(sorted(opts.items())), timeout_s=120)


def test_the_built_optimizers_must_be_the_asked_type():
    assert optimizer_built("adam", "AdamW") and optimizer_built("sgd", "SGD")
    assert optimizer_built("muon", "AdamW+TensorParallelMuon") and optimizer_built("lion", "AdamW+Lion")
    assert not optimizer_built("muon", "AdamW")  # the knob lost: Adam steps everything
    assert not optimizer_built("adam", "AdamW+TensorParallelMuon")
    assert not optimizer_built("lion", "AdamW+TensorParallelMuon")
    assert not optimizer_built("muon", "")  # nothing built is no optimizer of any type


def test_primed_muon_state_is_its_own_momentum_buffer_filled_with_nan():
    """A load must overwrite every primed value: Muon's state is its momentum buffer (made by
    megatron-core's own init_state_fn), never Adam's moments; an optimizer without an init_state_fn
    (torch SGD in Core 0.19.2) is left as Core leaves it."""
    import torch
    from emerging_optimizers.orthogonalized_optimizers import Muon
    from megatron.core.optimizer.emerging_optimizers import _eopt_init_state_fn

    from harness.models import training

    p = torch.nn.Parameter(torch.ones(4, 3))
    muon = Muon([p], lr=1e-3)
    training.prime_optimizer_state(types.SimpleNamespace(optimizer=muon, init_state_fn=_eopt_init_state_fn, config=None))
    assert set(muon.state[p]) == {"momentum_buffer"} and muon.state[p]["momentum_buffer"].isnan().all()

    q = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    training.prime_optimizer_state(types.SimpleNamespace(optimizer=sgd, init_state_fn=None, config=None))
    assert not sgd.state.get(q)


def test_muon_reshard_keeps_every_momentum_buffer():
    r = run_case(_spec(**MUON))
    assert r.status == "passed", r.failure_text()
    assert "momentum_buffer" in r.check("optimizer-state").detail
    assert {c.name for c in r.checks if c.status == "passed"} >= {"propagation", "optimizer-state", "step", "model-weights"}


def test_one_bit_of_a_loaded_momentum_buffer_fails_optimizer_state():
    r = run_case(_spec(backend="test_corrupt_momentum", **MUON))
    assert r.status == "failed" and r.check("optimizer-state").status == "failed"
    (m,) = r.check("optimizer-state").mismatches
    assert m.key.startswith("optimizer.state.momentum_buffer.")


def test_muon_built_as_adam_fails_propagation():
    r = run_case(_spec(**MUON), RunOptions(rank_hooks=("doubles:muon_built_as_adam",)))
    assert r.check("propagation").status == "failed"
    assert "optimizer_type asked 'muon', built 'AdamW'" in r.check("propagation").detail


def test_the_optimizer_config_names_the_layer_wise_field_only_when_it_is_asked(monkeypatch):
    """Found by the Bridge sweep: every optimizer the harness built passed use_layer_wise_distributed_optimizer,
    a field megatron-core 0.17 does not have, so no Core-0.17 job could build its optimizer (the golden corpus of
    Bridge 0.4.2 wrote 2 of 10 artefacts). Megatron-LM names it only for the layer-wise optimizer."""
    import megatron.core.optimizer as mco

    from harness.models.training import TrainOptions, optimizer_config

    asked: list[dict] = []
    monkeypatch.setattr(mco, "OptimizerConfig", lambda **kw: asked.append(kw) or kw)
    optimizer_config(TrainOptions().config)
    assert "use_layer_wise_distributed_optimizer" not in asked[-1] and asked[-1]["use_distributed_optimizer"]
    optimizer_config(TrainOptions(optimizer_type="muon").config)
    assert asked[-1]["use_layer_wise_distributed_optimizer"] is True and asked[-1]["use_distributed_optimizer"] is False
