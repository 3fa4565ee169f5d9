"""The two Megatron-Bridge MoE LoRA reports (docs/user-reports.md): each new check shown going red
on a test double.

- #5379: a shared grouped-expert LoRA through an EP reshard must come back as the mean of its expert
  slots' source values (check shared-expert-mean, harness.judge.expert_lora). Doubles: the 0.6.2
  load mechanism (every slot read into one buffer) on synthetic values, and a load backend that
  hands every EP rank EP rank 0's value, run through the real case.
- #6076: a shared-outer MoE LoRA exported with a 3D factor stock PEFT cannot load (the peft-load
  rule of harness.judge.lora_tensors). Doubles: a peft-saved adapter with a planted 3D key, and the
  layout #6076 writes over a tiny OLMoE whose experts transformers 5 fuses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from doubles import use_doubles

from harness.backends.mcore_dist import McoreDist
from harness.judge.adapter_load import peft_load_check
from harness.judge.expert_lora import SharedPiece, expected, is_shared_expert_adapter, shared_expert_mean_check
from harness.judge.lora_tensors import is_lora_factor, lora_tensor_problems
from test_user_reports import _adapter  # the tiny Llama base + peft-saved LoRA of the Relax #262 doubles

FC1_IN = "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight"
FC2_OUT = "decoder.layers.1.mlp.experts.linear_fc2.adapter.linear_out.weight"


# ------------------------------------------------ Megatron-Bridge #5379: shared expert LoRA across EP
def _source(ep: int = 2) -> list[SharedPiece]:
    """Each EP rank's own values for two shared adapters (a checkpoint whose EP ranks drifted apart)."""
    g = torch.Generator().manual_seed(5379)
    return [SharedPiece(n, r, ep, 0, torch.randn(4, 8, generator=g)) for r in range(ep) for n in (FC1_IN, FC2_OUT)]


