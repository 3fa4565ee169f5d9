"""The case envelope, the golden corpus's rollback refusals and its step decision, and the excepts
that must keep what they catch (issue 22 items 5-6, issue 18 item 8).

A rollback refusal passes only through an exception a user can act on (each backend's `refusals`);
an AttributeError or KeyError inside the older stack is a crash and fails, naming the frame. The
planted ones below are synthetic (exc_type, message, traceback) inputs, plus one world end to end
through `golden.check(..., allow_refusal=True)` with rank hooks defined here."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.backends import get_backend
from harness.core import requires
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.gate import golden, rollback
from harness.models.training import PRIMED_STEP
from harness.orchestration.runner import (
    RunOptions,
    apply_expected_failure,
    case_envelope,
)

_SITE = "/venv/lib/python3.12/site-packages"


def _tb(path: str, line: int, fn: str, code: str, last: str) -> str:
    return ("Traceback (most recent call last):\n"
            f'  File "/work/harness/run/world.py", line 120, in _rank_main\n    value = fn(ctx, arg)\n'
            f'  File "{path}", line {line}, in {fn}\n    {code}\n    ^^^^^^\n{last}\n')


# --------------------------------------------------------------------------- refusals


def test_each_backend_names_its_refusals_and_an_artefact_takes_its_readers():
    assert get_backend("mcore_dist").refusals == ("CheckpointingException",)
    assert "SafetensorError" in get_backend("bridge_hf").refusals
    assert {"SafetensorError", "PeftError"} <= set(get_backend("bridge_peft").refusals)
    assert get_backend("verl_manager").refusals == ("CheckpointingException",)
    peft = next(a for a in golden.ARTEFACTS if a.name == "peft-adapter")
    assert {"CheckpointingException", "SafetensorError", "PeftError"} <= set(peft.refusals())
    model = next(a for a in golden.ARTEFACTS if a.name == "model-dist")
    assert model.refusals() == ("CheckpointingException",)


def test_a_checkpointing_exception_is_a_clean_refusal():
    tb = _tb(f"{_SITE}/megatron/core/dist_checkpointing/validation.py", 88, "verify", "raise CheckpointingException(msg)",
             "megatron.core.dist_checkpointing.core.CheckpointingException: unknown format version 9")
    c = rollback.refusal_of("CheckpointingException", "unknown format version 9", tb, ("CheckpointingException",), "tp2 -> pp2")
    assert c.status == "passed" and "CheckpointingException: unknown format version 9" in c.detail


@pytest.mark.parametrize("exc_type, message, where", [
    ("AttributeError", "'NoneType' object has no attribute 'keys'", ("strategies/torch.py", 412, "load", "state.keys()")),
    ("KeyError", "'step'", ("optimizer/distrib_optimizer.py", 1377, "_set_main_param_and_optimizer_states", "s['step']")),
])
def test_a_crash_inside_the_older_stack_is_not_a_refusal_and_names_its_frame(exc_type, message, where):
    path, line, fn, code = where
    full = f"{_SITE}/megatron/core/{path}"
    c = rollback.refusal_of(exc_type, message, _tb(full, line, fn, code, f"{exc_type}: {message}"), ("CheckpointingException",),
                          "tp2 -> pp2")
    assert c.status == "failed"
    # the frame as every verdict names it (core.frames): the path from its package root on
    assert f"but with {exc_type}" in c.detail and f"raised at megatron/core/{path}:{line} in {fn}: {code}" in c.detail


def test_no_python_exception_is_no_refusal():
    assert rollback.refusal_of(None, "", "", ("CheckpointingException",), "a -> b") is None
    c = rollback.refusal_of("KeyError", "'x'", "no traceback here", ("CheckpointingException",), "a -> b")
    assert c.status == "failed" and "raised at" not in c.detail  # no frame named, none invented


def refuse_mcore_loads() -> None:
    """Rank hook: every mcore_dist load refuses as a newer format would (a clean refusal)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from harness.backends.mcore_dist import McoreDist

    def load(self, ctx, model, directory):
        raise CheckpointingException(f"{directory}: written by a newer megatron-core (planted)")

    McoreDist.load = load


def crash_mcore_loads() -> None:
    """Rank hook: every mcore_dist load crashes with an AttributeError (an older stack's bug)."""
    from harness.backends.mcore_dist import McoreDist

    def load(self, ctx, model, directory):
        return self.planted_missing_attribute

    McoreDist.load = load


