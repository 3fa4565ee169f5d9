"""The gate's scale axis (harness.gate.scale): a production shape planned on each side, diffed.
Planted layouts: a renamed key and a changed shape are failing findings, other chunks a warning,
a plan the candidate cannot make a regression; and the layout a plan records is what it built."""

from __future__ import annotations

import json
from pathlib import Path

from harness.gate import bump, scale
from harness.gate.compare import FAILING, WARNING
from harness.plan import validate
from harness.plan.collect import Record

PLAN = scale.ScalePlan("tiny tp2->tp1", "tiny", "tp2", "tp1")


def _rec(key, shape=(4, 8), offset=(0, 0), local=(4, 8), replica=(0, 0, 0), dtype="bfloat16"):
    return Record(key=key, global_shape=shape, global_offset=offset, local_shape=local, dtype=dtype, replica_id=replica,
                  rank=0, coord=(0, 0, 0))


def _doc(records, verdict="VALID"):
    lay = validate.layout(records)
    return {"verdict": verdict, "save": {"topology": "tp2"}, "load": {"topology": "tp1"}, "layout": {"save": lay, "load": lay}}


BASE = [_rec("decoder.w", offset=(0, 0), local=(4, 4)), _rec("decoder.w", offset=(0, 4), local=(4, 4)), _rec("embedding")]


def test_the_same_layout_gives_no_finding_and_an_empty_one_is_not_evidence():
    assert scale.diff(PLAN, _doc(BASE), _doc(list(reversed(BASE)))) == []
    empty = {"verdict": "VALID", "layout": {"save": {}, "load": {}}}
    assert {f.kind for f in scale.diff(PLAN, empty, empty)} == {"not-evaluated"}


def test_a_renamed_key_and_a_changed_shape_are_failing_findings():
    renamed = [BASE[0], BASE[1], _rec("embedding_v2")]
    found = scale.diff(PLAN, _doc(BASE), _doc(renamed))
    assert found and all(f.kind == "regression" and f.kind in FAILING for f in found)
    assert "only in the baseline's (embedding)" in found[0].detail and "only in the candidate's (embedding_v2)" in found[0].detail
    reshaped = [BASE[0], BASE[1], _rec("embedding", shape=(4, 16), local=(4, 16))]
    (first, *_) = scale.diff(PLAN, _doc(BASE), _doc(reshaped))
    assert first.kind == "regression" and "embedding [4, 8] bfloat16 -> [4, 16] bfloat16" in first.detail


def test_other_chunks_of_the_same_keys_are_a_warning_only():
    rechunked = [_rec("decoder.w"), _rec("embedding")]  # one chunk of the whole tensor instead of two halves
    found = scale.diff(PLAN, _doc(BASE), _doc(rechunked))
    assert {f.kind for f in found} == {"layout-change"} and all(f.kind in WARNING for f in found)
    assert "1 key(s) chunked otherwise" in found[0].detail and "decoder.w" in found[0].detail
    replica = [BASE[0], BASE[1], _rec("embedding", replica=(1, 0, 0))]
    assert [f.kind for f in scale.diff(PLAN, _doc(BASE), _doc(replica))] == ["layout-change", "layout-change"]


def test_a_plan_only_the_baseline_could_make_is_a_regression():
    assert [f.kind for f in scale.diff(PLAN, _doc(BASE), None, cand_log="Traceback: KeyError")] == ["regression"]
    assert [f.kind for f in scale.diff(PLAN, None, None)] == ["not-evaluated"]
    assert [f.kind for f in scale.diff(PLAN, None, _doc(BASE))] == ["fixed-upstream"]
    assert [f.kind for f in scale.diff(PLAN, _doc(BASE), _doc(BASE, verdict="INVALID"))] == ["regression"]


def test_run_scale_plans_in_each_side_and_diffs(tmp_path, monkeypatch):
    """bump.run_scale: each side's `plan` writes its plan.json; a candidate whose Core renames a key
    at scale is a regression of the gate."""
    docs = {"baseline": _doc(BASE), "candidate": _doc([BASE[0], BASE[1], _rec("embedding_v2")])}
    ran = []

    def harness(side, args, log, on_line=None):
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(docs[side.name]))
        log.write_text("ok\n")
        ran.append((side.name, args[:7]))
        return 0

    monkeypatch.setattr(bump, "_harness", harness)
    timings: dict[str, float] = {}
    found = bump.run_scale([bump.Side("baseline", []), bump.Side("candidate", [])], PLAN, tmp_path, timings)
    assert [r[0] for r in ran] == ["baseline", "candidate"] and ran[0][1] == ["plan", "--model", "tiny", "--from", "tp2", "--to", "tp1"]
    assert [f.kind for f in found] == ["regression", "regression"] and found[0].case == "scale tiny tp2->tp1"
    assert set(timings) == {"scale tiny tp2->tp1 baseline", "scale tiny tp2->tp1 candidate"}


def test_a_real_plan_records_the_layout_it_built(tmp_path):
    """The plan of a tiny config (built on meta under the fake process group) carries a layout per
    key for both topologies, and planning it again gives the same layout (the gate's diff is stable)."""
    from harness.plan.cli import plan

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64, "torch_dtype": "bfloat16"}))
    one, two = plan(str(cfg), "tp2pp2", "tp1pp4"), plan(str(cfg), "tp2pp2", "tp1pp4")
    assert one["layout"]["save"] and one["layout"] == two["layout"]
    assert scale.diff(PLAN, one, two) == []
    tp = one["layout"]["save"]["decoder.layers.self_attention.linear_qkv.weight"]
    assert tp["chunks"] >= 2 and tp["dtype"] == "bfloat16"
