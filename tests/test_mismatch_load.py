"""corrupt-load with `mismatch: tolerate` (cases/shared/mismatch_load.py): a load told to tolerate the
keys one side lacks must return the checkpoint's tensors, keep the job's own where the checkpoint lacks
them, and (return_all) name exactly the keys the two checkpoints' files say each side lacks. The judge
on planted outcomes in-process, the backend's returned keys, and one real case end to end."""

import pytest
import torch

from harness.backends._mcore_events import event_problems, returned_keys
from harness.backends.mcore_dist import McoreDistOptions
from harness.cases.shared import mismatch_load as ml
from harness.cases.shared.damaged_load import Outcome
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CKPT = {"embedding.word_embeddings.weight": torch.arange(6.0).reshape(2, 3)}
OWN = {"output_layer.weight": torch.full((2, 3), -1.0)}  # the job's pre-load value of the key the checkpoint lacks


def _by_name(checks):
    return {c.name: c for c in checks}


def _judge(loaded, events=None, outcome=Outcome("silent")):
    expected = {**CKPT, **OWN}
    return _by_name(ml.judge_tolerated("other-tied", outcome, set(), {"output_layer.weight"}, expected, loaded, (), events))


def _load_events(*per_rank):
    return {"load": {str(r): [{"op": "load", "returned_keys": True, "missing_keys": m, "unexpected_keys": u}]
                     for r, (m, u) in enumerate(per_rank)}}


def test_a_load_that_keeps_the_jobs_own_values_passes():
    c = _judge({k: v.clone() for k, v in {**CKPT, **OWN}.items()})
    assert c["outcome"].status == "passed" and c["loaded-canonical"].status == "passed"
    assert "1 the checkpoint lacks kept the job's own values (output_layer.weight)" in c["outcome"].detail
    assert "mismatch-keys" not in c  # log_all returns no keys: nothing to hold them to


def test_a_load_that_invents_the_lacking_key_fails():
    """The embedding's rows copied into the output layer the checkpoint lacks (a neighbour's data)."""
    loaded = {**{k: v.clone() for k, v in CKPT.items()}, "output_layer.weight": CKPT["embedding.word_embeddings.weight"].clone()}
    c = _judge(loaded)
    assert c["outcome"].status == "failed" and c["outcome"].detail.startswith("returned, but")
    assert c["loaded-canonical"].mismatches[0].key == "output_layer.weight"


def test_a_changed_held_tensor_fails():
    loaded = {k: v.clone() for k, v in {**CKPT, **OWN}.items()}
    loaded["embedding.word_embeddings.weight"][1, 2] = 0.5
    assert _judge(loaded)["loaded-canonical"].status == "failed"


def test_a_refusal_or_crash_fails_and_nothing_is_compared():
    for kind in ("refused", "crashed"):
        c = _judge(None, outcome=Outcome(kind, "CheckpointException: Missing key in checkpoint state_dict: output_layer.weight"))
        assert c["outcome"].status == "failed" and "did not return" in c["outcome"].detail
        assert c["loaded-canonical"].status == "not-run"


def test_a_returned_load_with_nothing_to_judge_is_an_error():
    with pytest.raises(ValueError, match="no rank gave back a tensor"):
        _judge({})


def test_returned_keys_are_held_to_the_files():
    loaded = {k: v.clone() for k, v in {**CKPT, **OWN}.items()}
    right = _judge(loaded, _load_events(([], ["output_layer.weight"]), ([], [])))  # PP: only the last stage asks
    assert right["mismatch-keys"].status == "passed"
    none_said = _judge(loaded, _load_events(([], []), ([], [])))
    assert none_said["mismatch-keys"].status == "failed" and "unexpected (all ranks) []" in none_said["mismatch-keys"].detail
    swapped = _judge(loaded, _load_events((["output_layer.weight"], []), (["output_layer.weight"], [])))
    assert swapped["mismatch-keys"].status == "failed" and "rank 0 missing ['output_layer.weight']" in swapped["mismatch-keys"].detail


def test_the_backend_records_what_a_returning_load_gave_back():
    event: dict = {"op": "load", "strategy": "default"}
    state = returned_keys(({"a": 1}, {"m"}, {"u2", "u1"}), "return_all", event)
    assert state == {"a": 1} and event["missing_keys"] == ["m"] and event["unexpected_keys"] == ["u1", "u2"]
    assert returned_keys({"a": 1}, "log_all", {}) == {"a": 1}  # other flags return the state alone
    bare: dict = {"op": "load", "strategy": "default"}
    assert returned_keys({"a": 1}, "return_all", bare) == {"a": 1}
    problems = event_problems(McoreDistOptions(strict="return_all"), bare)
    assert problems == ["strict return_all: the load returned no missing and unexpected keys beside the state"]


def test_tolerate_needs_a_key_mismatch_damage(matrix_error):
    got = matrix_error("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp2 -> tp1'], "
                       "options: {damage: flip-byte, mismatch: tolerate}}")
    assert "option 'mismatch: tolerate' needs a damage of keys one side lacks" in got and "'flip-byte'" in got


def test_an_old_checkpoint_loads_into_a_job_with_an_untied_output_layer():
    """Real worlds: the tied checkpoint lacks output_layer.weight; return_all names it on the one
    rank (the last PP stage) that asks for it, and the job keeps its own output layer."""
    spec = CaseSpec("corrupt-load", "gpt-gqa", "mcore_dist", Topology.parse("tp2"), Topology.parse("tp1pp2"),
                    options=(("damage", "other-tied"), ("mismatch", "tolerate")), axes=("damage",),
                    backend_options=(("strict", "return_all"),), timeout_s=90)
    r = run_case(spec)
    assert r.status == "passed", r.failure_text()
    assert "unexpected ['output_layer.weight']" in r.check("mismatch-keys").detail
    assert {"save", "save-job", "load"} <= set(r.phases)


def test_a_refusal_that_sends_the_user_to_the_wrong_side_is_named():
    """megatron-core's key check labels the keys the checkpoint holds and the job does not ask for
    `Missing keys` and the reverse `Unexpected keys`; a label swapped is a refusal that misleads."""
    right = ("CheckpointingException: Unexpected keys (not found in the checkpoint) encountered in the provided sharded "
             "state dict. \nUnexpected keys (for this rank): {'output_layer.weight'}. ")
    swapped = ("CheckpointingException: Some keys found in the checkpoint are missing in the provided sharded state dict. "
               "\nMissing keys (for all ranks): {'output_layer.weight'}. ")
    assert ml.wrong_sides(right, set(), {"output_layer.weight"}) == []
    assert ml.wrong_sides(swapped, set(), {"output_layer.weight"}) == ["'output_layer.weight' listed as missing"]
    assert ml.wrong_sides("CheckpointException: KeyError: 'output_layer.weight'", set(), {"output_layer.weight"}) == []
    assert ml.wrong_sides("", set(), set()) == []
