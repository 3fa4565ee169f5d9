"""export-integrity (harness.judge.hf_integrity) goes red on every fault it is for: HF artefacts
built in tmp_path with safetensors and a JSON index, each with one fault planted; then the same
faults written by faulty export backends through a real hf-roundtrip, and the fixture writer's
sharded and extra-key layouts read back clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.judge.hf_integrity import (
    ADAPTER_WEIGHTS,
    Expected,
    TensorInfo,
    export_integrity,
    infos_of,
    source_infos,
)

SOURCE = {
    "model.embed_tokens.weight": torch.ones(16, 8),
    "model.layers.0.self_attn.q_proj.weight": torch.ones(8, 8),
    "model.layers.0.mlp.up_proj.weight": torch.ones(12, 8),
    "model.norm.weight": torch.ones(8),
    "lm_head.weight": torch.ones(16, 8),
}
SHARDS = {  # the last shard holds the last PP stage's tensors, as a Bridge export of a sharded source does
    "model-00001-of-00002.safetensors": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
    "model-00002-of-00002.safetensors": ["model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"],
}


def write(directory: Path, state: dict[str, torch.Tensor], shards: dict[str, list[str]] | None = None, tied: bool = False,
          weights: str = "model.safetensors") -> Path:
    """An HF artefact: one `weights` file, or `shards` with a true index; config.json with `tied`."""
    directory.mkdir(parents=True, exist_ok=True)
    if shards is None:
        save_file(state, str(directory / weights))
    else:
        for name, keys in shards.items():
            save_file({k: state[k] for k in keys if k in state}, str(directory / name))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, keys in shards.items() for k in keys if k in state}}
        (directory / f"{weights}.index.json").write_text(json.dumps(index))
    if weights == "model.safetensors":
        (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return directory


def check(directory: Path, source: dict[str, torch.Tensor] | None = SOURCE, **kw):
    return export_integrity([Expected("export", directory, None if source is None else infos_of(source), **kw)])


def edit_index(directory: Path, edit) -> None:
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    edit(data)
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("shards", [None, SHARDS], ids=["one-file", "sharded"])
def test_a_clean_export_passes(tmp_path, shards):
    c = check(write(tmp_path / "e", SOURCE, shards))
    assert c.status == "passed", c.detail
    assert "5 tensors" in c.detail


def test_a_shard_dropped_from_the_export_fails(tmp_path):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    (d / "model-00002-of-00002.safetensors").unlink()
    c = check(d)
    assert c.status == "failed"
    assert "the index names shard model-00002-of-00002.safetensors (3 tensor(s)" in c.detail and "missing on disk" in c.detail
    assert "source tensor lm_head.weight (F32[16, 8]) is in no file of the export" in c.detail
    assert "metadata.total_size" in c.detail  # the index still counts the lost shard's bytes


def test_an_index_entry_without_its_tensor_fails(tmp_path):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    edit_index(d, lambda x: x["weight_map"].update({"model.layers.0.mlp.gate_proj.weight": "model-00001-of-00002.safetensors"}))
    c = check(d)
    assert c.status == "failed"
    assert ("index entry model.layers.0.mlp.gate_proj.weight -> model-00001-of-00002.safetensors, but "
            "model-00001-of-00002.safetensors holds no model.layers.0.mlp.gate_proj.weight") in c.detail


def test_an_entry_under_the_wrong_shard_fails_both_ways(tmp_path):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    edit_index(d, lambda x: x["weight_map"].update({"model.norm.weight": "model-00001-of-00002.safetensors"}))
    c = check(d)
    assert "model-00001-of-00002.safetensors holds no model.norm.weight (it is in model-00002-of-00002.safetensors)" in c.detail
    assert "model.norm.weight is in model-00002-of-00002.safetensors but the index lists it under model-00001" in c.detail


def test_a_tensor_missing_from_the_index_fails(tmp_path):
    """Megatron-Bridge#4083: the index lists what ranks said they would write, not the last stage's tensors."""
    d = write(tmp_path / "e", SOURCE, SHARDS)
    edit_index(d, lambda x: x["weight_map"].pop("lm_head.weight"))
    c = check(d)
    assert c.status == "failed"
    assert "lm_head.weight in model-00002-of-00002.safetensors is not in the index" in c.detail
    assert [m.kind for m in c.mismatches] == ["index"]  # the key is on disk, so nothing else is wrong


def test_a_shard_the_index_never_names_fails(tmp_path):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    save_file({"model.extra": torch.ones(2)}, str(d / "model-00003-of-00003.safetensors"))
    c = check(d)
    assert ("shard model-00003-of-00003.safetensors on disk is named nowhere in the index: a loader never reads its 1 tensor(s) "
            "model.extra") in c.detail
    assert "model.extra (F32[2], in model-00003-of-00003.safetensors) is not in the source" in c.detail


