"""verl's vanilla bridge (harness.models.mbridge, verl_manager option `bridge: vanilla`): the model mbridge
builds through verl's make_megatron_module on CPU computes what transformers computes (so the
TE-named stand-in layers are the HF model, not just the right names), a planted fault turns that
red, and the option's contract is checked at matrix load."""

from __future__ import annotations

import importlib.util

import pytest

from harness.backends import get_backend, resolve
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.run.envelope import RunEnv

needs_mbridge = pytest.mark.skipif(importlib.util.find_spec("mbridge") is None or importlib.util.find_spec("verl") is None,
                                   reason="mbridge/verl not installed (requirements-nodeps.txt)")
VANILLA = {"bridge": "vanilla"}


def _build_and_forward(ctx, arg):
    import torch

    from harness.core.zoo import get_model
    from harness.models import bridge as mb

    hf_dir, topo, fault = arg
    spec = get_model("hf-llama")
    bm = get_backend(resolve("verl_manager", VANILLA)).build_bridge_model(hf_dir, spec, topo)
    names = sorted(n for n, _ in mb.forward_module(bm).named_parameters())
    if fault:  # one fused input norm back at its init (1.0) instead of the fixture's weights
        with torch.no_grad():
            mb.forward_module(bm).decoder.layers[0].self_attention.linear_qkv.layer_norm_weight.fill_(1.0)
    return names, mb.megatron_logits(bm, spec, ctx.device)


def _logits_vs_transformers(tmp_path, tp: int, fault: bool = False):
    from harness.cases.hf_roundtrip import MEGATRON_HF_TOLERANCE
    from harness.core import truth
    from harness.core.zoo import get_model
    from harness.judge.checks import tensor_check
    from harness.models.hf import hf_logits, write_fixture
    from harness.run.preload import warm

    spec = get_model("hf-llama")
    hf_dir = tmp_path / "hf"
    write_fixture(spec, hf_dir)
    warm()
    topo = Topology(tp=tp)
    outs = RunEnv(tmp_path, timeout_s=240).launch("build", _build_and_forward, (str(hf_dir), topo, fault), topo)
    names = outs[0][0]
    logits = next(o[1] for o in outs if o[1] is not None)
    return names, tensor_check("megatron-logits", hf_logits(hf_dir, truth.fixed_input_ids(spec)), logits,
                               "transformers", f"mbridge@{topo.id}", "", MEGATRON_HF_TOLERANCE)


@needs_mbridge
@pytest.mark.parametrize("tp", [1, 2])
def test_the_mbridge_built_model_is_the_hf_model(tmp_path, tp):
    names, check = _logits_vs_transformers(tmp_path, tp)
    # TE's parameter names (what mbridge's name maps read), not the local spec's input_layernorm
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names and not any("input_layernorm" in n for n in names)
    assert check.status == "passed", check.detail


@needs_mbridge
def test_a_norm_left_at_init_fails_the_logits(tmp_path):
    _, check = _logits_vs_transformers(tmp_path, 1, fault=True)
    assert check.status == "failed"


def _spec(model: str = "hf-llama", case: str = "verl-checkpoint") -> CaseSpec:
    bo = {"bridge": "vanilla", "save_contents": ["hf_model"], "load_contents": ["hf_model"]}
    opts = {"sharding": "fully_reshardable"} | ({"steps": 0} if case == "verl-checkpoint" else {})
    return CaseSpec(case, model, "verl_manager", Topology(tp=1), Topology(tp=1), options=tuple(sorted(opts.items())),
                    backend_options=tuple(sorted(bo.items())))


@needs_mbridge
def test_the_vanilla_option_is_checked_at_load():
    from harness.cases import get_case

    with pytest.raises(ValueError, match="bridge"):
        get_backend(resolve("verl_manager", {"bridge": "mbridge"}))
    case = get_case("verl-checkpoint")
    with pytest.raises(ValueError, match="model type mbridge"):
        case.validate(_spec("hf-nemotron"))  # not a model type mbridge maps
    with pytest.raises(ValueError, match="model type mbridge"):
        case.validate(_spec("gpt-gqa"))
    with pytest.raises(ValueError, match="only verl-checkpoint, verl-merger build Bridge models"):
        get_case("reshard-optimizer").validate(_spec("gpt-gqa", "reshard-optimizer"))
    with pytest.raises(ValueError, match="TP/PP/DP models, got tp1pp1dp1cp2"):
        case.validate(CaseSpec("verl-checkpoint", "hf-llama", "verl_manager", Topology(tp=1), Topology(cp=2),
                               options=_spec().options, backend_options=_spec().backend_options))
    case.validate(_spec())  # fits
