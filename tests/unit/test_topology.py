import pytest

from gradlane.errors import ConfigError
from gradlane.testbed.topology import MAX_HOSTS, Topology
from gradlane.units import MIN_RATE_BPS


def test_build_one_rate_for_all_and_per_host_list() -> None:
    assert Topology.build("c", 3, "1gbit").rates == (10**9,) * 3
    topo = Topology.build("c", 3, "1gbit,1gbit,500mbit")
    assert topo.rates == (10**9, 10**9, 5 * 10**8)
    # What the testbed and the bench get when they say no more: one switch, one NIC a
    # host, 1,000-packet queues, built or made directly alike.
    for plain in (topo, Topology("c", topo.rates)):
        assert (plain.leaves, plain.uplink_bps, plain.nics, plain.queue_packets) == (
            1, None, 1, 1000)


def test_names_and_addresses() -> None:
    topo = Topology.build("demo", 4, "1gbit", leaves=2, uplink="1gbit", nics=2)
    assert topo.switch_ns == "gl-demo-sw"
    assert topo.host_ns(3) == "gl-demo-h3"
    assert [topo.leaf_of(h) for h in range(1, 5)] == [0, 0, 1, 1]
    assert Topology.build("x", 5, "1gbit", leaves=2, uplink="1gbit").leaf_of(3) == 0
    assert topo.address(3, 1) == "10.200.1.3" and topo.address(3) == "10.200.0.3"
    assert topo.namespaces()[0] == "gl-demo-sw" and len(topo.namespaces()) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Bad-Name"}, "cluster name"),
        ({"hosts": 1, "rate": "1gbit"}, "2..64 hosts"),
        ({"rate": "1gbit,2gbit"}, "2 rates for 3 hosts"),
        ({"leaves": 2}, r"two leaves need the rate of the uplink between them \(--uplink"),
        ({"leaves": 2, "uplink": "1bit"}, "rate must be at least 8Kbit"),
        ({"uplink": "1gbit"}, "only applies with two leaves"),
        ({"nics": 3}, "nics"),
        ({"rate": "fast"}, "bad rate"),
        ({"queue_packets": 1}, "queue_packets"),
    ],
)
def test_bad_topologies_are_refused(kwargs: dict, message: str) -> None:
    args = {"name": "c", "hosts": 3, "rate": "1gbit"} | kwargs
    with pytest.raises(ConfigError, match=message):
        Topology.build(**args)


def test_each_bound_is_inclusive_and_the_next_value_is_refused() -> None:
    """The limits as the messages state them: 2..64 hosts, 2..100000 packets of queue,
    rates from 8 kbit/s (checked on the topology itself too, not only by the rate parser)."""
    assert Topology.build("c", MAX_HOSTS, "1gbit").hosts == MAX_HOSTS
    with pytest.raises(ConfigError, match="2..64 hosts, got 65"):
        Topology.build("c", MAX_HOSTS + 1, "1gbit")
    for packets in (2, 100_000):
        assert Topology.build("c", 2, "1gbit", queue_packets=packets).queue_packets == packets
    with pytest.raises(ConfigError, match="queue_packets must be in 2..100000, got 100001"):
        Topology.build("c", 2, "1gbit", queue_packets=100_001)
    slowest = Topology("c", (MIN_RATE_BPS, MIN_RATE_BPS), leaves=2, uplink_bps=MIN_RATE_BPS)
    assert slowest.rates == (MIN_RATE_BPS,) * 2 and slowest.uplink_bps == MIN_RATE_BPS
    with pytest.raises(ConfigError, match="host rates must be at least 8000 bit/s"):
        Topology("c", (MIN_RATE_BPS, MIN_RATE_BPS - 1))
    with pytest.raises(ConfigError, match="uplink rate of at least 8000 bit/s"):
        Topology("c", (MIN_RATE_BPS,) * 2, leaves=2, uplink_bps=MIN_RATE_BPS - 1)


def test_one_switch_holds_every_host() -> None:
    assert {Topology.build("c", 5, "1gbit").leaf_of(h) for h in range(1, 6)} == {0}
