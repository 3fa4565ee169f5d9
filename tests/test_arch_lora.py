"""The MoE families' LoRA (peft-export of matrices/architectures.yaml) on CPU: the grouped expert
stand-ins (harness.models.cpu_experts) are what the Bridge's LoRA adapts as it adapts TE's grouped
linears, compute TEGroupedMLP's forward with the adapter, and checkpoint under SequentialMLP's keys;
the harness's own adapter mapping (harness.models.peft_mapping) names grouped and shared experts as
each family's HF checkpoint does; the asked LoRA targets follow transformers' layer layout."""

from __future__ import annotations

import socket

import pytest
import torch

from harness.core.zoo import get_model


# An in-process gloo world leaves the xdist worker unable to fork: a later forked world (test_bench's)
# hangs at its first collective (reproduced: test_arch_lora.py then test_bench.py in one process).
# Opt-in until the world runs in a child process.
_IN_PROCESS_WORLD = pytest.mark.slow


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world with megatron-core's model-parallel groups (torn down after)."""
    import torch.distributed as dist

    from harness.compat.te import import_megatron_bridge
    from harness.core.topology import Topology
    from harness.models.parallel import init_parallel, seed_model_parallel, teardown_parallel_state

    import_megatron_bridge()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_parallel(Topology())
    seed_model_parallel(7)
    yield
    teardown_parallel_state()
    dist.destroy_process_group()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=3, moe_ffn_hidden_size=4, ffn_hidden_size=16,
                gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_activation_fusion=False,
                bias_dropout_fusion=False, use_cpu_initialization=True, moe_router_topk=2)
    return TransformerConfig(**{**base, **kw})


def _experts(config):
    from harness.models import cpu_experts

    return cpu_experts.grouped_names_mlp()(config.num_moe_experts, config)


@_IN_PROCESS_WORLD
def test_bridge_lora_adapts_the_grouped_linears_as_te_grouped_ones(world):
    """LoRA wraps experts.linear_fc1/linear_fc2 (one adapter shared by the local experts, expert-TP),
    with the full in/out features TE's grouped linears report; the wrapped TEGroupedMLP forward is
    each expert's SwiGLU over (W_e + s B A), fc2 likewise, weighted by the router probs."""
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.peft.lora_layers import LoRALinear

    config = _config()
    mlp = _experts(config)
    lora = LoRA(target_modules=["linear_fc1", "linear_fc2"], dim=2, alpha=4)
    for fc in ("linear_fc1", "linear_fc2"):
        setattr(mlp, fc, lora.transform(getattr(mlp, fc), name=fc, prefix="decoder.layers.0.mlp.experts"))
        wrapped = getattr(mlp, fc)
        assert isinstance(wrapped, LoRALinear) and wrapped.adapter.is_expert
    assert mlp.linear_fc1.adapter.linear_in.weight.shape == (2, 8) and mlp.linear_fc1.adapter.linear_out.weight.shape == (8, 2)
    assert mlp.linear_fc2.adapter.linear_in.weight.shape == (2, 4) and mlp.linear_fc2.adapter.linear_out.weight.shape == (8, 2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x, splits = torch.randn(7, 8, generator=g), torch.tensor([2, 0, 5])
    probs = torch.rand(7, generator=g)
    out, _ = mlp(x, splits, probs)

    def delta(fc):
        a = getattr(mlp, fc).adapter
        return a.linear_out.weight @ a.linear_in.weight * (4 / 2)

    want, start = [], 0
    for e, n in enumerate(splits.tolist()):
        xe = x[start : start + n]
        h = xe @ (getattr(mlp.linear_fc1.to_wrap, f"weight{e}") + delta("linear_fc1")).T
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up * probs[start : start + n, None]
        want.append(h @ (getattr(mlp.linear_fc2.to_wrap, f"weight{e}") + delta("linear_fc2")).T)
        start += n
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)


