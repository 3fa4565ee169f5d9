"""peft-tp-load (a PEFT adapter onto a transformers TP model): the judges on planted faults and empty input,
and whole cases that go red when a rank holds the wrong shard or the adapter loads as a no-op."""

import pytest
import torch

from cases import peft_tp_load as ptl
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

P = "base_model.model.model.layers.{}.{}.{}.default.weight"
PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}


def _saved():
    g = torch.Generator().manual_seed(0)
    return {P.format(0, "self_attn.q_proj", "lora_A"): torch.randn(4, 8, generator=g),
            P.format(0, "self_attn.q_proj", "lora_B"): torch.randn(6, 4, generator=g),
            P.format(1, "self_attn.o_proj", "lora_A"): torch.randn(4, 6, generator=g),
            P.format(1, "self_attn.o_proj", "lora_B"): torch.randn(8, 4, generator=g)}


def _ranks(saved, size=2):
    """What a faithful sharder leaves on each rank, sliced by hand: colwise lora_B by rows, rowwise lora_A by columns."""
    out = []
    for r in range(size):
        got = {n: t.clone() for n, t in saved.items()}
        qb, oa = P.format(0, "self_attn.q_proj", "lora_B"), P.format(1, "self_attn.o_proj", "lora_A")
        got[qb] = saved[qb][3 * r:3 * r + 3].clone()
        got[oa] = saved[oa][:, 3 * r:3 * r + 3].clone()
        out.append(got)
    return out


def test_rank_slice_is_torch_chunk_style():
    t = torch.arange(5.0)
    assert [ptl.rank_slice(t, 0, r, 2).tolist() for r in range(2)] == [[0.0, 1.0, 2.0], [3.0, 4.0]]
    assert [ptl.rank_slice(torch.arange(1.0), 0, r, 2).numel() for r in range(2)] == [1, 0]


def test_shards_check_passes_faithful_shards_and_fails_on_empty():
    s = _saved()
    c = ptl.shards_check(s, _ranks(s), PLAN)
    assert c.status == "passed" and "2 split" in c.detail, c.detail
    assert ptl.shards_check({}, [], PLAN).status == "failed"
    assert ptl.shards_check(s, [], PLAN).status == "failed"


def test_shards_check_names_a_wrong_slice_a_whole_tensor_and_a_missing_one():
    s, qb = _saved(), P.format(0, "self_attn.q_proj", "lora_B")
    ranks = _ranks(s)
    ranks[1][qb] = ranks[0][qb].clone()  # rank 1 holds rank 0's slice
    c = ptl.shards_check(s, ranks, PLAN)
    assert c.status == "failed" and "rank 1" in c.detail and "q_proj.lora_B" in c.detail, c.detail
    ranks = _ranks(s)
    ranks[0][qb] = s[qb].clone()  # not cut at all
    assert "shape" in ptl.shards_check(s, ranks, PLAN).detail
    ranks = _ranks(s)
    del ranks[1][qb]
    assert "not loaded" in ptl.shards_check(s, ranks, PLAN).detail


def test_shards_check_fails_when_nothing_is_split_or_the_style_is_unknown():
    s = _saved()
    whole = [{n: t.clone() for n, t in s.items()} for _ in range(2)]
    assert "proves nothing" in ptl.shards_check(s, whole, {}).detail
    odd = {**PLAN, "model.layers.*.self_attn.o_proj": "packed_rowwise"}
    assert "no rule here" in ptl.shards_check(s, _ranks(s), odd).detail


def test_logits_effect_warnings_and_resave_judges_go_red():
    want = torch.randn(2, 8, 16)
    assert ptl.logits_check(want, [want + 1e-7, want.clone()]).status == "passed"
    assert ptl.logits_check(want, [want, want + 1e-3]).status == "failed"
    assert ptl.logits_check(want, [want, None]).status == "failed"
    assert ptl.logits_check(want, []).status == "failed"
    base = torch.zeros_like(want)
    assert ptl.effect_check([want, want], base).status == "passed"
    assert ptl.effect_check([want, base.clone()], base).status == "failed"  # a no-op adapter on rank 1
    assert ptl.effect_check([], base).status == "failed"
    assert ptl.warnings_check([["UserWarning: Found missing adapter keys while loading the checkpoint: [...]"], []], [[], []]).status == "failed"
    assert ptl.warnings_check([[], []], [["PeftWarning: 1 LoRA tensor(s) have invalid shape"], []]).status == "failed"
    assert ptl.warnings_check([["UserWarning: something else"], []], [[], []]).status == "passed"
    assert ptl.warnings_check([], []).status == "failed"
    f = {k.replace(".default", ""): t for k, t in _saved().items()}
    assert ptl.resave_check(f, [dict(f), dict(f)]).status == "passed"
    k = sorted(f)[0]
    assert ptl.resave_check(f, [dict(f), {**f, k: f[k] + 1e-7}]).status == "failed"
    assert "missing" in ptl.resave_check(f, [dict(f), {n: t for n, t in f.items() if n != k}]).detail
    assert ptl.resave_check({}, []).status == "failed" and ptl.resave_check(f, []).status == "failed"


def _spec(backend, src="tp1", dst="tp2"):
    return CaseSpec("peft-tp-load", "hf-llama", backend, Topology.parse(src), Topology.parse(dst), timeout_s=120)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_a_rank_holding_another_rank_s_slice_fails_shards_and_logits(override):
    r = run_case(_spec(override("PeftTpFirstShardEverywhere")))
    c = _checks(r)
    assert r.status == "failed", r.failure_text()
    assert c["shards"] == "failed" and "rank 1" in r.check("shards").detail and c["logits"] == "failed"
    assert c["warnings"] == "passed"


def test_an_adapter_that_loads_as_a_no_op_fails_the_effect(override):
    r = run_case(_spec(override("PeftTpLoadsAsNoop")))
    c = _checks(r)
    assert c["adapter-effect"] == "failed" and c["logits"] == "failed" and c["shards"] == "failed"


@pytest.mark.parametrize("src,dst", [("tp1", "tp1"), ("tp2", "tp2"), ("tp1", "dp2")])
def test_other_pairs_are_refused_by_name(src, dst):
    r = run_case(_spec("hf_peft", src, dst))
    assert r.status == "error" and "tp1 -> tpN" in r.error, r.error
