"""corrupt-load's judge on synthetic outcomes, in-process: a clear and an unclear refusal pass
(the unclear one says so), a silent load of damaged data fails, a silent load that is bitwise
intact passes naming the file never read, a crash or a hang fails."""

import torch

from harness.cases.shared import damaged_load as cl
from harness.core.frames import _ROOT, Frame
from harness.faults.damage import Damage
from harness.run.world import WorldError, WorldTimeout

DMG = Damage("missing-shard", ("__1_0.distcp",), ("__1_0.distcp",), "__1_0.distcp deleted")
TRUTH = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}


def _by_name(checks):
    return {c.name: c for c in checks}


def test_clear_refusal_passes_and_names_the_file():
    text = "CheckpointException: ranks:dict_keys([0])\nFileNotFoundError: No such file: /x/ckpt/__1_0.distcp"
    c = _by_name(cl.judge(DMG, cl.Outcome("refused", text), allowed=("CheckpointException",)))
    assert c["outcome"].status == "passed" and c["outcome"].detail.startswith("refused (clear, names __1_0.distcp)")
    assert "No such file" in c["outcome"].detail  # the root cause (last line) is quoted
    assert c["loaded-canonical"].status == "not-run"


def test_unclear_refusal_passes_but_says_unclear():
    c = _by_name(cl.judge(DMG, cl.Outcome("refused", "EOFError: "), allowed=("EOFError",)))
    assert c["outcome"].status == "passed" and c["outcome"].detail.startswith("refused (unclear")
    assert "__1_0.distcp" in c["outcome"].detail  # says what it should have named


def test_silent_load_of_damaged_data_fails_naming_the_key():
    loaded = {k: v.clone() for k, v in TRUTH.items()}
    loaded["b"][2] = 7.0
    c = _by_name(cl.judge(DMG, cl.Outcome("silent"), TRUTH, loaded, [], "tp1pp2"))
    assert c["outcome"].status == "failed" and c["outcome"].detail.startswith("silent:") and "(b)" in c["outcome"].detail
    assert c["loaded-canonical"].status == "failed" and c["loaded-canonical"].mismatches[0].key == "b"
    missing = {"a": TRUTH["a"]}  # a key the load never filled is corruption too
    assert _by_name(cl.judge(DMG, cl.Outcome("silent", "it warned"), TRUTH, missing))["outcome"].status == "failed"


def test_silent_but_intact_passes_and_says_which_file_was_never_read():
    loaded = {k: v.clone() for k, v in TRUTH.items()}
    c = _by_name(cl.judge(DMG, cl.Outcome("silent"), TRUTH, loaded))
    assert c["outcome"].status == "passed" and c["outcome"].detail.startswith("silent-but-intact")
    assert "__1_0.distcp was never read" in c["outcome"].detail and c["loaded-canonical"].status == "passed"


def test_crash_and_hang_fail():
    for outcome in (cl.outcome_of(WorldError("rank 1 of 2 died: process 1 terminated with signal SIGSEGV", rank=1)),
                    cl.outcome_of(WorldTimeout("world of 2 rank(s) still running after 90s; killed"))):
        assert outcome.kind == "crashed"
        c = _by_name(cl.judge(DMG, outcome))
        assert c["outcome"].status == "failed" and c["outcome"].detail.startswith("crashed:")
    assert "hung" in cl.outcome_of(WorldTimeout("still running")).text


def test_outcome_of_tells_a_refusal_from_a_harness_error():
    tb = ("Traceback (most recent call last):\n  ...\nFileNotFoundError: x\n\nThe above exception was the direct cause of "
          "the following exception:\n\nTraceback (most recent call last):\n  ...\n"
          "cases.shared.damaged_load.RefusedLoadError: CheckpointException: ranks\nFileNotFoundError: /c/__1_0.distcp\n")
    refused = cl.outcome_of(WorldError("rank 0 raised", rank=0, rank_traceback=tb))
    assert refused.kind == "refused" and refused.text.endswith("FileNotFoundError: /c/__1_0.distcp")
    # a rank that failed outside the load (building the model, say) is not a refusal: the case errors
    assert cl.outcome_of(WorldError("rank 0 raised", rank=0, rank_traceback="Traceback\nValueError: bad config\n")) is None


def test_chain_text_flags_base_exceptions():
    class Odd(BaseException):
        pass

    try:
        try:
            raise FileNotFoundError("/c/.metadata")
        except FileNotFoundError as inner:
            raise Odd("ranks:dict_keys([0])") from inner
    except Odd as exc:
        text = cl.chain_text(exc)
    assert text.splitlines()[0].startswith("Odd (a BaseException")
    assert text.splitlines()[1] == "FileNotFoundError: /c/.metadata"


# ---- a refusal passes only through an exception refusal_check allows (issue item 5)

UPSTREAM = Frame("/v/lib/python3.12/site-packages/megatron/core/dist_checkpointing/serialization.py", 340, "load")


def test_a_refusal_through_an_exception_not_allowed_fails_naming_its_frame():
    """A KeyError inside the loader is a crash, not a refusal: the user gets no clear reason."""
    crash = cl.Outcome("refused", "KeyError: 'common_state'", UPSTREAM)
    c = _by_name(cl.judge(DMG, crash))
    assert c["outcome"].status == "failed" and "but with KeyError" in c["outcome"].detail
    assert "megatron/core/dist_checkpointing/serialization.py:340 in load" in c["outcome"].detail
    assert "not one of ['CheckpointingException']" in c["outcome"].detail
    ok = cl.Outcome("refused", "CheckpointingException: /c is not a distributed checkpoint", UPSTREAM)
    assert _by_name(cl.judge(DMG, ok))["outcome"].status == "passed"


def test_an_allowed_exception_raised_by_the_harness_is_not_a_refusal():
    own = Frame(f"{_ROOT}/harness/backends/mcore_dist.py", 200, "load")
    c = _by_name(cl.judge(DMG, cl.Outcome("refused", "CheckpointingException: made up by the harness", own)))
    assert c["outcome"].status == "failed" and "raised in the harness's own code" in c["outcome"].detail


def test_a_base_exception_is_judged_by_its_class_not_the_note_beside_it():
    text = "CheckpointException (a BaseException: `except Exception` does not catch it): ranks:dict_keys([0])\nEOFError"
    out = cl.Outcome("refused", text, UPSTREAM)
    assert out.exc_type == "CheckpointException" and out.message == "ranks:dict_keys([0])"
    assert _by_name(cl.judge(DMG, out))["outcome"].status == "failed"
    assert _by_name(cl.judge(DMG, out, allowed=("CheckpointException",)))["outcome"].status == "passed"


def test_the_rank_names_the_loads_raising_frame_to_the_parent():
    """torch DCP's message embeds the ranks' tracebacks, so the frame travels on its own line."""
    try:
        raise KeyError("step")
    except KeyError as exc:
        message = cl.refusal_message(exc)
    tb = f"Traceback (most recent call last):\n  ...\ncases.shared.damaged_load.RefusedLoadError: {message}\n"
    out = cl.outcome_of(WorldError("rank 0 raised", rank=0, rank_traceback=tb))
    assert out.kind == "refused" and out.text.startswith("KeyError: 'step'") and out.exc_type == "KeyError"
    assert out.frame.function == "test_the_rank_names_the_loads_raising_frame_to_the_parent" and out.frame.own
