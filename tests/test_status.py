"""harness.judge.status: the one place a case's status is decided, each rule with a planted input
that would make it lie if the rule were gone."""

from __future__ import annotations

import pytest

from harness.core.frames import raising_frame
from harness.core.result import CaseResult, Check
from harness.judge.status import api_unavailable, errored, settle
from harness.orchestration import runner
from harness.orchestration.runner import RunOptions, case_envelope

ROOT = runner.__file__.rsplit("/harness/", 1)[0]
SITE = "/v/lib/python3.12/site-packages"


def _tb(*frames: str, last: str) -> str:
    """A formatted traceback through `frames` (paths; `site:` for an installed package, `own:` for this checkout)."""
    lines = ["Traceback (most recent call last):"]
    for i, f in enumerate(frames):
        kind, path = f.split(":", 1)
        lines += [f'  File "{(SITE if kind == "site" else ROOT)}/{path}", line {10 + i}, in fn{i}', "    x = y.z"]
    return "\n".join([*lines, last])


def _result(*checks: Check) -> CaseResult:
    return CaseResult("c[x]", "reshard-weights", "gpt-gqa", "mcore_dist", "tp1", "tp2", checks=list(checks))


# ---- settle: a case passes only on a passed check that judges it


def test_a_case_passes_only_when_a_judging_check_passed():
    r = _result(Check("weights", "passed"))
    settle(r)
    assert r.status == "passed"
    r = _result(Check("weights", "passed"), Check("optimizer", "failed", "diff"))
    settle(r)
    assert r.status == "failed"


def test_a_case_whose_checks_were_all_not_run_is_not_run_with_their_reasons():
    r = _result(Check("to-torch-dist", "not-run", "no converter ships"), Check("roundtrip", "not-run", "nothing to compare"),
                Check("source-unchanged", "passed"), Check("memory-budget:load@rank0", "passed"))
    settle(r)
    assert r.status == "not-run", r
    assert "no converter ships" in r.not_run_reason and "nothing to compare" in r.not_run_reason
    assert r.hole_reason == r.not_run_reason


@pytest.mark.parametrize("checks", [(), (Check("source-unchanged", "passed"),), (Check("memory-budget:save@rank0", "passed"),)])
def test_a_case_that_judged_nothing_is_a_harness_error_never_a_pass(checks):
    r = _result(*checks)
    settle(r)
    assert r.status == "error" and "recorded no check that judges it" in r.error


def test_an_error_the_body_set_stays_an_error():
    r = _result(Check("weights", "passed"))
    r.error = "boom"
    settle(r)
    assert r.status == "error"


# ---- api_unavailable: a missing API only when the harness's own frame looked it up


def test_a_lookup_in_the_harness_own_frame_is_a_missing_api_naming_the_frame():
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401  (imported, as in a run that built one)

    tb = _tb("site:torch/multiprocessing/spawn.py", "own:harness/models/training/loop.py",
             last="AttributeError: 'DistributedOptimizer' object has no attribute 'optimizer_state_keys'")
    got = api_unavailable("AttributeError", "'DistributedOptimizer' object has no attribute 'optimizer_state_keys'", tb)
    assert got.startswith("API not available in megatron-core "), got
    assert "looked up at harness/models/training/loop.py:11 in fn1" in got


@pytest.mark.parametrize("exc_type, message, package", [
    ("ImportError", "cannot import name 'StrictHandling' from 'megatron.core.dist_checkpointing.validation'", "megatron-core"),
    ("ModuleNotFoundError", "No module named 'megatron.bridge.peft.lora_layers'", "megatron-bridge"),
    ("AttributeError", "module 'transformers' has no attribute 'LlamaConfig'", "transformers"),
    ("ModuleNotFoundError", "No module named 'megatron.training.models.gpt'", "megatron-core"),
    # any installed package: an old datasets re-resolved beside the pinned pyarrow (Core 0.16.1 + Bridge 0.3.1)
    ("AttributeError", "module 'pyarrow' has no attribute 'PyExtensionType'", "pyarrow"),
])
def test_a_missing_upstream_name_the_harness_reached_for_is_named_with_package_and_version(exc_type, message, package):
    tb = _tb("own:harness/backends/mcore_dist.py", last=f"{exc_type}: {message}")
    got = api_unavailable(exc_type, message, tb)
    assert got.startswith(f"API not available in {package} ") and message.split("'")[1] in got


@pytest.mark.parametrize("exc_type, message", [
    ("AttributeError", "'AutoBridge' object has no attribute '_runtime_checks'"),
    ("AttributeError", "type object 'ModelType' has no attribute 'encoder_and_decoder'"),
    ("ModuleNotFoundError", "No module named 'megatron.bridge._no_such_module'"),
])
def test_the_same_lookup_failing_inside_upstream_code_is_the_candidate_error(exc_type, message):
    """The harness called a public entry point; the candidate's own code then read a name it does not
    define (or its package's __init__ imports a module it does not ship): a regression of the
    candidate, never a coverage hole."""
    tb = _tb("own:harness/backends/bridge_hf.py", "site:megatron/bridge/models/conversion/auto_bridge.py", last=f"{exc_type}: {message}")
    assert raising_frame(tb).module == "megatron.bridge.models.conversion.auto_bridge"
    assert api_unavailable(exc_type, message, tb) is None