@_IN_PROCESS_WORLD
def test_grouped_experts_checkpoint_under_sequential_keys(world):
    """GroupedNamesMLP's sharded state dict: state-dict names `linear_fc1.weight<i>` (what
    load_state_dict takes back), checkpoint keys SequentialMLP's with the global expert axis, no extra state."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = _config()
    grouped = _experts(config).sharded_state_dict("mlp.experts.", metadata={})
    spec = get_gpt_layer_local_spec(num_experts=3, moe_grouped_gemm=False).submodules.mlp.keywords["submodules"].experts
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seq = SequentialMLP(3, config, spec.keywords["submodules"], pg_collection=pgs).sharded_state_dict("mlp.experts.", metadata={})
    assert set(grouped) == {f"mlp.experts.linear_fc{f}.weight{i}" for f in (1, 2) for i in range(3)}

    def axes(sd):  # every sharded tensor (a SwiGLU factory's gate and up halves built) as (key, offset, shape)
        out = []
        for k, v in sd.items():
            built = v.build() if hasattr(v, "build") else v
            for t in built.values() if isinstance(built, dict) else built if isinstance(built, (list, tuple)) else [built]:
                out.append((t.key, t.global_offset, t.global_shape))
        return sorted(out)

    assert axes(grouped) == axes({k: v for k, v in seq.items() if "_extra_state" not in k}) and len(axes(grouped)) == 3 * 3
    assert set(_experts(config).state_dict()) == {f"linear_fc{f}.weight{i}" for f in (1, 2) for i in range(3)}


def test_adapter_mapping_names_grouped_and_shared_experts_per_family():
    """A grouped expert adapter is every expert's, a shared expert's the family's shared MLP
    (hy_v3: mlp.shared_mlp), MiniMax-M2's experts w1/w3/w2 under block_sparse_moe; in-memory names back."""
    from harness.models import peft_mapping as pm

    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(12.0).reshape(6, 2)
    for name, shared, experts, gate in (("hf-glm4_moe", "mlp.shared_experts", "mlp.experts", "gate_proj"),
                                        ("hf-hy_v3", "mlp.shared_mlp", "mlp.experts", "gate_proj"),
                                        ("hf-minimax_m2", "mlp.shared_experts", "block_sparse_moe.experts", "w1")):
        spec = get_model(name, "hf")
        out = pm.to_hf_peft({"decoder.layers.1.mlp.experts.linear_fc1.adapter.linear_in.weight": a,
                             "decoder.layers.1.mlp.experts.linear_fc1.adapter.linear_out.weight": b,
                             "decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_out.weight": b}, spec)
        p = "base_model.model.model.layers.1."
        assert {k for k in out if ".experts." in k and "lora_A" in k and "shared" not in k} == {
            f"{p}{experts}.{e}.{leaf}.lora_A.weight" for e in range(spec.num_experts) for leaf in (gate, pm.expert_leaf("up_proj", spec.arch))}
        assert torch.equal(out[f"{p}{experts}.3.{gate}.lora_B.weight"], b[:3])
        assert f"{p}{shared}.down_proj.lora_B.weight" in out
        assert pm.memory_name(f"model.layers.1.{experts}.0.{gate}", spec.arch) == "model.layers.1.mlp.experts.0.gate_proj"
    assert pm.memory_name("model.layers.1.mlp.shared_mlp.up_proj", "hy_v3") == "model.layers.1.mlp.shared_experts.up_proj"


def test_gather_deinterleaves_a_grouped_expert_fc1_over_expert_tp():
    """A grouped expert fc1's LoRA-B split over expert-TP holds [gate_r; up_r] per rank."""
    from harness.models.peft_mapping import gather

    name = "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_out.weight"
    g0, u0, g1, u1 = (torch.full((2, 2), float(v)) for v in range(4))
    full = gather([{"name": name, "tp_rank": 0, "data": torch.cat([g0, u0])}, {"name": name, "tp_rank": 1, "data": torch.cat([g1, u1])}])
    assert torch.equal(full[name], torch.cat([g0, g1, u0, u1]))


