"""async-save: its judges in-process (each passes on what a correct async save leaves and fails on
what it must not), its contract at matrix load, and real worlds with a planted fault, each turning
its named check red: an async finalize skipped, a tracker written before the finalize, an async
checkpoint that differs from the sync one, a finalize that swallows the lost write, a load that
swallows the refusal. The green runs are the matrices' async-save entries."""

from pathlib import Path

import pytest
import torch
from doubles import use_doubles

from harness.cases import async_save as asv
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.judge.checks import async_equals_sync_check, tracker_names_check
from harness.judge.ckpt_content import differences, read_tree
from harness.orchestration.runner import RunOptions, run_case

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_doubles = use_doubles(
    test_skip_async_finalize="doubles:SkipAsyncFinalize",
    test_tracker_before_finalize="doubles:TrackerBeforeFinalize",
    test_corrupt_async_save="doubles:CorruptAsyncSave",
    test_swallow_training_load_errors="doubles:SwallowTrainingLoadErrors",
    test_swallow_finalize_errors="doubles:SwallowFinalizeErrors",
)


def _spec(fault="none", backend="mcore_dist", src="tp2", dst="tp2", **backend_options):
    backend_options = {"async_save": "mcore", "layout": "megatron-lm", **backend_options}
    return CaseSpec("async-save", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst),
                    options=(("fault", fault), ("sharding", "fully_reshardable")), axes=("fault",),
                    backend_options=tuple(sorted(backend_options.items())), timeout_s=120)


# ------------------------------------------------------------------ the content reader and async-equals-sync


