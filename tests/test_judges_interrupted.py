"""interrupted-save's judges on synthetic outcomes, in-process: each check passes on what a
correctly interrupted save leaves and fails on what it must not (a save that completed, a hang, a
report without the rank or the write error, a directory megatron-core calls a checkpoint, a tracker
that moved to the interrupted step, a write outside the case dir); and the contract at matrix load."""


import pytest

from harness.cases.shared import damaged_load as cl
from harness.cases import interrupted_save as ints

DIR = "/scratch/case/checkpoints/global_step_2"
SHARDS = ["__0_0.distcp", "__1_0.distcp"]
KILLED = "rank 1 of 2 died: process 1 terminated with signal SIGKILL"


def test_kill_after_shard_passes_with_the_killed_rank_named_and_no_metadata():
    c = ints.judge_interruption("kill-after-shard", 1, KILLED, False, SHARDS, DIR)
    assert c.status == "passed" and "SIGKILL" in c.detail and "__1_0.distcp" in c.detail


@pytest.mark.parametrize("error, files, why", [
    (None, SHARDS, "completed"),  # the save was never interrupted
    ("rank 0 of 2 raised: RuntimeError: boom", SHARDS, "does not say rank 1 was SIGKILLed"),
    (KILLED, ["__0_0.distcp"], "rank 1 had written no shard file"),  # killed before its write
    (KILLED, [*SHARDS, ".metadata", "metadata.json"], "after the finalize"),
])
def test_kill_after_shard_fails_when_the_kill_was_not_the_one_asked(error, files, why):
    c = ints.judge_interruption("kill-after-shard", 1, error, False, files, DIR)
    assert c.status == "failed" and why in c.detail


def test_the_killed_rank_may_be_named_by_the_launcher_instead_of_the_text():
    torchrun = "torchrun world of 2 failed (exit 1):\n  rank      : 1 (local_rank: 1)\n  traceback : Signal 9 (SIGKILL) received"
    assert ints.judge_interruption("kill-after-shard", 1, torchrun, False, SHARDS, DIR, error_rank=1).status == "passed"
    assert ints.judge_interruption("kill-after-shard", 1, torchrun, False, SHARDS, DIR, error_rank=0).status == "failed"


def test_a_hang_fails_every_kind():
    for kind in ("kill-after-shard", "async-not-finalized", "write-error"):
        c = ints.judge_interruption(kind, 1, "world of 2 rank(s) still running after 90s; killed", True, SHARDS, DIR)
        assert c.status == "failed" and "hung" in c.detail


def test_async_not_finalized_needs_shards_and_no_metadata():
    assert ints.judge_interruption("async-not-finalized", 1, None, False, SHARDS, DIR).status == "passed"
    assert ints.judge_interruption("async-not-finalized", 1, None, False, [*SHARDS, "metadata.json"], DIR).status == "failed"
    assert ints.judge_interruption("async-not-finalized", 1, None, False, [], DIR).status == "failed"
    assert ints.judge_interruption("async-not-finalized", 1, "rank 0 raised", False, SHARDS, DIR).status == "failed"


def test_write_error_passes_only_with_efbig_rank_and_path():
    good = f"rank 1 of 2 raised: OSError: [Errno 27] File too large: '{DIR}/__1_0.distcp'"
    assert ints.judge_interruption("write-error", 1, good, False, SHARDS, DIR).status == "passed"
    # what megatron-core 0.19.2 reports (measured): the rank, not the error nor the file
    measured = ("rank 1 of 2 raised: SaveFailedError: CheckpointException ranks:dict_keys([])\n(then rank 0 failed: "
                "RuntimeError: Worker failure: An error is caught while starting worker 0, error: <class 'RuntimeError'>)")
    c = ints.judge_interruption("write-error", 1, measured, False, SHARDS, DIR)
    assert c.status == "failed" and "lacks EFBIG (File too large), the path" in c.detail and "rank 1," not in c.detail
    no_rank = f"rank 0 of 2 raised: OSError: [Errno 27] File too large: '{DIR}/__0_0.distcp'"
    assert "rank 1" in ints.judge_interruption("write-error", 1, no_rank, False, SHARDS, DIR).detail


def test_recognised_incomplete_follows_megatron_cores_answer():
    assert ints.judge_recognised(False, SHARDS).status == "passed"
    c = ints.judge_recognised(True, [*SHARDS, "metadata.json"])
    assert c.status == "failed" and "calls the interrupted directory a checkpoint" in c.detail


def test_tracker_must_stay_on_the_last_complete_step():
    assert ints.judge_tracker("1").status == "passed"
    assert ints.judge_tracker("1\n").status == "passed"
    moved = ints.judge_tracker("2")
    assert moved.status == "failed" and "interrupted step 2" in moved.detail
    assert ints.judge_tracker(None).status == "failed"
    assert ints.judge_tracker("garbage").status == "failed"


def test_scope_fails_on_a_write_outside_the_case_dir():
    inside = ["/scratch/case/checkpoints/global_step_2/__1_0.distcp", "/scratch/case/world-save/rank1.log"]
    assert ints.judge_scope(inside, "/scratch/case").status == "passed"
    c = ints.judge_scope([*inside, "/tmp/stray.pt"], "/scratch/case")
    assert c.status == "failed" and "/tmp/stray.pt" in c.detail
    # a sibling whose name starts with the case dir's is outside it
    assert ints.judge_scope(["/scratch/case-other/x"], "/scratch/case").status == "failed"
    assert ints.judge_scope([], "/scratch/case").status == "not-run"


def test_the_load_is_judged_by_corrupt_loads_judge():
    from pathlib import Path

    dmg = ints.incomplete_damage("kill-after-shard", Path(DIR), SHARDS)
    refused = cl.judge(dmg, cl.Outcome("refused", f"CheckpointingException: {DIR} is not a distributed checkpoint"))
    assert refused[0].status == "passed" and refused[0].detail.startswith("refused (clear, names global_step_2)")
    crashed = cl.judge(dmg, cl.Outcome("crashed", "rank 0 died"))
    assert crashed[0].status == "failed"


@pytest.mark.parametrize("entry, message", [
    ("{case: interrupted-save, models: [gpt-gqa], pairs: ['tp1 -> tp1'], options: {interruption: write-error}}",
     ">= 2 ranks"),
    ("{case: interrupted-save, models: [gpt-gqa], pairs: ['tp2 -> tp2'], options: {interruption: power-cut}}",
     "option 'interruption': expected one of"),
    ("{case: interrupted-save, models: [hf-llama], pairs: ['tp2 -> tp2']}", "takes a GPT zoo model"),
    ("{case: interrupted-save, backends: [bridge_hf], models: [gpt-gqa], pairs: ['tp2 -> tp2']}", "needs a backend that can weights"),
    ("{case: interrupted-save, models: [gpt-gqa], pairs: ['tp2 -> tp2'], xfail: {reason: r, checks: [logits]}}", "never records"),
])
def test_wrong_entries_are_matrix_load_errors(matrix_error, entry, message):
    assert message in matrix_error(entry)
