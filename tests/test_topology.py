import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.zoo import ZOO, get_model
from harness.topology import Topology, TopologyError

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


def test_reserved_dims_refused_until_supported():
    with pytest.raises(TopologyError, match="vpp"):
        Topology(vpp=2)


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


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_fits_every_small_topology(name):
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for cp in (1, 2, 4):
                Topology(tp=tp, pp=pp, cp=cp).validate(ZOO[name])