def _dcp(directory: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def _state(flip: bool = False) -> dict:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    if flip:
        w.view(-1).view(torch.int32)[5] ^= 1 << 22
    return {"layer.weight": w, "step": torch.tensor(7), "common": {"iteration": 2, "args": ["tp", 2]}}


def test_two_dcp_checkpoints_of_one_state_read_back_equal(tmp_path):
    a, la = read_tree(_dcp(tmp_path / "sync" / "iter_0000002", _state()).parent)
    b, lb = read_tree(_dcp(tmp_path / "async" / "iter_0000002", _state()).parent)
    assert "iter_0000002/layer.weight" in a and not differences(a, b)
    check = async_equals_sync_check(a, b, (la, lb))
    assert check.status == "passed" and "raw .distcp bytes identical" in check.detail


def test_a_differing_tensor_fails_async_equals_sync_by_its_key(tmp_path):
    a, la = read_tree(_dcp(tmp_path / "sync", _state()))
    b, lb = read_tree(_dcp(tmp_path / "async", _state(flip=True)))
    check = async_equals_sync_check(a, b, (la, lb))
    assert check.status == "failed" and check.name == "async-equals-sync"
    assert "layer.weight: values differ" in check.detail and "compared by content" in check.detail


def _cut_chunks(directory: Path, key: str) -> None:
    """Cut every chunk of `key` from DCP's index: the checkpoint no longer says where its bytes are."""
    import pickle

    meta = pickle.loads((directory / ".metadata").read_bytes())
    meta.state_dict_metadata[key].chunks = []
    meta.storage_data = {i: s for i, s in meta.storage_data.items() if i.fqn != key}
    (directory / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("reader", ["read_dcp", "convert.read_checkpoint"])
def test_elements_no_chunk_holds_read_as_nan_even_where_memory_holds_the_right_values(tmp_path, monkeypatch, reader):
    """torch DCP loads a tensor it has no chunk for without a word and leaves torch.empty's memory,
    which may hold a freed copy of the right values (planted here: empty hands out zeros, the saved
    weight is zeros): the readers must mark those elements, or a dropped shard passes by luck."""
    from harness.judge import convert
    from harness.judge.ckpt_content import read_dcp

    _dcp(tmp_path, {"layer.weight": torch.zeros(3, 4), "other": torch.ones(2)})
    _cut_chunks(tmp_path, "layer.weight")
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(*a, **k))
    read = read_dcp(tmp_path) if reader == "read_dcp" else convert.read_checkpoint(tmp_path).tensors
    assert read["layer.weight"].shape == (3, 4) and bool(read["layer.weight"].isnan().all())
    assert torch.equal(read["other"], torch.ones(2))


def test_an_integer_tensor_no_chunk_holds_is_refused_by_name(tmp_path):
    from harness.judge.ckpt_content import read_dcp

    _dcp(tmp_path, {"step": torch.tensor([7, 8])})
    _cut_chunks(tmp_path, "step")
    with pytest.raises(ValueError, match=r"no chunk of the checkpoint holds 2 of the 2 elements of step"):
        read_dcp(tmp_path)


def test_a_file_that_records_how_the_save_ran_is_reported_not_failed():
    sync = {"iter_0000002/run_config.yaml": {"checkpoint": {"async_save": False, "save": "<root>"}}}
    asyn = {"iter_0000002/run_config.yaml": {"checkpoint": {"async_save": True, "save": "<root>"}}}
    assert async_equals_sync_check(sync, asyn, ({}, {})).status == "failed"
    check = async_equals_sync_check(sync, asyn, ({}, {}), asv.RECORDS_HOW_SAVED)
    assert check.status == "passed" and "run_config.yaml" in check.detail


def test_an_unreadable_side_fails():
    assert async_equals_sync_check({"x": 1}, {}, ({}, {})).status == "failed"


# ------------------------------------------------------------------ tracker and interruption judges


def test_a_tracker_that_names_an_unfinished_step_fails_by_name():
    assert tracker_names_check([("before the async save's finalize", None, None), ("after the finalize", "2", "2")]).status == "passed"
    early = tracker_names_check([("before the async save's finalize", "2", None), ("after the finalize", "2", "2")])
    assert early.status == "failed" and early.name == "tracker" and "before the async save's finalize: names 2" in early.detail
    assert tracker_names_check([("after step 3's write was killed", "3", "2")]).status == "failed"


def test_recognised_incomplete_fails_when_the_killed_step_reads_as_a_checkpoint(tmp_path):
    step = tmp_path / "iter_0000003"
    step.mkdir()
    (step / "__1_0.distcp").write_bytes(b"half a shard")
    assert asv.judge_recognised(step).status == "passed"
    (step / ".metadata").write_bytes(b"")
    (step / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                        '"common_backend": "torch", "common_backend_version": 1}')
    c = asv.judge_recognised(step)
    assert c.status == "failed" and "iter_0000003" in c.detail


RECORD = {"rank": 1, "left": {"__1_0.distcp": 1000}, "buckets": 1}
KILLED = "rank 1 of 2 died: process 1 terminated with signal SIGKILL"


@pytest.mark.parametrize("fault, record, errors, world, timed_out, ok, why", [
    ("kill-writer", RECORD, ["CheckpointException: boom", "CheckpointException: boom"], None, False, True, "every rank's save failed"),
    ("kill-writer", RECORD, ["CheckpointException: boom", None], None, False, False, "without an error on rank(s) [1]"),
    ("kill-writer", None, [None, None], None, False, False, "the armed writer never ran"),
    ("kill-writer", RECORD, None, "rank 0 of 2 raised: RuntimeError", False, False, "the job died instead"),
    ("kill-rank", RECORD, None, KILLED, False, True, "SIGKILL"),
    ("kill-rank", RECORD, None, "rank 0 of 2 raised: RuntimeError: Connection closed by peer", False, True, "reported a peer first"),
    ("kill-rank", RECORD, [None, None], None, False, False, "the world completed"),
    ("kill-rank", RECORD, None, "world still running after 300s", True, False, "hung"),
])
def test_interruption_judge(fault, record, errors, world, timed_out, ok, why):
    c = asv.judge_interruption(fault, 1, record, errors, world, timed_out, None)
    assert (c.status == "passed") == ok and why in c.detail


# ------------------------------------------------------------------ the contract at matrix load


@pytest.mark.parametrize("spec, message", [
    (_spec(async_save="none"), "needs a backend that saves asynchronously"),
    (_spec("kill-writer", src="tp1"), "give a source with tp \\* pp >= 2"),
    (_spec("kill-writer", src="dp2"), "a DP replica may write nothing"),
    (_spec("kill-rank", layout="plain"), "mcore_dist needs layout 'megatron-lm'"),
])
def test_what_async_save_refuses_at_matrix_load(spec, message):
    with pytest.raises(ValueError, match=message):
        asv.CASE.validate(spec)


# ------------------------------------------------------------------ planted faults in real worlds


def test_an_async_save_never_finalized_is_caught_and_never_compared():
    r = run_case(_spec(backend="test_skip_async_finalize"))
    assert r.status == "failed", r.failure_text()
    assert r.check("async-finalize").status == "failed" and "never finalized" in r.check("async-finalize").detail
    assert r.check("tracker").status == "failed" and "names nothing" in r.check("tracker").detail
    assert r.check("async-equals-sync").status == "not-run"


def test_a_tracker_written_before_the_finalize_names_the_killed_step_and_fails_tracker():
    r = run_case(_spec("kill-writer", backend="test_tracker_before_finalize"))
    assert r.status == "failed", r.failure_text()
    assert [c.name for c in r.checks if c.failed] == ["tracker", "resumed"], r.failure_text()
    assert "after step 3's write was killed: names 3, expected 2" in r.check("tracker").detail
    assert "(tracker: 3) refused" in r.check("resumed").detail  # a user's resume then cannot start at all


def test_an_async_checkpoint_that_differs_from_the_sync_one_fails_async_equals_sync():
    r = run_case(_spec(backend="test_corrupt_async_save"))
    assert r.status == "failed", r.failure_text()
    c = r.check("async-equals-sync")
    assert c.status == "failed" and "values differ" in c.detail and "optimizer.state.exp_avg." in c.detail
    assert r.check("async-finalize").status == "passed"  # the save completed: only its content is wrong
    assert r.check("final-weights-vs-sync").status == "failed", r.failure_text()  # and a resume from it drifts


def test_a_finalize_that_swallows_the_killed_write_fails_interruption():
    r = run_case(_spec("kill-writer", backend="test_swallow_finalize_errors"))
    assert r.status == "failed", r.failure_text()
    assert r.check("interruption").status == "failed" and "without an error on rank(s)" in r.check("interruption").detail
    assert r.check("tracker").status == "passed"  # the tracker is the finalize's last step: it never ran


def test_a_load_that_swallows_the_refusal_of_the_killed_step_is_silent_and_red():
    r = run_case(_spec("kill-rank", backend="test_swallow_training_load_errors"), RunOptions())
    assert r.status == "failed", r.failure_text()
    assert r.check("outcome").status == "failed" and r.check("outcome").detail.startswith("silent:")
    assert r.check("loaded-equal").status == "failed"
    assert r.check("resumed").status == "passed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe is about a machine without CUDA; GPU runs use the worker")