def test_a_rollback_passes_a_named_refusal_and_fails_a_crash_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    (made,) = golden.make(corpus, k="model-dist")
    assert made.status == "passed", made.error
    (refused,) = golden.check(corpus, RunOptions(rank_hooks=("test_golden_refusal:refuse_mcore_loads",)), k="model-dist",
                              allow_refusal=True)
    assert refused.status == "passed", refused.failure_text()
    assert refused.check("refusal").status == "passed" and "CheckpointingException" in refused.check("refusal").detail
    (crashed,) = golden.check(corpus, RunOptions(rank_hooks=("test_golden_refusal:crash_mcore_loads",)), k="model-dist",
                              allow_refusal=True)
    detail = crashed.check("refusal").detail
    assert crashed.status == "failed" and "but with AttributeError" in detail
    assert "test_golden_refusal.py" in detail and "in load: return self.planted_missing_attribute" in detail
    (forward,) = golden.check(corpus, RunOptions(rank_hooks=("test_golden_refusal:refuse_mcore_loads",)), k="model-dist")
    assert forward.status == "error" and "CheckpointingException" in forward.error  # no refusal allowed forward


# --------------------------------------------------------------------------- the dp_reshardable step


def _step(status: str) -> Check:
    return Check("step", status, "step at writer: [2.0], at tp1pp1dp1cp1: [-1.0]" if status == "failed" else "step 2.0", tolerance=EXACT)


# every param never loaded, or some (megatron-core 0.19.2 on gpt-gqa dp2 -> dp1: one param per rank keeps the primed step)
@pytest.mark.parametrize("loaded", [[PRIMED_STEP], [PRIMED_STEP, 2.0]])
def test_a_step_the_load_never_wrote_is_the_named_known_defect(loaded):
    step, known = golden.step_not_loaded_check(_step("failed"), [2.0], loaded, [2.0])
    assert known is golden.STEP_NOT_LOADED and step.failed and "known defect" in step.detail and "holds step [2.0]" in step.detail
    r = CaseResult("golden[optim]", "golden", "m", "optim", "a", "b", status="failed", checks=[Check("optimizer-state", "passed"), step])
    apply_expected_failure(known, r)
    assert r.status == "xfailed"


def test_a_restored_step_passes_and_says_the_defect_is_gone():
    step, known = golden.step_not_loaded_check(_step("passed"), [2.0], [2.0], [2.0])
    assert known is None and step.status == "passed" and "does not show" in step.detail


def test_another_step_failure_is_not_excused():
    step, known = golden.step_not_loaded_check(_step("failed"), [2.0], [PRIMED_STEP], [])  # the checkpoint holds no step
    assert known is None and step.failed and "holds step(s) none" in step.detail
    step, known = golden.step_not_loaded_check(_step("failed"), [2.0], [1.0], [2.0])  # a wrong step
    assert known is None and step.failed
    step, known = golden.step_not_loaded_check(_step("failed"), [2.0], [PRIMED_STEP, 3.0], [2.0])  # unloaded and a wrong step
    assert known is None and step.failed


@pytest.mark.parametrize("loaded", [[0.0], [0.0, 2.0]])
def test_a_step_reset_to_0_is_a_plain_failure_not_the_unloaded_step(loaded):
    """Primed state is a sentinel no load writes, so a 0 after the load was written by the load: a
    reset, another defect than the known one, and not excused as it."""
    step, known = golden.step_not_loaded_check(_step("failed"), [2.0], loaded, [2.0])
    assert known is None and step.failed and "known defect" not in step.detail


# --------------------------------------------------------------------------- the case envelope


def test_the_envelope_reports_an_error_with_the_api_line_and_the_traceback_and_cleans_up(tmp_path):
    r = CaseResult("envelope[x]", "c", "m", "b", "s", "t")
    with case_envelope(r, RunOptions(workdir=tmp_path, timeout_s=12.5)) as env:
        scratch = env.case_dir
        assert env.timeout_s == 12.5 and scratch.parent == tmp_path
        raise ModuleNotFoundError("No module named 'megatron.core.dist_checkpointing.gone'")
    assert r.status == "error" and r.error.startswith("API not available in megatron-core ")
    assert "Traceback (most recent call last)" in r.error and "test_golden_refusal.py" in r.error
    assert not scratch.exists() and "total" in r.phases


