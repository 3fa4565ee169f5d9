"""corrupt-load: its damage functions (in-process, on real formats), its contract at matrix load,
and item 5 of issue 11: a backend that swallows load errors turns the case red (outcome silent)."""

import json

import pytest
import torch
from doubles import use_doubles

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.faults import damage
from harness.orchestration.runner import run_case

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(test_swallow_load_errors="doubles:SwallowLoadErrors", test_save_unvalidated="doubles:SaveUnvalidated")


def _dcp(directory):
    """A small torch DCP checkpoint written in-process (the format under torch_dist)."""
    import torch.distributed.checkpoint as dcp

    state = {"big": torch.arange(4096, dtype=torch.float32), "small": torch.ones(8)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return state


def _dcp_load(directory):
    import torch.distributed.checkpoint as dcp

    state = {"big": torch.zeros(4096), "small": torch.zeros(8)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return state


def test_flip_byte_lands_in_the_tensor_data(tmp_path):
    before = _dcp(tmp_path)
    d = damage.flip_byte(tmp_path)
    assert d.names[1] == "big" and d.files == (d.names[0],)
    after = _dcp_load(tmp_path)  # still loads: the flip is inside the data, not a header
    assert torch.equal(after["small"], before["small"])
    changed = (after["big"].view(torch.uint8) != before["big"].view(torch.uint8)).nonzero().flatten().tolist()
    assert changed == [4 * 4096 // 2]  # exactly the middle byte of the tensor


def test_file_damage_stays_inside_the_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _dcp(ckpt)
    (tmp_path / "neighbour.distcp").write_bytes(b"x" * 100)
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    d = damage.truncate_shard(ckpt)
    assert (ckpt / d.files[0]).stat().st_size == sizes[d.files[0]] // 2
    assert (tmp_path / "neighbour.distcp").stat().st_size == 100
    assert damage.missing_metadata(ckpt).files == (".metadata",) and not (ckpt / ".metadata").exists()
    with pytest.raises(damage.DamageError, match="no common.pt"):
        damage.missing_common(ckpt)
    d = damage.empty_dir(ckpt)
    assert ckpt.is_dir() and not list(ckpt.iterdir()) and d.names == ("ckpt",)
    assert (tmp_path / "neighbour.distcp").exists()


def test_split_export_is_the_same_model_and_a_lost_shard_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.core.zoo import get_model
    from harness.models.hf import write_fixture

    src = write_fixture(get_model("hf-llama"), tmp_path / "hf")
    whole = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).state_dict()
    weight_map = damage.split_export(src)
    assert len(set(weight_map.values())) == 2 and not (src / "model.safetensors").exists()
    split = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).state_dict()
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    d = damage.missing_indexed_shard(src)
    assert d.files == ("model-00002-of-00002.safetensors",) and not (src / d.files[0]).exists()


def test_adapter_config_edits(tmp_path):
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["down_proj", "q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    damage.adapter_config_mismatch(tmp_path)
    damage.adapter_config_targets(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}
    damage.adapter_no_config(tmp_path)
    assert not (tmp_path / "adapter_config.json").exists()


@pytest.mark.parametrize("entry, message", [
    ("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp1 -> tp1'], options: {damage: truncate-safetensors}}",
     "with damage 'truncate-safetensors' takes an HF fixture model"),
    ("{case: corrupt-load, backends: [bridge_hf], models: [hf-llama], pairs: ['tp1 -> tp1'], options: {damage: adapter-no-config}}",
     "with damage 'adapter-no-config' needs a backend that can adapter_export"),
    ("{case: corrupt-load, models: [hf-llama], pairs: ['tp1 -> tp1'], options: {damage: flip-byte}}",
     "with damage 'flip-byte' takes a GPT zoo model"),
    ("{case: corrupt-load, backends: [bridge_hf], models: [hf-llama], pairs: ['tp1 -> tp2'], options: {damage: truncate-safetensors}}",
     "give source == target"),
    ("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp1 -> tp1'], options: {damage: missing-common}}",
     "writes no common.pt"),
    ("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp1 -> tp2'], options: {damage: claimed-whole}}",
     "needs a source with TP > 1"),
    ("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp1 -> tp1'], options: {damage: bit-rot}}",
     "option 'damage': expected one of"),
    ("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp1 -> tp1'], options: {damage: empty-dir}, xfail: {reason: r, checks: [logits]}}",
     "never records"),
])
def test_wrong_combinations_are_matrix_load_errors_naming_the_entry(matrix_error, entry, message):
    assert message in matrix_error(entry)


def _spec(backend, kind, src="tp2", dst="tp1pp2", refuse_with=None):
    options = (("damage", kind),) + ((("refuse_with", refuse_with),) if refuse_with else ())
    return CaseSpec("corrupt-load", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst),
                    options=options, axes=("damage",), timeout_s=90)


def test_a_real_refusal_passes():
    r = run_case(_spec("mcore_dist", "missing-metadata", refuse_with=("CheckpointException",)))
    assert r.status == "passed", r.failure_text()
    assert r.check("outcome").detail.startswith("refused (clear, names .metadata)")
    assert {"save", "damage", "load"} <= set(r.phases)


def test_a_backend_that_swallows_load_errors_turns_the_case_red():
    r = run_case(_spec("test_swallow_load_errors", "missing-metadata"))
    assert r.status == "failed"
    assert r.check("outcome").status == "failed" and r.check("outcome").detail.startswith("silent:")
    assert r.check("loaded-canonical").status == "failed"
    assert "data corruption" in r.failure_text()


def test_an_entry_cannot_allow_a_crash_as_a_refusal(matrix_error):
    """refusal_check's rule: a KeyError or AttributeError in the loader is a crash, so no entry may widen
    its refusals to one; such a load is an upstream finding, a strict xfail naming the frame."""
    got = matrix_error("{case: corrupt-load, models: [gpt-gqa], pairs: ['tp2 -> tp1'], "
                       "options: {damage: truncate-shard, refuse_with: [CheckpointException, KeyError]}}")
    assert "['KeyError'] is a crash inside the loader, never a refusal" in got


def test_a_refusal_through_an_exception_the_entry_does_not_allow_fails():
    """The real missing-metadata refusal (torch DCP's CheckpointException) is not megatron-core's
    CheckpointingException the backend declares: without the entry naming it, the case is red."""
    r = run_case(_spec("mcore_dist", "missing-metadata"))
    assert r.status == "failed" and "but with CheckpointException" in r.check("outcome").detail
    assert "torch/distributed/checkpoint/" in r.check("outcome").detail  # the raising frame


def test_a_misdescribed_shard_is_refused_at_save_and_a_save_without_the_check_goes_red():
    """claimed-whole: every TP rank claims its vocabulary rows of the word embeddings whole. megatron-core's
    save validation refuses it, naming the key; a save that skips the check writes one rank's rows as
    the whole tensor, and the load at D shows it as data corruption."""
    refused = run_case(_spec("mcore_dist", "claimed-whole"))
    assert refused.status == "passed", refused.failure_text()
    assert refused.check("outcome").detail.startswith("refused (clear, names embedding.word_embeddings.weight)")
    assert "load" not in refused.phases  # nothing was written to load
    lost = run_case(_spec("test_save_unvalidated", "claimed-whole"))
    assert lost.status == "failed" and lost.check("outcome").detail.startswith("silent:")
    assert "embedding.word_embeddings.weight" in lost.check("outcome").detail


def test_duplicate_main_replicas_of_an_object_are_refused_at_save_and_a_save_without_the_check_goes_red():
    """duplicate-object: every rank claims each layer's QKV extra state as the main replica. megatron-core's
    save validation refuses the duplicate ShardedObject keys, naming them; a save that skips the check
    writes them, and no load could show it (the copies hold the same bytes): the save itself fails."""
    refused = run_case(_spec("mcore_dist", "duplicate-object"))
    assert refused.status == "passed", refused.failure_text()
    assert refused.check("outcome").detail.startswith("refused (clear, names self_attention.linear_qkv._extra_state)")
    assert "Duplicate ShardedObject keys" in refused.check("outcome").detail
    assert "load" not in refused.phases
    written = run_case(_spec("test_save_unvalidated", "duplicate-object"))
    assert written.status == "failed" and written.check("outcome").detail.startswith("silent save:")
    assert "load" not in written.phases