@pytest.mark.parametrize("total", [0, 1, None])
def test_a_wrong_or_missing_total_size_fails(tmp_path, total):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    right = sum(t.numel() * t.element_size() for t in SOURCE.values())

    def edit(x):
        if total is None:
            x["metadata"].pop("total_size")
        else:
            x["metadata"]["total_size"] = right + total
    edit_index(d, edit)
    c = check(d)
    if total == 0:
        assert c.status == "passed", c.detail
    elif total is None:
        assert "has no metadata.total_size" in c.detail
    else:
        assert f"metadata.total_size {right + 1} != {right} bytes in the shards' headers" in c.detail


def test_without_an_index_a_stray_shard_or_no_weights_fails(tmp_path):
    d = write(tmp_path / "e", SOURCE)
    save_file({"model.extra": torch.ones(2)}, str(d / "model-00002-of-00002.safetensors"))
    assert "model-00002-of-00002.safetensors on disk without an index naming it" in check(d).detail
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert "no model.safetensors and no index in empty" in check(empty).detail


@pytest.mark.parametrize("fault, expected", [
    (lambda s: s.update({"model.norm.weight": torch.ones(9)}), "model.norm.weight in model.safetensors: shape [9], source [8]"),
    (lambda s: s.update({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}),
     "model.norm.weight in model.safetensors: dtype BF16, source F32"),
    (lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
     "model.layers.0.self_attn.rotary_emb.inv_freq (F32[4], in model.safetensors) is not in the source"),
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight"),
     "source tensor model.layers.0.mlp.up_proj.weight (F32[12, 8]) is in no file of the export"),
], ids=["shape", "dtype", "extra", "missing"])
def test_a_tensor_unlike_the_source_fails(tmp_path, fault, expected):
    state = dict(SOURCE)
    fault(state)
    c = check(write(tmp_path / "e", state))
    assert c.status == "failed" and expected in c.detail, c.detail


def test_named_extra_and_missing_keys_pass(tmp_path):
    state = {k: v for k, v in SOURCE.items() if k != "model.norm.weight"} | {"model.extra": torch.ones(2)}
    d = write(tmp_path / "e", state)
    assert check(d).status == "failed"
    assert check(d, allowed_extra=("model.extra",), allowed_missing=("model.norm.weight",)).status == "passed"


def test_tied_and_untied_lm_head(tmp_path):
    untied_no_head = write(tmp_path / "a", {k: v for k, v in SOURCE.items() if k != "lm_head.weight"}, tied=False)
    c = check(untied_no_head)
    assert "config.json says untied embeddings but no file of a holds lm_head.weight" in c.detail
    tied_source = {k: v for k, v in SOURCE.items() if k != "lm_head.weight"}
    tied_with_head = write(tmp_path / "b", SOURCE, tied=True)
    c = check(tied_with_head, tied_source)
    assert [m.kind for m in c.mismatches] == ["tied"], c.detail  # named once, as a tie problem, not also as "extra"
    assert "config.json says tied embeddings but b holds lm_head.weight, which the source does not" in c.detail
    # tied, and the source itself holds lm_head (Bridge then writes it too): no problem; tied without one: none either
    assert check(write(tmp_path / "c", SOURCE, tied=True)).status == "passed"
    assert check(write(tmp_path / "d", tied_source, tied=True), tied_source).status == "passed"


def test_an_adapter_is_one_file_without_an_index(tmp_path):
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8)}
    ok = write(tmp_path / "a", adapter, weights=ADAPTER_WEIGHTS)
    assert check(ok, adapter, weights=ADAPTER_WEIGHTS, sharded_ok=False).status == "passed"
    sharded = write(tmp_path / "b", adapter, {"adapter_model-00001-of-00001.safetensors": list(adapter)}, weights=ADAPTER_WEIGHTS)
    c = check(sharded, adapter, weights=ADAPTER_WEIGHTS, sharded_ok=False)
    assert "adapter_model.safetensors.index.json: a sharded adapter peft does not read" in c.detail
    stray = write(tmp_path / "c", adapter, weights=ADAPTER_WEIGHTS)
    save_file({"x": torch.ones(1)}, str(stray / "model.safetensors"))
    assert "model.safetensors on disk without an index naming it" in check(stray, adapter, weights=ADAPTER_WEIGHTS).detail


def test_a_torn_shard_is_a_problem_not_a_crash(tmp_path):
    d = write(tmp_path / "e", SOURCE, SHARDS)
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad")
    c = check(d)
    assert c.status == "failed" and "model-00001-of-00002.safetensors" in c.detail
    assert not any("missing on disk" in m.detail for m in c.mismatches)  # unreadable, not absent


def test_no_artefact_is_not_run():
    assert export_integrity([]).status == "not-run"


# --------------------------------------------------------------------------- the index against the headers, drawn


@st.composite
def sharded_exports(draw):
    n = draw(st.integers(1, 12))
    keys = [f"model.layers.{i}.w" for i in range(n)]
    shapes = {k: tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))) for k in keys}
    dtypes = {k: draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64])) for k in keys}
    shard_of = {k: draw(st.integers(1, 3)) for k in keys}
    return keys, shapes, dtypes, shard_of, draw(st.sampled_from(["drop-entry", "move-entry", "size", "none"]))