def _slot_loads(source: list[SharedPiece], num_experts: int, aliased: bool) -> list[SharedPiece]:
    """What a load at EP 1 leaves: every expert slot's source value read in turn, then averaged.
    aliased: every slot read into the same buffer (Megatron-Bridge 0.6.2, peft/utils.py:1422-1475),
    so the mean is of one tensor; else one buffer per slot (#5379's fix)."""
    out = []
    for name in sorted({p.name for p in source}):
        per = {p.ep_rank: p.data for p in source if p.name == name}
        ep = len(per)
        slots = [per[s // (num_experts // ep)] for s in range(num_experts)]
        buffer = torch.empty_like(slots[0])
        reads = []
        for value in slots:
            dest = buffer if aliased else torch.empty_like(value)
            dest.copy_(value)
            reads.append(dest)
        out.append(SharedPiece(name, 0, 1, 0, torch.stack(reads).mean(0)))
    return out


def test_shared_expert_adapter_names():
    assert is_shared_expert_adapter(FC1_IN) and is_shared_expert_adapter(FC2_OUT)
    assert not is_shared_expert_adapter("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.adapter.linear_in.weight")
    assert not is_shared_expert_adapter("decoder.layers.0.mlp.shared_experts.linear_fc1.adapter.linear_in.weight")
    assert not is_shared_expert_adapter("decoder.layers.0.mlp.experts.linear_fc1.weight0")


def test_expected_is_the_mean_of_the_slots_a_rank_holds():
    src = _source()
    at_ep1 = expected(src, 0, 1, 4)[(FC1_IN, 0)]
    assert torch.allclose(at_ep1, (src[0].data + src[2].data) / 2)
    # the same EP: a rank's own slots, so its own value, bitwise
    assert torch.equal(expected(src, 1, 2, 4)[(FC1_IN, 0)], src[2].data)


def test_the_0_6_2_aliased_load_goes_red_naming_the_rank_kept_and_the_fix_passes():
    src = _source()
    red = shared_expert_mean_check(src, _slot_loads(src, 4, aliased=True), 4)
    assert red.failed and red.detail.startswith("2 of 2: ") and "it is bitwise source EP rank 1's value" in red.detail
    green = shared_expert_mean_check(src, _slot_loads(src, 4, aliased=False), 4)
    assert green.status == "passed" and "source EP ranks differ by up to" in green.detail, green.detail


def test_agreeing_ep_ranks_pass_whatever_the_load_keeps():
    """What Bridge's init broadcast (#5396) keeps: every rule gives the same value, so the pins pass."""
    g = torch.Generator().manual_seed(5396)
    values = {FC1_IN: torch.randn(4, 8, generator=g), FC2_OUT: torch.randn(4, 8, generator=g)}
    src = [SharedPiece(n, r, 2, 0, v) for r in range(2) for n, v in values.items()]
    assert shared_expert_mean_check(src, _slot_loads(src, 4, aliased=True), 4).status == "passed"


def test_shared_expert_mean_fails_on_nothing_and_on_other_adapters():
    src = _source()
    assert shared_expert_mean_check([], [], 4).failed
    assert shared_expert_mean_check(src, [], 4).failed
    other = [SharedPiece(FC1_IN.replace("layers.0", "layers.3"), 0, 1, 0, src[0].data)]
    assert "different shared adapters" in shared_expert_mean_check(src, other, 4).detail


class RankZeroSharedLoad(McoreDist):
    """A load after which every EP rank holds EP rank 0's shared grouped-expert adapters (what a
    reshard that reads one rank's slots for everybody does)."""

    def load_state(self, ctx, sharded_state, directory):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        state = super().load_state(ctx, sharded_state, directory)
        group = ps.get_expert_model_parallel_group()
        for key in sorted(k for k in state["model"] if is_shared_expert_adapter(k)):
            dist.broadcast(state["model"][key], src=dist.get_global_rank(group, 0), group=group)
        return state


_doubles = use_doubles(test_rank_zero_shared="test_user_reports_lora:RankZeroSharedLoad")


def _reshard_spec(backend: str):
    from harness.core.spec import CaseSpec
    from harness.core.topology import Topology

    return CaseSpec("expert-lora-reshard", "hf-olmoe", backend, Topology.parse("dp2ep2"), Topology.parse("dp2ep2"), timeout_s=180)


def test_rank_zero_shared_load_goes_red_where_the_pins_pass():
    """dp2ep2 -> dp2ep2 with EP ranks that differ: mcore_dist gives each rank its own value back
    (passed); the double gives EP rank 1 EP rank 0's (red)."""
    from harness.orchestration.runner import run_case

    ok = run_case(_reshard_spec("mcore_dist"))
    assert ok.status == "passed", ok.failure_text()
    red = run_case(_reshard_spec("test_rank_zero_shared"))
    check = red.check("shared-expert-mean")
    assert red.status == "failed" and check is not None and check.failed, red.failure_text()
    assert "at EP rank 1 of 2" in check.detail and "it is bitwise source EP rank 0's value" in check.detail


# ------------------------------------------------ Megatron-Bridge #6076: a 3D LoRA key PEFT cannot load
def test_lora_tensor_rule_on_synthetic_files():
    two = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 16),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(16, 2)}
    assert lora_tensor_problems(two) == []
    three = {**two, "base_model.model.model.layers.0.mlp.experts.down_proj.lora_B.weight": torch.zeros(1, 16, 2)}
    assert lora_tensor_problems(three) == [
        "3D LoRA tensor stock PEFT cannot load: base_model.model.model.layers.0.mlp.experts.down_proj.lora_B.weight (1, 16, 2) "
        "(PEFT's factors are 2D, ParamWrapper's packed experts included)"]
    assert lora_tensor_problems({}) == ["the adapter file holds no lora_A/lora_B tensor"]
    assert lora_tensor_problems({"lm_head.weight": torch.zeros(3, 4, 5)}) == ["the adapter file holds no lora_A/lora_B tensor"]
    assert is_lora_factor("x.lora_embedding_A.weight") and not is_lora_factor("x.lora_magnitude_vector.weight")


