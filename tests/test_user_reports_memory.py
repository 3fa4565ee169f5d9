"""Issue 35, the memory reports (docs/user-reports.md): verl #6691 (the Bridge's grouped export stacks
a layer's whole fused expert tensor on every rank) and verl #5183 (the fully-parallel save's
all_gather_object). Every budget matrices/extended.yaml states for them goes red on a double that
materialises, inside a measured phase (harness.core.memory.track), what the reported failure mode
holds; the double of a correct implementation meets it; a case that measured nothing fails it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable

import pytest
import torch

from harness.core.memory import track
from harness.core.result import WorldRecord
from harness.core.spec import CaseSpec
from harness.core.zoo import HFModelSpec, ModelSpec, get_model
from harness.judge.budgets import Budgets
from harness.orchestration.matrix import load_matrix

EXTENDED = Path(__file__).resolve().parent.parent / "matrices" / "extended.yaml"
F32 = 4


def _cases(tag: str) -> list[CaseSpec]:
    """The extended matrix's cases of `tag`: at two expert sizes, each with x-shard budgets."""
    cases = [s for s in load_matrix(EXTENDED).cases if s.tag == tag]
    assert len({s.model for s in cases}) >= 2, f"{tag}: the budgets must be measured at two expert sizes, got {cases}"
    for s in cases:
        assert s.budgets and all(b.max_peak_delta_x_shard for b in s.budgets), f"{s.id}: no x-shard budget"
    return cases


def _record(phase: str, double: Callable[[], object], shard_bytes: int, ranks: set[str]) -> WorldRecord:
    """What every budgeted rank records when `double` runs as memory phase `phase` (`save:distribute`:
    the backend's `distribute` nested in the case's `save`, what it gathered held until the save ends)."""
    import ctypes
    import gc

    outer, _, inner = phase.partition(":")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap an earlier test left could hide the double's peak in pages already held
    with track(outer) as m:
        if inner:
            with track(inner) as sub:
                held = double()
        else:
            held = double()
        del held
    memory = {outer: m.to_dict(), **({phase: sub.to_dict()} if inner else {})}
    return WorldRecord(memory={p: {r: {**v, "shard_bytes": shard_bytes} for r in ranks} for p, v in memory.items()})


