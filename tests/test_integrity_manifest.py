"""mcore_dist's own reading of Megatron-Core's integrity manifest (verify_integrity): its hashes against the
files, computed with hashlib. A manifest that only agrees with the same code's verification (the mutant
`_READ_CHUNK_SIZE = 0`: every file hashed as empty) must be named."""

import hashlib
import json

from harness.backends._mcore_events import manifest_problems


def _checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"\x01" * 3000)
    (d / ".metadata").write_bytes(b"meta")
    return d


def _manifest(d, files, algorithm="sha256"):
    (d / "integrity.json").write_text(json.dumps({"algorithm": algorithm, "files": files}))


def _real(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir() if f.name != "integrity.json"}


def test_a_true_manifest_passes_and_each_fault_is_named(tmp_path):
    d = _checkpoint(tmp_path)
    _manifest(d, _real(d))
    assert manifest_problems(d) == []
    _manifest(d, {**_real(d), ".metadata": hashlib.sha256(b"").hexdigest()})
    assert manifest_problems(d) == [".metadata: the manifest's sha256 e3b0c44298fc1c14... is not the file's"]
    _manifest(d, {k: v for k, v in _real(d).items() if k != ".metadata"})
    assert manifest_problems(d) == [".metadata: in the checkpoint, not in the manifest"]
    _manifest(d, {**_real(d), "gone.distcp": "0" * 64})
    assert manifest_problems(d) == ["gone.distcp: in the manifest, not in the checkpoint"]
    _manifest(d, _real(d), algorithm="md5")
    assert "algorithm 'md5'" in manifest_problems(d)[0]
    (d / "integrity.json").write_text("{")
    assert "not a manifest" in manifest_problems(d)[0]


def test_an_empty_checkpoint_is_not_a_pass(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    _manifest(d, {})
    assert manifest_problems(d) == [f"{d} holds no file besides the manifest"]


def test_megatron_core_s_manifest_passes_and_its_zero_chunk_mutant_fails(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing import validation

    d = _checkpoint(tmp_path)
    validation.save_integrity_manifest(str(d))
    assert manifest_problems(d) == []
    monkeypatch.setattr(validation, "_READ_CHUNK_SIZE", 0)  # the campaign's survivor validation:42 (0 << 20)
    validation.save_integrity_manifest(str(d))
    validation.verify_integrity_manifest(str(d))  # the same code agrees with itself
    assert len(manifest_problems(d)) == 2