def test_a_planted_3d_key_goes_red_on_peft_load(tmp_path):
    """The peft-saved adapter passes; the same with the shared side of a shared-outer fc2 added as
    #6076 writes it ([1, out, r] under the expert-agnostic name) fails on the 3D tensor."""
    from safetensors.torch import load_file, save_file

    from cases.shared.peft import peft_load_problems

    base, adapter = _adapter(tmp_path)
    assert peft_load_problems(base, adapter) == []
    planted = tmp_path / "planted"
    shutil.copytree(adapter, planted)
    key = "base_model.model.model.layers.0.mlp.experts.down_proj.lora_B.weight"
    save_file({**load_file(adapter / "adapter_model.safetensors"), key: torch.randn(1, 16, 2)}, planted / "adapter_model.safetensors")
    problems = peft_load_problems(base, planted)
    assert peft_load_check(problems).failed
    assert f"3D LoRA tensor stock PEFT cannot load: {key} (1, 16, 2) (PEFT's factors are 2D, ParamWrapper's packed experts included)" in problems


def _olmoe_6076(tmp: Path) -> tuple[Path, Path]:
    """A tiny OLMoE base (transformers 5 fuses its experts) and the shared-outer adapter in the
    layout #6076 writes: per-expert 2D factors under experts.<e>.*, the shared side 3D, every tensor
    as exported under base_model.model."""
    from safetensors.torch import save_file
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    cfg = OlmoeConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, num_experts=2, num_experts_per_tok=1)
    base, adapter = tmp / "olmoe", tmp / "olmoe-6076"
    OlmoeForCausalLM(cfg).save_pretrained(base)
    r, pre = 2, "base_model.model.model.layers.0.mlp.experts"
    state = {f"{pre}.gate_proj.lora_A.weight": torch.randn(1, r, 16), f"{pre}.up_proj.lora_A.weight": torch.randn(1, r, 16),
             f"{pre}.down_proj.lora_B.weight": torch.randn(1, 16, r)}
    for e in range(2):
        state |= {f"{pre}.{e}.gate_proj.lora_B.weight": torch.randn(8, r), f"{pre}.{e}.up_proj.lora_B.weight": torch.randn(8, r),
                  f"{pre}.{e}.down_proj.lora_A.weight": torch.randn(r, 8)}
    adapter.mkdir()
    save_file(state, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": ["down_proj", "gate_proj", "up_proj"],
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM", "init_lora_weights": True, "lora_dropout": 0.0,
        "bias": "none", "inference_mode": True}))
    return base, adapter


def test_the_6076_layout_over_fused_experts_goes_red(tmp_path):
    """Stock PEFT over transformers 5's fused OLMoE experts: the fused ParamWrapper's keys load as
    missing, the exported ones as unexpected, and every shared-side factor is a 3D tensor."""
    from cases.shared.peft import peft_load_problems

    base, adapter = _olmoe_6076(tmp_path)
    problems = peft_load_problems(base, adapter)
    assert peft_load_check(problems).failed
    three_d = [p for p in problems if p.startswith("3D LoRA tensor")]
    assert len(three_d) == 3 and all(".mlp.experts." in p for p in three_d), problems
    assert any(p.startswith("unexpected: ") and "experts.down_proj.lora_B" in p for p in problems), problems


def test_shared_outer_option_builds_the_bridge_layout():
    from cases.shared.peft import PeftOptions
    from harness.core.zoo import get_model

    spec = PeftOptions(experts="shared-outer", targets=("linear_fc1", "linear_fc2")).spec(get_model("hf-olmoe", "hf"))
    assert spec.experts == "shared-outer"
    with pytest.raises(ValueError, match="shared-outer is LoRA's layout only"):
        PeftOptions(adapter="canonical_lora", experts="shared-outer").validate_layout(get_model("hf-olmoe", "hf"), ())