@settings(max_examples=40, deadline=None)
@given(sharded_exports())
def test_every_index_fault_is_found_and_a_true_index_passes(tmp_path_factory, drawn):
    keys, shapes, dtypes, shard_of, fault = drawn
    state = {k: torch.zeros(shapes[k], dtype=dtypes[k]) for k in keys}
    used = sorted(set(shard_of.values()))
    shards = {f"model-{i:05d}-of-{len(used):05d}.safetensors": [k for k in keys if shard_of[k] == s] for i, s in enumerate(used, 1)}
    d = write(tmp_path_factory.mktemp("e"), state, shards, tied=True)  # no lm_head here: a tied model's export
    victim = keys[0]
    home = next(name for name, ks in shards.items() if victim in ks)
    if fault == "drop-entry":
        edit_index(d, lambda x: x["weight_map"].pop(victim))
    elif fault == "move-entry":
        edit_index(d, lambda x: x["weight_map"].update({victim: "model-elsewhere.safetensors"}))
    elif fault == "size":
        edit_index(d, lambda x: x["metadata"].update(total_size=x["metadata"]["total_size"] + 2))
    c = export_integrity([Expected("export", d, infos_of(state))])
    if fault == "none":
        assert c.status == "passed", c.detail
    else:
        assert c.status == "failed"
        # named by key, or by its shard where the fault leaves that shard named nowhere in the index
        assert fault == "size" or any(m.key in (f"export/{victim}", f"export/{home}") for m in c.mismatches), c.detail


# --------------------------------------------------------------------------- the fixture writer, read back


def test_the_sharded_fixture_with_an_extra_key_is_true_to_its_index(tmp_path):
    from harness.core.zoo import get_model
    from harness.models.hf import write_fixture

    d = write_fixture(get_model("hf-llama", "hf"), tmp_path / "src", shards=3, extra_keys=("model.extra_scale",))
    assert len(list(d.glob("model-*.safetensors"))) >= 3
    infos = source_infos(d)
    assert infos["model.extra_scale"] == TensorInfo("F32", (8,))
    c = export_integrity([Expected("fixture", d, infos)])
    assert c.status == "passed", c.detail


# --------------------------------------------------------------------------- faulty exports through a real hf-roundtrip


def _roundtrip(backend, src="tp1pp2", dst="tp1pp2", model="hf-llama", expect="pass", **opts):
    from harness.orchestration.runner import run_case

    return run_case(CaseSpec("hf-roundtrip", model, backend, Topology.parse(src), Topology.parse(dst),
                             options=tuple(sorted(opts.items())), timeout_s=180, expect=expect))


def test_a_sharded_export_with_a_dropped_shard_fails_export_integrity(override):
    """Megatron-Bridge#4188's shape. transformers then cannot load the export at all (the case
    errors), but export-integrity, judged first from the headers, names the shard."""
    r = _roundtrip(override("DropExportShard"), shards=3)
    c = r.check("export-integrity")
    assert c.status == "failed" and "missing on disk" in c.detail, r.failure_text()
    assert any(m.kind == "missing" and m.key.endswith("lm_head.weight") for m in c.mismatches)


def test_an_index_without_the_last_stages_tensors_fails_only_export_integrity_among_the_file_checks(override):
    """Megatron-Bridge#4083's shape at PP 2: the shards hold every tensor, so export-bitwise (which
    reads every file) passes; transformers reads through the index and misses the final norm and
    lm_head (hf-logits); export-integrity names both keys."""
    r = _roundtrip(override("PruneExportIndex"), shards=3)
    checks = {c.name: c.status for c in r.checks}
    assert checks["export-integrity"] == "failed" and checks["export-bitwise"] == "passed", r.failure_text()
    assert checks["hf-logits"] == "failed"
    detail = r.check("export-integrity").detail
    # the fixture's last shard holds lm_head alone: named as a shard the index never names, with its key
    assert "model.norm.weight in model-00003-of-00004.safetensors is not in the index" in detail
    assert "shard model-00004-of-00004.safetensors on disk is named nowhere in the index: a loader never reads its 1 tensor(s) " \
           "lm_head.weight" in detail


def test_a_carried_unmapped_key_expected_to_refuse_fails_the_refusal():
    """Megatron-Bridge 0.6.2's Llama bridge carries a persisted rotary inv_freq into the export:
    an entry expecting a refusal there fails, and export-integrity then judges the export (clean)."""
    r = _roundtrip("bridge_hf", "tp1", "tp1", expect="refuse", unmapped_source_key="model.layers.0.self_attn.rotary_emb.inv_freq")
    assert r.status == "failed"
    assert "the export across tp1pp1dp1cp1 of a source holding model.layers.0.self_attn.rotary_emb.inv_freq was expected to " \
           "refuse but completed" in r.check("refusal").detail
    assert r.check("export-integrity").status == "passed"
