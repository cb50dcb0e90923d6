"""How the simulator's links serve queued collectives (`gradlane.policies.sim.network`)."""

import numpy as np
import pytest

from gradlane.policies.sim.network import Network

CAP = np.array([100.0, 100.0, 100.0])  # bit/s, three links


def _add(net: Network, cid: int, links: list[int], flows: list[float], bits: float,
         prio: int = 0, queue: int = 0, key: tuple[int, ...] = ()) -> None:
    net.add(cid, np.array(links, np.int64), np.array(flows), bits, prio, queue, key=key)


def _rates(net: Network) -> dict[tuple[int, int], float]:
    """(collective, link) -> rate, for the entries that move."""
    s = net.served()
    return {(int(net.owner[i]), int(net.link[i])): float(r)
            for i, r in zip(s.at.tolist(), s.rate.tolist(), strict=True)}


def test_a_higher_priority_takes_a_link_and_the_lower_one_moves_on_its_others() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [1], 50.0, prio=0, queue=0)
    _add(net, 2, [0, 1], [1, 1], 50.0, prio=1, queue=1)
    assert _rates(net) == {(1, 0): 100.0, (2, 1): 100.0}
    assert net.next_drain() == pytest.approx(0.5)
    assert net.advance(0.5) == [1]  # 2 is through link 1, not yet link 0
    assert _rates(net) == {(2, 0): 100.0}
    assert net.bits_left() == {2: pytest.approx(50.0)}
    assert net.advance(net.next_drain()) == [2]
    assert len(net) == 0 and net.next_drain() == float("inf")


def test_one_queue_serves_its_collectives_first_come_first_served_on_each_link() -> None:
    # Collective 2 arrived after 1 in the same (job, band): on link 0 it waits; on
    # link 2, which 1 does not use, it goes at once.
    net = Network(CAP)
    _add(net, 1, [0, 1], [1, 1], 100.0)
    _add(net, 2, [0, 2], [1, 1], 100.0)
    assert _rates(net) == {(1, 0): 100.0, (1, 1): 100.0, (2, 2): 100.0}
    assert net.advance(1.0) == [1]
    assert _rates(net) == {(2, 0): 100.0}
    assert net.advance(1.0) == [2]


def test_a_queue_takes_its_waiting_entries_by_key_but_never_interrupts_the_one_served() -> None:
    # As the shim's connection pops its heap: 2 and 3 wait behind 1 (being written);
    # 3, of the smaller key, goes before 2, which came first.
    net = Network(CAP)
    _add(net, 1, [0], [1], 100.0, key=(5,))
    _add(net, 2, [0], [1], 100.0, key=(4,))
    _add(net, 3, [0], [1], 100.0, key=(1,))
    assert [net.advance(1.0) for _ in range(3)] == [[1], [3], [2]]


def test_queues_at_one_priority_share_a_link_by_their_flows() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [3], 10.0, queue=0)  # 3 flows of 10 bits
    _add(net, 2, [0], [1], 10.0, queue=1)
    assert _rates(net) == {(1, 0): 75.0, (2, 0): 25.0}
    # Both drain together (30 bits at 75, 10 at 25): 0.4 s; the link carried 40 bits.
    assert net.next_drain() == pytest.approx(0.4)
    assert sorted(net.advance(0.4)) == [1, 2]
    assert net.busy_bits.tolist() == pytest.approx([40.0, 0.0, 0.0])


def test_new_priorities_reorder_a_shared_link() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [1], 100.0, prio=0, queue=0)
    _add(net, 2, [0], [1], 100.0, prio=1, queue=1)
    assert _rates(net) == {(1, 0): 100.0}
    net.set_priorities({0: 1, 1: 0})  # by queue
    assert _rates(net) == {(2, 0): 100.0}
