"""Backend bridge_training (issue 19): Megatron-Bridge's own save_checkpoint / load_checkpoint over
the live job on CPU. Real runs for what Bridge restores, doubles that plant what a defective resume
would do (each check goes red), and the checks' reading of recorded events."""

from __future__ import annotations

from pathlib import Path

import pytest
from doubles import use_doubles

from harness.backends._bridge_state import state_check
from harness.backends.bridge_training import BridgeTrainingOptions
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case

_doubles = use_doubles(
    test_bridge_scrambled_rng="doubles:BridgeTrainingScrambledRng",
    test_bridge_sample_off_by_one="doubles:BridgeTrainingSampleOffByOne",
)


def _spec(src="dp2", dst="dp2", backend="bridge_training", backend_options=None, **opts):
    opts.setdefault("sharding", "fully_reshardable")
    opts.setdefault("lr_schedule", "warmup-cosine")
    return CaseSpec("resume", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    backend_options=tuple(sorted((backend_options or {}).items())), timeout_s=200)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_a_bridge_resume_restores_weights_optimizer_schedule_train_state_and_rng(tmp_path):
    r = run_case(_spec(), RunOptions(workdir=tmp_path, keep=True))
    c = _checks(r)
    assert c["losses"] == c["final-weights"] == c["train-state"] == c["rng-state"] == "passed", r.failure_text()
    assert "torch.cuda.get_rng_state on CPU" in r.compat_shims
    # the layout Bridge writes
    ckpt = next(Path(n.split(" at ", 1)[1]) for n in r.notes if n.startswith("scratch kept at")) / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert {p.name for p in (ckpt / "iter_0000003").iterdir()} >= {"run_config.yaml", "train_state.pt", "metadata.json", ".metadata"}


def test_a_resume_at_another_tp_says_the_rng_is_not_restored(tmp_path):
    r = run_case(_spec(src="tp2", dst="dp2"), RunOptions(workdir=tmp_path))
    assert _checks(r)["rng-state"] == "passed" and "TP/PP changed" in r.check("rng-state").detail
    assert _checks(r)["losses"] == "passed", r.failure_text()


@pytest.mark.parametrize("backend, check, words", [
    ("test_bridge_scrambled_rng", "rng-state", "python not restored"),
    ("test_bridge_sample_off_by_one", "train-state", "consumed_train_samples"),
])
def test_a_defective_resume_fails_its_check(tmp_path, backend, check, words):
    r = run_case(_spec(backend=backend), RunOptions(workdir=tmp_path))
    assert r.status == "failed" and _checks(r)[check] == "failed", r.failure_text()
    assert words in r.check(check).detail


def _ev(op, iteration, flops=4.5e9, rng="a", tp=1, **place):
    ts = {"step": float(iteration), "consumed_train_samples": 4.0 * iteration, "floating_point_operations_so_far": flops}
    e = {"op": op, "iteration": iteration, "train_state": ts, "rng": {"python": rng, "numpy": "n", "torch": "t", "tracker": "k"},
         "tp": tp, "pp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, **place}
    if op == "load":
        e["flops"] = flops
    return e


def _run(o, save, load):
    return {c.name: c for c in state_check(o, {"save": {"0": [save]}, "load": {"0": [load]}})}


def test_the_checks_read_the_events():
    o = BridgeTrainingOptions()
    ok = _run(o, _ev("save", 3), _ev("load", 3))
    assert all(c.status == "passed" for c in ok.values())
    assert _run(o, _ev("save", 3), _ev("load", 2))["train-state"].status == "failed"  # an iteration nobody saved
    assert _run(o, _ev("save", 3), _ev("load", 3, flops=4499999744.0))["flops"].status == "failed"
    assert _run(o, _ev("save", 3), _ev("load", 3, rng="b"))["rng-state"].status == "failed"
    moved = _run(o, _ev("save", 3, tp=2), _ev("load", 3, rng="b"))["rng-state"]
    assert moved.status == "passed" and "by design" in moved.detail
    ft = _run(BridgeTrainingOptions(finetune=True), _ev("save", 3), _ev("load", 3))
    assert ft["train-state"].status == "failed" and "flops" not in ft  # a finetune that kept the iteration
    assert state_check(o, {"save": {"0": [_ev("save", 3)]}}) == []


# ------------------------------------------------------------------ provider overrides (audit item 5)


class _Provider:
    tensor_model_parallel_size = 1
    params_dtype = fp16 = bf16 = None

    def __init__(self):
        self.finalized = False

    def finalize(self):
        self.finalized = True


class _NewProvider(_Provider):
    def apply_overrides_and_finalize(self, dtype=None, overrides=None):
        self.called = (dtype, dict(overrides))
        self.finalize()


def test_provider_fields_go_through_apply_overrides_and_finalize_and_an_unknown_field_is_refused():
    import torch

    from harness.models.bridge import finalize_provider

    new = _NewProvider()
    finalize_provider(new, torch.bfloat16, {"tensor_model_parallel_size": 2})
    assert new.called == (torch.bfloat16, {"tensor_model_parallel_size": 2}) and new.finalized
    old = _Provider()  # a Bridge before apply_overrides_and_finalize (0.3, 0.4)
    finalize_provider(old, torch.bfloat16, {"tensor_model_parallel_size": 2})
    assert (old.tensor_model_parallel_size, old.bf16, old.fp16, old.finalized) == (2, True, False, True)
    renamed = _Provider()  # a field a bump renamed: an error, never a silently created attribute
    with pytest.raises(AttributeError, match="no attribute 'tensor_parallel_size'"):
        finalize_provider(renamed, torch.float32, {"tensor_parallel_size": 2})
    assert not renamed.finalized and not hasattr(renamed, "tensor_parallel_size")