def test_asked_targets_follow_the_hf_layer_layout():
    """GLM-4.5's layer 0 is dense (first_k_dense_replace), the others hold 4 experts and a shared
    expert: linear_fc1 asks the dense gate/up there, experts + shared expert elsewhere; MiniMax-M2's
    adapter_config names its experts' projections w1/w2/w3."""
    from cases.shared import lora_layout as ll
    from cases.shared.peft import PeftOptions, hf_target_modules

    glm = get_model("hf-glm4_moe", "hf")
    asked = ll.asked(glm, PeftOptions(targets=("linear_fc1",)).entries(glm))["linear_fc1"]
    assert {u for u in asked if ".layers.0." in u} == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert {u for u in asked if ".layers.1." in u} == ({f"model.layers.1.mlp.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj")}
                                                       | {"model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_experts.up_proj"})
    owners = ll.attribute({"model.layers.1.mlp.shared_experts.down_proj"}, glm, PeftOptions().entries(glm))
    assert owners["linear_fc2"] == {"model.layers.1.mlp.shared_experts.down_proj"}
    assert hf_target_modules(get_model("hf-minimax_m2", "hf")) == ["k_proj", "o_proj", "q_proj", "v_proj", "w1", "w2", "w3"]


# --------------------------------------------------------------------------- multi-latent attention


_MLA_ATTN = {"linear_q_down_proj": "self_attn.q_a_proj", "linear_q_up_proj": "self_attn.q_b_proj",
             "linear_kv_down_proj": "self_attn.kv_a_proj_with_mqa", "linear_kv_up_proj": "self_attn.kv_b_proj",
             "linear_proj": "self_attn.o_proj"}


def _no_q_lora(spec):
    """The spec with q_lora_rank None (DeepSeek-V2-Lite's q: one q_proj)."""
    from dataclasses import replace

    return replace(spec, overrides=tuple((k, v) for k, v in spec.overrides if k != "q_lora_rank") + (("q_lora_rank", None),))


@pytest.mark.parametrize("name", ["hf-deepseek_v2", "hf-deepseek_v3", "hf-glm4_moe_lite"])
def test_mla_default_targets_are_the_mla_linears_and_name_transformers_modules(name):
    """A multi-latent-attention model has no linear_qkv: LoRA's defaults are its MLA linears, each one HF
    module that transformers' model of the fixture config holds (q_lora_rank None: linear_q_proj -> q_proj)."""
    from transformers import AutoModelForCausalLM

    from cases.shared import lora_layout as ll
    from cases.shared.peft import PeftOptions, hf_target_modules
    from harness.models.hf import hf_config

    for spec, q in ((get_model(name, "hf"), ("linear_q_down_proj", "linear_q_up_proj")), (_no_q_lora(get_model(name, "hf")), ("linear_q_proj",))):
        targets = PeftOptions().base_targets(spec)
        assert targets == (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")
        with torch.device("meta"):
            held = {n for n, _ in AutoModelForCausalLM.from_config(hf_config(spec)).named_modules()}
        attn = {e.pattern: u for e in PeftOptions().entries(spec) for u in [ll.asked(spec, [e])[e.pattern]] if not e.target.startswith("linear_fc")}
        for target, units in attn.items():
            hf = _MLA_ATTN.get(target, "self_attn.q_proj")
            assert units == {f"model.layers.{i}.{hf}" for i in range(spec.num_layers)}, target
            assert units <= held, target  # transformers' own module names
        modules = hf_target_modules(spec)
        assert {"k_proj", "v_proj"}.isdisjoint(modules) and ("q_proj" in modules) == (q == ("linear_q_proj",))
        PeftOptions(targets=targets[:2]).validate_layout(spec, ())  # the MLA linears are targets of the layout
    llama = get_model("hf-llama", "hf")
    assert PeftOptions().base_targets(llama) == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # non-MLA unchanged


def test_mla_adapter_mapping_gathers_column_parallel_and_names_hf_modules():
    """Each MLA adapter is one HF module's LoRA; at TP 2 its linear_in (the rank) and linear_out (the
    output) are column-parallel splits on dim 0, linear_proj's linear_in a row-parallel split on dim 1."""
    from harness.models import peft_mapping as pm

    spec = get_model("hf-deepseek_v3", "hf")
    pieces, whole = [], {}
    for i, target in enumerate(_MLA_ATTN):
        for which in ("linear_in", "linear_out"):
            name = f"decoder.layers.2.self_attention.{target}.adapter.{which}.weight"
            t = torch.arange(48.0).reshape(4, 12) + 100 * i
            whole[name] = t
            dim = 1 if target == "linear_proj" and which == "linear_in" else 0
            pieces += [{"name": name, "tp_rank": r, "data": c} for r, c in enumerate(t.chunk(2, dim=dim))]
    full = pm.gather(pieces)
    assert all(torch.equal(full[k], v) for k, v in whole.items())
    out = pm.to_hf_peft(full, spec)
    p = "base_model.model.model.layers.2."
    assert set(out) == {f"{p}{hf}.lora_{ab}.weight" for hf in _MLA_ATTN.values() for ab in "AB"}
    for target, hf in _MLA_ATTN.items():
        assert torch.equal(out[f"{p}{hf}.lora_A.weight"], whole[f"decoder.layers.2.self_attention.{target}.adapter.linear_in.weight"])
        assert torch.equal(out[f"{p}{hf}.lora_B.weight"], whole[f"decoder.layers.2.self_attention.{target}.adapter.linear_out.weight"])
    q = pm.to_hf_peft({"decoder.layers.0.self_attention.linear_q_proj.adapter.linear_out.weight": whole[next(iter(whole))]}, spec)
    assert list(q) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]