def test_an_attribute_missing_on_a_class_megatron_re_exports_is_not_blamed_on_torch():
    """megatron modules re-export torch.Tensor: a harness frame failing on a tensor the candidate
    returned is the candidate's result, never torch's missing API (torch did not move)."""
    import megatron.core.packed_seq_params as holder

    assert vars(holder).get("Tensor") is __import__("torch").Tensor  # the re-export the old lookup followed
    tb = _tb("own:harness/backends/mcore_dist.py", last="AttributeError: 'Tensor' object has no attribute 'local_shape'")
    assert api_unavailable("AttributeError", "'Tensor' object has no attribute 'local_shape'", tb) is None
    # a class the module's own project defines is still found
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    msg = "'DistributedOptimizer' object has no attribute 'optimizer_state_keys'"
    assert api_unavailable("AttributeError", msg, _tb("own:harness/x.py", last=f"AttributeError: {msg}")).startswith(
        "API not available in megatron-core ")


def test_other_errors_and_bad_data_are_not_called_api_changes():
    own = _tb("own:harness/run/envelope.py", last="x")
    assert api_unavailable("KeyError", "'step'", own) is None
    assert api_unavailable("AttributeError", "'Foo' object has no attribute 'x'", own) is None  # no upstream class
    assert api_unavailable("AttributeError", "'NoneType' object has no attribute 'get'", own) is None
    assert api_unavailable("ImportError", "cannot import name 'x' from 'megatron.core'", "") is None  # no frame: whose lookup?


def test_a_verl_top_level_tests_frame_is_not_the_harness():
    tb = _tb("site:tests/special_sanity/check.py", last="ImportError: cannot import name 'x' from 'megatron.core'")
    assert raising_frame(tb).own is False
    assert api_unavailable("ImportError", "cannot import name 'x' from 'megatron.core'", tb) is None


# ---- errored and the envelope


def test_errored_is_not_applicable_only_for_a_package_the_environment_moved():
    line = "API not available in megatron-core 0.16.1: ImportError: cannot import name 'x' from 'megatron.core' (looked up at h.py:1 in f)"
    r = _result()
    errored(r, f"{line}\nTraceback ...", {"megatron-core"})
    assert r.status == "not-applicable" and r.not_applicable_reason.startswith(line)
    r = _result()
    errored(r, f"{line}\nTraceback ...", {"megatron-bridge"})
    assert r.status == "error" and r.not_applicable_reason is None


class _CheckpointLike(BaseException):
    """torch.distributed.checkpoint's CheckpointException derives from BaseException."""


def test_the_envelope_reports_a_base_exception_and_lets_an_interrupt_through(tmp_path):
    r = _result()
    with case_envelope(r, RunOptions(workdir=tmp_path)):
        raise _CheckpointLike("rank 0 failed to write")
    assert r.status == "error" and "_CheckpointLike: rank 0 failed to write" in r.error
    with pytest.raises(KeyboardInterrupt):
        with case_envelope(_result(), RunOptions(workdir=tmp_path)):
            raise KeyboardInterrupt


def test_the_envelope_settles_a_case_whose_checks_were_all_not_run(tmp_path):
    r = _result()
    with case_envelope(r, RunOptions(workdir=tmp_path)):
        r.checks.append(Check("roundtrip", "not-run", "no converter ships for fsdp_dtensor -> torch_dist"))
    assert r.status == "not-run" and "no converter ships" in r.not_run_reason


def test_a_case_stopped_on_a_failed_check_is_failed_on_that_check_not_an_error():
    """harness.core.result.CheckStop (a check that must stop the case before an upstream deadlock),
    as the parent reads it from a rank's traceback: an expected failure can then name the check."""
    from harness.core.result import CheckStop

    assert str(CheckStop("fsdp-dtensors-agree", "rank 0 holds 3")) == "fsdp-dtensors-agree: rank 0 holds 3"
    tb = _tb("own:harness/backends/mcore_fsdp.py", last="harness.core.result.CheckStop: fsdp-dtensors-agree: rank 0 holds 3 DTensors")
    r = _result()
    errored(r, f"rank 0 of 2 raised:\n{tb}\n(then rank 1 failed: harness.core.result.CheckStop: fsdp-dtensors-agree: x)", set())
    assert r.status == "failed" and r.error is None
    assert [(c.name, c.status) for c in r.checks] == [("fsdp-dtensors-agree", "failed")]
    assert r.checks[0].detail.startswith("rank 0 holds 3 DTensors")
    r = _result()
    errored(r, tb.replace("CheckStop", "RuntimeError"), set())  # any other error stays an error
    assert r.status == "error" and not r.checks


def test_an_import_failing_inside_upstream_code_through_the_harness_import_hook_is_upstream():
    """harness.compat.te's import hook forwards every import: Bridge 0.6.2's own import of a module
    Core 0.15.3 lacks raised through it, and was once called the harness's missing API (a hole)."""
    tb = _tb("own:harness/run/preload.py", "site:megatron/bridge/__init__.py", last="x").replace("\nx", "")
    tb += (f'\n  File "{ROOT}/harness/compat/te.py", line 102, in stand_in_import\n'
           "    return original(name, globals, locals, fromlist, level)\n"
           "ModuleNotFoundError: No module named 'megatron.core._rank_utils'")
    assert raising_frame(tb).module == "megatron.bridge"
    assert api_unavailable("ModuleNotFoundError", "No module named 'megatron.core._rank_utils'", tb) is None
    # the hook's own frame doing more than forwarding is the harness's
    own = tb.replace("return original(name, globals, locals, fromlist, level)", "mod = module(name)")
    assert raising_frame(own).own and api_unavailable("ModuleNotFoundError", "No module named 'megatron.core._rank_utils'", own)