# ------------------------------------------------ verl #6691: the grouped (fused-expert) HF export
def _hf_rank_bytes(spec: HFModelSpec, ep: int) -> int:
    """fp32 bytes of the parameters a rank holds at expert parallelism `ep` (transformers' model of the
    fixture's config on the meta device: the experts split over EP, the rest whole on every rank)."""
    from transformers import AutoModelForCausalLM

    from harness.models.architectures import tiny_config

    with torch.device("meta"):
        named = list(AutoModelForCausalLM.from_config(tiny_config(spec)).named_parameters())
    expert = sum(p.numel() for n, p in named if ".experts." in n)
    return F32 * (sum(p.numel() for _, p in named) - expert + expert // ep)


def _grouped_export(spec: HFModelSpec, ep: int, stream: bool) -> Callable[[], None]:
    """One layer's grouped export on one rank of the EP group, as Megatron-Bridge 0.6.2 runs it
    (models/conversion/model_bridge.py:936-1015, _accumulate_grouped_export): each local expert's
    weight gathered over EP ([ep, ...]), every expert buffered until the layer's E are in, then
    torch.stack'ed into the fused HF tensor (:984): the whole fused tensor twice on every rank, verl
    #6691's failure mode. `stream`: the per-expert streaming the thread proposes (each gathered
    expert handed on and freed)."""
    e, f, h = spec.num_experts, spec.intermediate_size, spec.hidden_size

    def run() -> None:
        for shape in ((h, 2 * f), (f, h)):  # GPT-OSS experts.gate_up_proj [E, H, 2F], down_proj [E, F, H]
            buffers: dict[int, torch.Tensor] = {}
            for local in range(e // ep):
                gathered = torch.ones(ep, *shape)
                if not stream:
                    buffers.update({local + i * (e // ep): gathered[i] for i in range(ep)})
                del gathered
            if buffers:
                merged = torch.stack([buffers[i] for i in range(e)])
                del buffers, merged
    return run


def test_export_budgets_go_red_on_the_pins_grouped_stack_and_hold_per_expert_streaming():
    for case in _cases("export-memory"):
        spec, ep = get_model(case.model, "hf"), case.source.ep
        assert isinstance(spec, HFModelSpec) and spec.num_experts and ep > 1
        budgets, shard = Budgets(case.budgets), _hf_rank_bytes(spec, ep)
        ranks = {str(b.rank) for b in case.budgets}
        ok = budgets.checks_of(_record("export", _grouped_export(spec, ep, stream=True), shard, ranks))
        assert ok and all(c.status == "passed" for c in ok), (case.id, ok)
        red = budgets.checks_of(_record("export", _grouped_export(spec, ep, stream=False), shard, ranks))
        assert red and all(c.status == "failed" and "x its shard" in c.detail for c in red), (case.id, red)
        # the pins hold the whole fused tensor: the entry is the named strict xfail of its budgets
        assert case.xfail and set(case.xfail.checks) == {f"memory-budget:{b.phase}@rank{b.rank}" for b in case.budgets}
        assert "model_bridge.py:" in case.xfail.reason and "#6691" in case.xfail.reason


# ------------------------------------------------ verl #5183: the fully-parallel save's exchange
def _gpt_rank_bytes(spec: ModelSpec, ep: int) -> int:
    """fp32 bytes of the parameters a rank of megatron-core's MoE GPT (local spec, SwiGLU experts,
    untied) holds at expert parallelism `ep`."""
    h, heads, groups = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups
    hd, e = h // heads, spec.num_moe_experts or 0
    layer = h * hd * (heads + 2 * groups) + heads * hd * h + 2 * h + e * h  # qkv, proj, 2 norms, router
    expert = e * 3 * (spec.moe_ffn_hidden_size or 0) * h  # fc1 (2F x H) + fc2 (H x F)
    return F32 * (2 * spec.vocab_size * h + h + spec.num_layers * (layer + expert // ep))


def _exchange(shard_bytes: int, group: int, data: bool) -> Callable[[], object]:
    """The distribution exchange of a fully-parallel save over `group` ranks (megatron-core 0.19.2
    dist_checkpointing/exchange_utils.py:209-216, determine_main_replica_uniform_distribution):
    all_gather_object pickles the rank's list of ShardedTensors and unpickles every rank's. `data`
    False: `without_data()`, as the pins send (keys, shapes, offsets); True: with their data, the
    whole state gathered on every rank (the failure mode the budgets must catch)."""
    n = 64
    if data:
        state: list = [torch.ones(shard_bytes // F32 // n) for _ in range(n)]
    else:
        state = [("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 16, 2048, 256), (0, i, 0, 0)) for i in range(n)]

    def run() -> object:
        payload = pickle.dumps(state)
        return [pickle.loads(payload) for _ in range(group)]
    return run


def test_fully_parallel_save_budgets_go_red_on_a_data_gather_and_hold_on_the_metadata_exchange():
    for case in _cases("fp-save-memory"):
        spec = get_model(case.model, "gpt")
        assert isinstance(spec, ModelSpec) and spec.num_moe_experts and case.backend_opts.get("save_strategy") == "fully_parallel"
        group, shard = case.source.dp * case.source.cp, _gpt_rank_bytes(spec, case.source.ep)
        phases = {b.phase for b in case.budgets}
        assert "save:distribute" in phases, case.id  # the exchange verl #5183 ran out of memory in
        ranks = {str(b.rank) for b in case.budgets}
        budgets = Budgets(case.budgets)
        ok = budgets.checks_of(_record("save:distribute", _exchange(shard, group, data=False), shard, ranks))
        assert ok and all(c.status == "passed" for c in ok), (case.id, ok)
        red = budgets.checks_of(_record("save:distribute", _exchange(shard, group, data=True), shard, ranks))
        assert red and all(c.status == "failed" for c in red), (case.id, red)
        assert case.xfail is None  # the pins gather metadata only (docs/user-reports.md)


@pytest.mark.parametrize("tag", ["export-memory", "fp-save-memory"])
def test_every_budget_fails_on_a_case_that_measured_nothing(tag):
    for case in _cases(tag):
        checks = Budgets(case.budgets).checks_of(WorldRecord())
        assert len(checks) == len(case.budgets) and all(c.status == "failed" and "measured no" in c.detail for c in checks)


def test_the_doubles_shard_is_what_the_case_records():
    """The doubles' shard is the rank's parameters as harness.run.envelope recorded them on the pins
    (shard_bytes of results.json): 4x the expert ffn (export) and 4x the experts (save) grow it ~4x."""
    assert [_hf_rank_bytes(get_model(m, "hf"), 2) for m in ("hf-gpt_oss-mem", "hf-gpt_oss-mem-x4")] == [27_126_976, 102_821_056]
    assert [_gpt_rank_bytes(get_model(m, "gpt"), 2) for m in ("gpt-moe-mem", "gpt-moe-mem-e16")] == [14_431_232, 52_204_544]
