"""The verl-merger case (issue 43 item 1): its judges in-process on hand-made trees (a q/k swap, a
dtype change, nothing at all), verl's platform on CPU, and real worlds whose merger swaps q and k or
drops the last layer's experts (the planted faults the issue names)."""

from __future__ import annotations

import pytest
import torch

from harness.cases.ranks.verl_merger import Merge, merger_argv
from harness.cases.verl_merger import dtype_check, weights_check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
FIXTURE = {Q: torch.arange(8.0).view(2, 4) / 3, K: -torch.arange(8.0).view(2, 4) / 7}


def _bf16(d: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in d.items()}


def test_the_fixture_rounded_to_the_merged_dtype_passes_and_a_q_k_swap_fails_weights():
    assert weights_check(FIXTURE, _bf16(FIXTURE), "pp1").status == "passed"
    swapped = weights_check(FIXTURE, _bf16({Q: FIXTURE[K], K: FIXTURE[Q]}), "pp1")
    assert swapped.status == "failed" and {m.key for m in swapped.mismatches} == {Q, K}


def test_a_missing_tensor_and_empty_input_fail_weights():
    missing = weights_check(FIXTURE, _bf16({Q: FIXTURE[Q]}), "pp1")
    assert missing.status == "failed" and [m.key for m in missing.mismatches] == [K]
    assert weights_check({}, {}, "pp1").status == "failed"


def test_dtype_names_the_cast_and_fails_on_nothing():
    changed = dtype_check(FIXTURE, _bf16(FIXTURE))
    assert changed.status == "failed" and "2 of 2" in changed.detail and "float32 -> bfloat16" in changed.detail
    assert dtype_check(FIXTURE, dict(FIXTURE)).status == "passed"
    assert dtype_check({}, {}).status == "failed"


def test_the_command_line_is_verls_with_the_tied_and_cpu_flags_only_where_they_apply():
    base = merger_argv(Merge("/a", "/b", tied=False), cpu=False)
    assert base == ["verl.model_merger", "merge", "--backend", "megatron", "--local_dir", "/a", "--target_dir", "/b"]
    both = merger_argv(Merge("/a", "/b", tied=True), cpu=True)
    assert both[len(base):] == ["--tie-word-embedding", "--use_cpu_initialization"]


def test_verls_platform_on_a_cpu_rank_is_gloo_after_the_shim_and_nccl_before():
    pytest.importorskip("verl")
    if torch.cuda.is_available():
        pytest.skip("the probe says not needed where CUDA is present")
    import verl.plugin.platform.platform_manager as pm
    from verl.utils.device import get_nccl_backend, get_torch_device

    from harness.compat.verl_platform import platform_missing, use_cpu_platform

    saved = pm._current_platform
    try:
        pm._current_platform = None
        assert get_nccl_backend() == "nccl" and platform_missing()  # verl's fallback: 'nvidia' on a box without it
        use_cpu_platform()
        assert get_nccl_backend() == "gloo" and get_torch_device() is torch.cpu and not platform_missing()
    finally:
        pm._current_platform = saved


def _spec(model: str, src: str, dst: str, **backend) -> CaseSpec:
    return CaseSpec("verl-merger", model, "verl_manager", Topology.parse(src), Topology.parse(dst), timeout_s=240,
                    backend_options=tuple(sorted({"save_contents": ("model", "hf_model"), **backend}.items())))


def _failed(r) -> set[str]:
    return {c.name for c in r.checks if c.status == "failed"}


def test_a_merger_that_swaps_q_and_k_fails_integrity_weights_and_logits():
    pytest.importorskip("verl")
    # the unplanted merge of the same pair is matrices/verl.yaml's default-tier entry (only the bf16 cast fails, named)
    bad = run_case(_spec("hf-llama", "tp2", "pp1"), RunOptions(rank_hooks=("doubles:merger_swaps_q_and_k",)))
    # GQA: q and k differ in shape, so the tree fails its own integrity and transformers refuses to load it
    assert _failed(bad) == {"merger-dtype", "export-integrity", "merger-weights", "merger-logits"}, bad.failure_text()
    keys = {m.key for m in bad.check("merger-weights").mismatches}
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.0.self_attn.k_proj.weight" in keys


@pytest.mark.slow
def test_a_merger_that_drops_the_last_layers_experts_fails_integrity_and_weights():
    pytest.importorskip("verl")
    r = run_case(_spec("hf-qwen3_moe", "tp1", "pp1", bridge="vanilla"), RunOptions(rank_hooks=("doubles:merger_drops_last_layer_experts",)))
    assert _failed(r) == {"merger-dtype", "export-integrity", "merger-weights", "merger-logits"}, r.failure_text()
    missing = [m.key for m in r.check("merger-weights").mismatches]
    assert missing and all(k.startswith("model.layers.3.mlp.experts.") for k in missing), missing


def test_moe_layers_keep_tes_pre_mlp_norm_key_and_dense_layers_keep_the_fused_one():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harness.models.cpu_experts import te_moe_keys

    moe = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    dense = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert moe.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"  # Core's, unfixed
    te_moe_keys(moe), te_moe_keys(dense)
    assert "pre_mlp_layernorm." not in moe.submodules.sharded_state_dict_keys_map
    assert moe.submodules.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"
    assert dense.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"
    built = te_moe_keys(lambda config, vp_stage=None: get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"))
    assert "pre_mlp_layernorm." not in built(None).submodules.sharded_state_dict_keys_map  # a spec function is wrapped
    import inspect

    assert "vp_stage" in inspect.signature(built).parameters  # Bridge's provider passes vp_stage only where it is declared
