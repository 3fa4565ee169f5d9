"""harness.orchestration.explore: the strategy draws only valid triples and the shapes the zoo lacks (in-process,
no worlds); the search shrinks a planted failure and prints what reproduces it (a stand-in for the
worlds); a derandomised short profile runs real worlds; a longer one runs nightly (slow)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from harness.core import truth
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.orchestration import explore as ex


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ex.triples(4))
def test_strategy_yields_only_valid_triples(triple):
    model, src, dst = triple
    for topo in (src, dst):
        topo.validate(model, available_ranks=4)  # raises on an invalid one
    assert src != dst
    assert model.hidden_size % model.num_attention_heads == 0
    assert model.num_attention_heads % model.num_query_groups == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ex.triples(4, "hf"))
def test_hf_strategy_yields_only_valid_triples(triple):
    model, src, dst = triple
    for topo in (src, dst):
        topo.validate(model, available_ranks=4)
        assert topo.cp == 1
    assert model.kind == "hf" and src != dst and model.vocab_size > 4  # the fixture tokenizer has 4 specials


def test_reproduction_entries_name_the_model_and_case():
    hf = find(ex.triples(4, "hf"), lambda t: t[0].tied and t[1].tp != t[2].tp)
    model, src, dst = hf
    assert ex.zoo_entry(model).startswith(f'HFModelSpec("{model.name}"') and "arch=" in ex.zoo_entry(model)
    entry = ex.matrix_entry(model, src, dst)
    assert "case: hf-roundtrip" in entry and "backends: [bridge_hf]" in entry and "markers: [hf]" in entry


def test_strategy_reaches_what_the_zoo_lacks():
    """Non-power-of-two sizes, layers split differently (pp2 and pp3), and a TP change that changes
    the padded vocab: each found by hypothesis' own search of the strategy."""
    odd = find(ex.triples(4), lambda t: not _pow2(t[0].num_attention_heads) and not _pow2(t[0].hidden_size)
               and not _pow2(t[0].vocab_size) and t[0].vocab_size % 2 == 1)
    assert odd[0].vocab_size % 2 == 1
    pipes = find(ex.triples(4), lambda t: {t[1].pp, t[2].pp} == {2, 3})
    assert pipes[0].num_layers % 6 == 0
    padded = find(ex.triples(4), lambda t: t[0].padded_vocab_size(t[1].tp) != t[0].padded_vocab_size(t[2].tp))
    model, src, dst = padded
    assert model.make_vocab_size_divisible_by is not None and src.tp != dst.tp


def test_padded_vocab_size_is_megatron_lms_formula():
    m = ModelSpec("m", "", hidden_size=48, num_attention_heads=6, num_query_groups=3, ffn_hidden_size=96,
                  vocab_size=97, make_vocab_size_divisible_by=8)
    assert [m.padded_vocab_size(tp) for tp in (1, 2, 3, 4)] == [104, 112, 120, 128]
    assert ModelSpec("z", "", vocab_size=97).padded_vocab_size(4) == 97  # zoo default: no padding
    Topology(tp=3).validate(m)  # a padded vocab need not be divisible by tp


def test_real_vocab_rows_do_not_depend_on_the_padded_size():
    m = ModelSpec("m", "", vocab_size=97, hidden_size=24, make_vocab_size_divisible_by=8)
    key = "embedding.word_embeddings.weight"
    a, b = truth.canonical_tensor(m, key, (104, 24)), truth.canonical_tensor(m, key, (120, 24))
    assert torch.equal(a[:97], b[:97]) and not torch.equal(a[97:104], b[97:104])
    plain = ModelSpec("p", "", vocab_size=128, hidden_size=24)
    assert torch.equal(truth.canonical_tensor(plain, key, (128, 24)), truth._noise((128, 24), plain.seed, key) * 0.05)


def test_a_failure_shrinks_to_the_smallest_triple_and_prints_its_reproduction(tmp_path, monkeypatch):
    """A planted defect (any model of >= 3 layers loses at a TP change) stands in for the worlds:
    hypothesis shrinks to 3 layers and a one-step TP change, and the database keeps it."""
    from harness.core.result import CaseResult

    def fake(model, src, dst, workdir, timeout_s=0.0):
        r = CaseResult("x", "reshard-weights", model.name, "mcore_dist", src.id, dst.id, status="passed")
        if model.num_layers >= 3 and src.tp != dst.tp:
            r.status, r.error = "error", "planted"
        return r

    monkeypatch.setattr(ex, "run_triple", fake)
    rep = ex.explore(budget_s=60, report_dir=tmp_path / "seeded", max_examples=400, derandomize=True)
    assert rep.stopped_by == "failure" and rep.minimal is not None
    assert rep.minimal.model["num_layers"] == 3
    assert {rep.minimal.source, rep.minimal.target} == {"tp1pp1dp1cp1", "tp2pp1dp1cp1"}
    assert "num_layers=3" in rep.zoo_entry and rep.minimal.model["name"] in rep.matrix_entry
    assert f"{rep.minimal.source} -> {rep.minimal.target}" in rep.matrix_entry
    assert (tmp_path / "seeded" / "explore.json").exists()
    # unseeded: hypothesis keeps the failure in REPORT/hypothesis and replays it first next time
    first = ex.explore(budget_s=60, report_dir=tmp_path / "db", max_examples=400)
    assert first.minimal is not None and any((tmp_path / "db" / "hypothesis").iterdir())
    again = ex.explore(budget_s=60, report_dir=tmp_path / "db", max_examples=400)
    assert again.examples[0].status != "passed" and again.minimal is not None