def test_the_envelope_sets_passed_or_failed_from_the_checks_and_keeps_what_it_is_asked_to(tmp_path):
    ok, bad = CaseResult("e[ok]", "c", "m", "b", "s", "t"), CaseResult("e[bad]", "c", "m", "b", "s", "t")
    with case_envelope(ok, RunOptions(workdir=tmp_path, keep=True), timeout_s=3.0) as env:
        assert env.timeout_s == 3.0
        ok.checks.append(Check("a", "passed"))
    with case_envelope(bad, RunOptions(workdir=tmp_path)):
        bad.checks.append(Check("a", "failed"))
    assert ok.status == "passed" and bad.status == "failed"
    assert any(n.startswith("scratch kept at") for n in ok.notes) and env.case_dir.exists()


def test_explore_keeps_the_api_line_and_the_traceback(tmp_path, monkeypatch):
    import harness.cases.reshard_weights as rw
    from harness.core.topology import Topology
    from harness.core.zoo import get_model
    from harness.orchestration import explore

    def gone(*a, **k):
        raise ImportError("cannot import name 'gone' from 'megatron.core.dist_checkpointing'")

    monkeypatch.setattr(rw, "run_weights", gone)
    r = explore.run_triple(get_model("gpt-gqa"), Topology(), Topology(tp=2), tmp_path)
    assert r.status == "error" and r.error.startswith("API not available in megatron-core")
    assert "in gone" in r.error and not list(tmp_path.iterdir())


def test_run_case_validates_once_and_reports_an_invalid_spec_with_its_traceback(monkeypatch):
    from harness.cases.reshard_weights import ReshardWeights
    from harness.core.spec import CaseSpec
    from harness.core.topology import Topology
    from harness.orchestration.runner import run_case

    calls = []
    real = ReshardWeights.validate
    monkeypatch.setattr(ReshardWeights, "validate", lambda self, spec: calls.append(spec) or real(self, spec))
    spec = CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(tp=2), Topology(), requires=("cuda",))
    r = run_case(spec, RunOptions(dist_backend="gloo"))
    assert r.status == "not-run" and len(calls) == 1
    bad = run_case(CaseSpec("reshard-weights", "gpt-gqa", "mcore_dist", Topology(), Topology(), options=(("dtype", "fp8"),)))
    assert bad.status == "error" and "option 'dtype'" in bad.error and "Traceback" in bad.error


# --------------------------------------------------------------------------- requires: a broken driver


def test_a_broken_cuda_driver_is_no_device_with_the_reason_and_other_errors_propagate(monkeypatch):
    import torch

    def broken():
        raise RuntimeError("Unexpected error from cudaGetDeviceCount(): driver/library version mismatch")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    requires.probe.cache_clear()
    try:
        m = requires.probe()
        assert m.cuda_devices == 0 and "driver/library version mismatch" in m.cuda_error
        (reason,) = requires.unmet(("cuda",), 1, machine=m)
        assert "this machine has 0 (torch.cuda.device_count raised RuntimeError: Unexpected error" in reason
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 / 0)
        requires.probe.cache_clear()
        with pytest.raises(ZeroDivisionError):  # a bug, not "no device"
            requires.probe()
    finally:
        requires.probe.cache_clear()


def test_the_harness_looking_up_an_api_the_older_reader_lacks_is_no_refusal():
    """Found by the architecture sweep: Bridge 0.4.2 reading 0.6.2's fsdp_dtensor corpus failed its
    'refusal' check with the harness's own AttributeError (no load_fsdp_dtensor_checkpoint in 0.4.2's
    training.checkpointing): the harness could not drive that reader, a hole, never a failed refusal.
    The same AttributeError raised inside the older stack's own frames stays a crash."""
    message = "module 'megatron.bridge.training.checkpointing' has no attribute 'load_fsdp_dtensor_checkpoint'"
    import harness

    checkout = Path(harness.__file__).resolve().parent  # this checkout's harness/, wherever it is cloned
    own = _tb(f"{checkout}/backends/mcore_fsdp.py", 186, "load_fsdp_dtensor",
              "bridge.load_fsdp_dtensor_checkpoint(...)", f"AttributeError: {message}")
    assert rollback.refusal_of("AttributeError", message, own, ("CheckpointException",), "dp2 -> dp1") is None
    theirs = _tb(f"{_SITE}/megatron/bridge/training/checkpointing.py", 2210, "load", "ckpt.load_fsdp_dtensor_checkpoint()",
                 f"AttributeError: {message}")
    assert rollback.refusal_of("AttributeError", message, theirs, ("CheckpointException",), "dp2 -> dp1").status == "failed"