def test_peft_reference_loads_with_the_attention_hf_roundtrip_references(tmp_path, monkeypatch):
    """One rule (harness.models.hf.reference_attention): a config with Gemma2's attention soft-cap loads
    the transformers+PEFT model with eager attention (sdpa drops the soft-cap), any other with the default."""
    import json

    import peft
    import transformers

    from cases import hf_roundtrip
    from cases.shared import peft as _peft
    from harness.models import hf

    assert hf_roundtrip.reference_attention is hf.reference_attention
    seen = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda d, **kw: seen.append(kw) or "base")
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", lambda base, adapter: (base, adapter))
    for cap, attn in ((50.0, "eager"), (None, None)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "attn_logit_softcapping": cap}))
        assert _peft.load_peft(tmp_path, tmp_path / "adapter") == ("base", tmp_path / "adapter")
        assert seen.pop().get("attn_implementation") == attn


# --------------------------------------------------------------------------- the Mamba-2 projections


def test_gather_deinterleaves_a_mamba_in_proj_over_tp_by_its_parts():
    """megatron-core's MambaMixer splits each part of in_proj (z, x, B, C, dt) over TP: rank r holds
    [z_r; x_r; B_r; C_r; dt_r]. The pieces carry their part sizes; gather puts HF's [z; x; B; C; dt] back.
    Planted: the plain concatenation (what a gather without the parts does) is not that order."""
    from harness.models.peft_mapping import gather

    name = "decoder.layers.0.mixer.in_proj.adapter.linear_out.weight"
    parts = (8, 8, 4, 4, 2)  # global z, x, B, C, dt rows
    full = torch.arange(float(sum(parts) * 3)).reshape(sum(parts), 3)
    chunks = full.split(list(parts))
    shards = [torch.cat([c.chunk(2)[r] for c in chunks]) for r in (0, 1)]
    local = tuple(p // 2 for p in parts)
    got = gather([{"name": name, "tp_rank": r, "data": shards[r], "parts": local} for r in (0, 1)])
    assert torch.equal(got[name], full)
    assert not torch.equal(torch.cat(shards), full)
    with pytest.raises(ValueError, match="without its part sizes"):
        gather([{"name": name, "tp_rank": r, "data": shards[r]} for r in (0, 1)])
    one = gather([{"name": name, "tp_rank": 0, "data": full}])  # TP 1: as it is, parts or none
    assert torch.equal(one[name], full)


def test_mamba_in_proj_parts_come_from_the_hf_config():
    from harness.models.peft_mapping import mamba_in_proj_parts

    # the nemotron_h fixture: 8 heads of 8, 2 groups of state 16 (harness/core/families.py)
    assert mamba_in_proj_parts(get_model("hf-nemotron_h", "hf")) == (64, 64, 32, 32, 8)
    assert mamba_in_proj_parts(get_model("hf-falcon_h1", "hf")) == (64, 64, 32, 32, 8)  # its own spelling: mamba_n_heads, ...
    assert mamba_in_proj_parts(get_model("hf-llama", "hf")) is None


def test_mamba_projection_adapters_map_to_the_mixers_hf_modules_in_mamba_layers_only():
    """in_proj / out_proj adapters name transformers' NemotronH mixer modules; the asked units are the
    Mamba layers' (the fixture's layers 0 and 2), and the targets are allowed on a model with Mamba
    layers only, named in the refusal elsewhere."""
    from cases.shared import lora_layout as ll
    from harness.models import peft_mapping as pm

    nh = get_model("hf-nemotron_h", "hf")
    a, b = torch.ones(2, 4), torch.ones(6, 2)
    out = pm.to_hf_peft({"decoder.layers.2.mixer.in_proj.adapter.linear_in.weight": a,
                         "decoder.layers.2.mixer.out_proj.adapter.linear_out.weight": b}, nh)
    assert set(out) == {"base_model.model.model.layers.2.mixer.in_proj.lora_A.weight",
                        "base_model.model.model.layers.2.mixer.out_proj.lora_B.weight"}
    fh = get_model("hf-falcon_h1", "hf")  # Megatron's mamba_mixer, transformers' `mamba` beside attention in every layer
    assert set(pm.to_hf_peft({"decoder.layers.3.mamba_mixer.in_proj.adapter.linear_in.weight": a}, fh)) == {
        "base_model.model.model.layers.3.mamba.in_proj.lora_A.weight"}
    assert ll.asked(fh, ll.entries(["in_proj"]))["in_proj"] == {f"model.layers.{i}.mixer.in_proj" for i in range(4)}
    asked = ll.asked(nh, ll.entries(["in_proj", "out_proj"]))
    assert asked == {"in_proj": {"model.layers.0.mixer.in_proj", "model.layers.2.mixer.in_proj"},
                     "out_proj": {"model.layers.0.mixer.out_proj", "model.layers.2.mixer.out_proj"}}
    assert ll.text_name("backbone.layers.2.mixer.in_proj") == "model.layers.2.mixer.in_proj"
    ents = ll.entries(["in_proj"], layers=[2])
    owners = ll.attribute({"model.layers.2.mixer.in_proj", "model.layers.0.mixer.in_proj"}, nh, ents)
    assert owners == {ents[0].pattern: {"model.layers.2.mixer.in_proj"}, ll.NO_ENTRY: {"model.layers.0.mixer.in_proj"}}
    kinds = {"lora": ("linear_qkv",)}
    ll.validate(nh, "lora", 4, ("in_proj", "linear_qkv"), (), [], kinds)
    with pytest.raises(ValueError, match=r"\['in_proj'\] not targets of adapter 'lora' on 'hf-llama'"):
        ll.validate(get_model("hf-llama", "hf"), "lora", 4, ("in_proj",), (), [], kinds)


def test_layout_validation_asks_for_mamba_layers_only_when_a_mamba_target_is_named(monkeypatch):
    """Found by the Bridge sweep: validating every LoRA entry built transformers' model of its fixture, and
    under an older transformers without the family's model_type (0.5.1's 5.8.1: no minimax_m3_vl) the whole
    architecture matrix failed to load. Default targets never build it; a Mamba target on a model type the
    installed transformers lacks is left to the run (not checked), never a load-time KeyError."""
    from cases.shared import lora_layout as ll

    def boom(model):
        raise KeyError(model.arch)

    monkeypatch.setattr(ll, "mlp_units", boom)
    kinds = {"lora": ("linear_qkv",)}
    ll.validate(get_model("hf-llama", "hf"), "lora", 4, ("linear_qkv",), (), [], kinds)  # never asks
    with pytest.raises(ll.FixtureUnavailable, match="cannot build"):
        ll.has_mamba(get_model("hf-nemotron_h", "hf"))
    import transformers.models.auto.configuration_auto as auto

    monkeypatch.setattr(auto, "CONFIG_MAPPING_NAMES", {})  # an older transformers: no such model type
    assert ll.has_mamba(get_model("hf-nemotron_h", "hf")) is None
    ll.validate(get_model("hf-nemotron_h", "hf"), "lora", 4, ("in_proj",), (), [], kinds)  # left to the run