@pytest.mark.xfail(strict=True, reason=(
    "megatron-core 0.19.2: the persistent async checkpoint worker dies at start on a machine without CUDA "
    "(dist_checkpointing/strategies/async_utils.py:565 torch.cuda.set_device(rank % torch.cuda.device_count()): "
    "ZeroDivisionError), and PersistentAsyncCaller.schedule_async_call has no liveness check: it blocks forever "
    "on the preload queue's join() (async_utils.py:416-423) for a worker that will never take the request. The "
    "same blocking wait is what hangs a job whose worker dies on a GPU (SkyRL #1960, radixark/miles #1763). "
    "Why Bridge's async_save with use_persistent_ckpt_worker is not-run on CPU here"))
def test_a_dead_persistent_worker_reaches_the_trainer(tmp_path):
    """What users need from an async writer: the trainer's schedule call comes back (or raises) when
    the worker cannot take the request. Strict xfail: it blocks; a fix (a liveness check, a CPU
    worker) turns it XPASS, and Bridge's persistent-worker entries can then run on CPU."""
    import subprocess
    import sys

    from harness.run.nodes import free_port

    probe = Path(__file__).parent / "data" / "persistent_worker_probe.py"
    out = subprocess.run([sys.executable, str(probe), "10", str(free_port())], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("returned=")), "")
    assert line, f"the probe printed no result: {out.stderr[-2000:]}"
    assert line.startswith("returned=True"), f"schedule_async_call still blocked after 10 s ({line}); worker: " + \
        ("ZeroDivisionError at async_utils.py:565" if "ZeroDivisionError" in out.stderr else out.stderr[-500:])