def test_short_profile_runs_real_worlds(tmp_path):
    """Derandomised: the same 4 triples every run, through the real reshard-weights worlds."""
    rep = ex.explore(budget_s=30, report_dir=tmp_path, max_examples=4, derandomize=True)
    assert not rep.failures, rep.failures[0].failure if rep.failures else ""
    assert len(rep.examples) >= 1 and rep.stopped_by in ("max_examples", "budget")


@pytest.mark.slow
def test_long_profile(tmp_path):
    """Nightly: 4 minutes of random triples (a new stream each night; failures persist in the database)."""
    rep = ex.explore(budget_s=240, report_dir=tmp_path)
    assert not rep.failures, f"{rep.minimal}\n{rep.zoo_entry}\n{rep.matrix_entry}"


def test_judge_side_compares_real_rows_and_reports_padding():
    """real_rows cuts only the padded vocab tensors; padding_check reports what D's padding rows hold."""
    from harness.cases.reshard_weights import padding_check, real_rows

    m = ModelSpec("m", "", hidden_size=48, num_attention_heads=6, num_query_groups=3, ffn_hidden_size=96,
                  vocab_size=97, make_vocab_size_divisible_by=8)
    emb, norm = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"
    state = {emb: truth.canonical_tensor(m, emb, (104, 48)), norm: torch.ones(48)}
    cut = real_rows(m, state)
    assert cut[emb].shape == (97, 48) and cut[norm] is state[norm]
    out = "output_layer.weight"
    state[out] = truth.canonical_tensor(m, out, (104, 48))
    at_d = {emb: torch.zeros(112, 48), out: torch.zeros(112, 48)}
    c = padding_check(m, Topology(tp=1), Topology(tp=2), state, at_d, "fp32")
    assert c.status == "passed" and "104 at tp1pp1dp1cp1" in c.detail and "112 at tp2pp1dp1cp1" in c.detail and "zero" in c.detail
    plain = ModelSpec("z", "")
    assert real_rows(plain, {emb: torch.ones(128, 64)})[emb].shape == (128, 64)


def test_padding_check_fails_a_wrong_padded_size_or_padding_rows_against_the_truth():
    """vocab-padding judges: the checkpoint's rows are Megatron-LM's padded size at S and its padding
    rows the canonical ones built there; D's row count is the padded size at D; a vocab tensor must exist."""
    from harness.cases.reshard_weights import padding_check

    m = ModelSpec("m", "", hidden_size=48, num_attention_heads=6, num_query_groups=3, ffn_hidden_size=96,
                  vocab_size=97, make_vocab_size_divisible_by=8)
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    good = {k: truth.canonical_tensor(m, k, (104, 48)) for k in (emb, out)}
    at_d = {k: torch.zeros(112, 48) for k in (emb, out)}
    src, dst = Topology(tp=1), Topology(tp=2)
    assert padding_check(m, src, dst, good, at_d, "fp32").status == "passed"
    zeroed = {**good, emb: torch.cat([good[emb][:97], torch.zeros(7, 48)])}  # a save that zeroed the padding rows
    c = padding_check(m, src, dst, zeroed, at_d, "fp32")
    assert c.status == "failed" and "padding rows are not the ones built at tp1pp1dp1cp1" in c.detail
    grown = {**good, out: truth.canonical_tensor(m, out, (112, 48))}  # padded as if at tp2
    assert "holds 112 rows, tp1pp1dp1cp1 pads to 104" in padding_check(m, src, dst, grown, at_d, "fp32").detail
    short = {**at_d, emb: torch.zeros(104, 48)}
    assert "104 rows loaded at tp2pp1dp1cp1, which pads to 112" in padding_check(m, src, dst, good, short, "fp32").detail
    c = padding_check(m, src, dst, {emb: good[emb]}, at_d, "fp32")
    assert c.status == "failed" and "output_layer.weight: missing from the checkpoint" in c.detail


@pytest.mark.slow
def test_long_profile_hf(tmp_path):
    """Nightly: 3 minutes of HF fixtures through hf-roundtrip, without the Bridge's vocab padding
    (its export leaks padded rows: a known defect, the `padvocab` xfails in matrices/smoke.yaml),
    so the search looks past it."""
    rep = ex.explore(budget_s=180, report_dir=tmp_path, kind="hf", hf_pad_vocab=False)
    assert not rep.failures, f"{rep.minimal}\n{rep.zoo_entry}\n{rep.matrix_entry}"
