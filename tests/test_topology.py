import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.core.topology import Topology, TopologyError
from harness.core.zoo import ODD_SHAPES, ZOO, get_model

dims = st.integers(min_value=1, max_value=16)


@given(tp=dims, pp=dims, dp=dims, cp=dims)
def test_id_round_trips_and_world_size_is_derived(tp, pp, dp, cp):
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp)
    assert Topology.parse(topo.id) == topo
    assert topo.world_size == tp * pp * dp * cp


def test_compact_forms():
    assert Topology.parse("tp2").id == "tp2pp1dp1cp1"
    assert Topology.parse("TP2_PP2").id == "tp2pp2dp1cp1"
    assert Topology.parse({"tp": 2, "dp": 2}).world_size == 4


@pytest.mark.parametrize("text", ["", "tp", "tp0", "tp2tp2", "xx2", "tp-1", "tp2 pp", 3])
def test_bad_topologies_are_refused(text):
    with pytest.raises(TopologyError):
        Topology.parse(text)


def test_unknown_mapping_dimension_named():
    with pytest.raises(TopologyError, match="zz"):
        Topology.parse({"tp": 2, "zz": 1})


def test_dense_ids_unchanged_and_expert_dims_shown_only_when_set():
    assert Topology(tp=2, dp=2).id == "tp2pp1dp2cp1"
    assert Topology.parse("tp2etp2") == Topology(tp=2)  # etp defaults to tp, as in megatron-core
    assert Topology.parse("tp2pp2vpp2").id == "tp2pp2dp1cp1vpp2"
    assert Topology.parse("dp4ep2etp1").id == "tp1pp1dp4cp1ep2"
    assert Topology.parse("tp2dp2ep2etp1").id == "tp2pp1dp2cp1ep2etp1"


@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]), vpp=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2, 4]), etp=st.sampled_from([1, 2, 4]))
def test_expert_ids_round_trip_and_groups_derive_as_megatron(tp, pp, vpp, dp, ep, etp):
    try:
        topo = Topology(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep, etp=etp)
    except TopologyError as exc:
        assert ("vpp" in str(exc) and pp == 1) or "etp*ep*pp" in str(exc)
        return
    assert Topology.parse(topo.id) == topo
    assert topo.expert_dp * topo.etp * topo.ep * topo.pp == topo.world_size


@pytest.mark.parametrize("text, rule", [
    ("vpp2", "needs pp > 1"),
    ("tp1dp2ep4", r"not divisible by etp\*ep\*pp"),
])
def test_impossible_expert_and_virtual_topologies(text, rule):
    with pytest.raises(TopologyError, match=rule):
        Topology.parse(text)


class _Moe:
    name, num_layers, num_attention_heads, num_query_groups = "moe-x", 4, 8, 4
    ffn_hidden_size, vocab_size, seq_length, num_moe_experts, moe_ffn_hidden_size = 128, 128, 16, 4, 32


@pytest.mark.parametrize("topo, rule", [
    ("pp2vpp4", "num_layers=4 is not divisible by pp*vpp=2*4"),
    ("dp8ep8", "num_moe_experts=4 is not divisible by ep=8"),
    ("tp4etp4dp1", None),
])
def test_moe_and_vpp_validation(topo, rule):
    if rule is None:
        Topology.parse(topo).validate(_Moe())
        return
    with pytest.raises(TopologyError, match=rule.replace("*", r"\*")):
        Topology.parse(topo).validate(_Moe())


def test_expert_dims_need_an_moe_model():
    with pytest.raises(TopologyError, match="need an MoE model"):
        Topology.parse("dp2ep2").validate(get_model("gpt-gqa"))


@pytest.mark.parametrize(
    "topo, rule",
    [
        ("pp3", "num_layers=4 is not divisible by pp=3"),
        ("tp3", "num_attention_heads=8 is not divisible by tp=3"),
        ("tp8", "num_query_groups=4 is not divisible by tp=8"),
        ("cp3", "seq_length=16 is not divisible by 2*cp=6"),
    ],
)
def test_validation_names_model_topology_and_rule(topo, rule):
    with pytest.raises(TopologyError) as exc:
        Topology.parse(topo).validate(get_model("gpt-gqa"))
    assert rule in str(exc.value)
    assert "gpt-gqa" in str(exc.value) and Topology.parse(topo).id in str(exc.value)


def test_world_larger_than_available_ranks():
    with pytest.raises(TopologyError, match="world size 8 exceeds the 4 ranks"):
        Topology.parse("tp2pp2dp2").validate(get_model("gpt-gqa"), available_ranks=4)


@pytest.mark.parametrize("name", sorted(set(ZOO) - ODD_SHAPES))
def test_every_zoo_model_fits_every_small_topology(name):
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for cp in (1, 2, 4):
                Topology(tp=tp, pp=pp, cp=cp).validate(ZOO[name])


@pytest.mark.parametrize("name", sorted(ODD_SHAPES))
def test_an_odd_shaped_model_is_refused_by_name_where_it_does_not_fit(name):
    """The odd shapes are odd (some small topology refuses them, naming the model and the rule), and
    each fits the single rank and the topologies its matrix entries use (the loader validates those)."""
    assert name in ZOO
    Topology().validate(ZOO[name])
    refused = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            try:
                Topology(tp=tp, pp=pp).validate(ZOO[name])
            except TopologyError as exc:
                assert repr(name) in str(exc) and "not divisible" in str(exc), str(exc)
                refused.append((tp, pp))
    assert refused, f"{name} fits every small topology: it does not belong in ODD_SHAPES"
