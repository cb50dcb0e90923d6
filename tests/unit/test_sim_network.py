"""How the simulator's links serve queued collectives (`gradlane.policies.sim.network`)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradlane.policies.sim.network import Network
from tests import examples

CAP = np.array([100.0, 100.0, 100.0])  # bit/s, three links


def _add(net: Network, cid: int, links: list[int], flows: list[float], bits: float,
         prio: int = 0, queue: int = 0, key: tuple[int, ...] = ()) -> None:
    net.add(cid, links, [float(f) for f in flows], bits, prio, queue, key=key)


def test_a_higher_priority_takes_a_link_and_the_lower_one_moves_on_its_others() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [1], 50.0, prio=0, queue=0)
    _add(net, 2, [0, 1], [1, 1], 50.0, prio=1, queue=1)
    assert net.rates() == {(1, 0): 100.0, (2, 1): 100.0}
    assert net.next_finish() == pytest.approx(0.5)
    assert net.advance_to(0.5) == [1]  # 2 is through link 1, not yet link 0
    assert net.rates() == {(2, 0): 100.0}
    assert net.bits_left() == {2: pytest.approx(50.0)}
    assert net.advance_to(net.next_finish()) == [2]
    assert len(net) == 0 and net.next_finish() == float("inf")


def test_one_queue_serves_its_collectives_first_come_first_served_on_each_link() -> None:
    # Collective 2 arrived after 1 in the same (job, band): on link 0 it waits; on
    # link 2, which 1 does not use, it goes at once.
    net = Network(CAP)
    _add(net, 1, [0, 1], [1, 1], 100.0)
    _add(net, 2, [0, 2], [1, 1], 100.0)
    assert net.rates() == {(1, 0): 100.0, (1, 1): 100.0, (2, 2): 100.0}
    assert net.advance_to(1.0) == [1]
    assert net.rates() == {(2, 0): 100.0}
    assert net.advance_to(2.0) == [2]


def test_bits_left_count_a_collective_s_waiting_entries_until_each_is_served() -> None:
    """Collective 2 waits behind 1 on two links, and takes its place on each as 1 finishes
    there: its bits left are its first entries' and its waiting ones', each counted once,
    and nothing once it is done."""
    net = Network(CAP)
    _add(net, 1, [0, 1], [1, 2], 100.0)  # 100 bits on link 0 (1 s), 200 on link 1 (2 s)
    _add(net, 2, [0, 1], [1, 1], 150.0)  # behind it on both
    assert net.bits_left() == {1: pytest.approx(300.0), 2: pytest.approx(300.0)}
    assert net.advance_to(1.0) == []  # 1 through link 0: 2 served there, waiting on link 1
    assert net.bits_left() == {1: pytest.approx(100.0), 2: pytest.approx(300.0)}
    assert net.advance_to(2.0) == [1]
    assert net.bits_left() == {2: pytest.approx(200.0)}  # 50 of 150 on link 0; none on 1
    assert net.advance_to(2.5) == [] and net.next_finish() == pytest.approx(3.5)
    assert net.advance_to(3.5) == [2]
    assert net.bits_left() == {} and len(net) == 0


def test_a_queue_takes_its_waiting_entries_by_key_but_never_interrupts_the_one_served() -> None:
    # As the shim's connection pops its heap: 2 and 3 wait behind 1 (being written);
    # 3, of the smaller key, goes before 2, which came first.
    net = Network(CAP)
    _add(net, 1, [0], [1], 100.0, key=(5,))
    _add(net, 2, [0], [1], 100.0, key=(4,))
    _add(net, 3, [0], [1], 100.0, key=(1,))
    assert [net.advance_to(t) for t in (1.0, 2.0, 3.0)] == [[1], [3], [2]]


def test_queues_at_one_priority_share_a_link_by_their_flows() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [3], 10.0, queue=0)  # 3 flows of 10 bits
    _add(net, 2, [0], [1], 10.0, queue=1)
    assert net.rates() == {(1, 0): 75.0, (2, 0): 25.0}
    # Both drain together (30 bits at 75, 10 at 25): 0.4 s; the link carried 40 bits.
    assert net.next_finish() == pytest.approx(0.4)
    assert sorted(net.advance_to(0.4)) == [1, 2]
    assert net.carried_bits().tolist() == pytest.approx([40.0, 0.0, 0.0])


def test_new_priorities_reorder_a_shared_link() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [1], 100.0, prio=0, queue=0)
    _add(net, 2, [0], [1], 100.0, prio=1, queue=1)
    assert net.rates() == {(1, 0): 100.0}
    net.set_priorities({0: 1, 1: 0})  # by queue
    assert net.rates() == {(2, 0): 100.0}


def test_a_collective_arriving_mid_flight_shares_the_link_from_then_on() -> None:
    net = Network(CAP)
    _add(net, 1, [0], [1], 100.0, queue=0)
    assert net.next_finish() == pytest.approx(1.0)
    assert net.advance_to(0.5) == []
    _add(net, 2, [0], [1], 25.0, queue=1)  # half the link each: 2 done at 1.0
    assert net.rates() == {(1, 0): 50.0, (2, 0): 50.0}
    assert net.bits_left() == {1: pytest.approx(50.0), 2: pytest.approx(25.0)}
    assert net.advance_to(net.next_finish()) == [2]
    assert net.t == pytest.approx(1.0)
    # 1 has 25 bits left and the link to itself again.
    assert net.rates() == {(1, 0): 100.0}
    assert net.advance_to(net.next_finish()) == [1]
    assert net.t == pytest.approx(1.25)
    assert net.carried_bits().tolist() == pytest.approx([125.0, 0.0, 0.0])


@settings(max_examples=examples(200), deadline=None)
# Entries a hundred-thousandth of a bit over a whole number: their last bits are real (an
# absolute residue of 1e-3 bits once dropped them, uncounted, and ended them early).
@example([(0.0, [0], 1, 1.00001, 0, 0), (0.0, [0, 1], 1, 1.0, 0, 0)])
@example([(0.0, [0], 1, 2.00001, 0, 0), (0.0, [0], 1, 1.0, 0, 0), (0.0, [0], 1, 6.0, 0, 0),
          (0.02, [0], 1, 1.0, 0, 0)])
@given(st.lists(st.tuples(st.floats(0.0, 2.0), st.lists(st.integers(0, 2), min_size=1,
                                                         max_size=3, unique=True),
                          st.integers(1, 3), st.floats(1.0, 100.0), st.integers(0, 2),
                          st.integers(0, 3)),
                min_size=1, max_size=12))
def test_every_bit_queued_crosses_its_links_and_every_collective_ends_once(
        adds: list[tuple[float, list[int], int, float, int, int]]) -> None:
    """Collectives arrive at random times on random links, queues and priorities: each
    link carries exactly the bits put on it, never faster than its capacity, and each
    collective is reported done once, after its last bit."""
    net = Network(CAP)
    adds = sorted(adds, key=lambda a: a[0])
    put = np.zeros(len(CAP))
    done: list[int] = []
    for cid, (t, links, flows, bits, prio, queue) in enumerate(adds):
        while net.next_finish() <= t:
            done += net.advance_to(net.next_finish())
        done += net.advance_to(t)
        _add(net, cid, links, [flows] * len(links), bits, prio=prio, queue=queue)
        put[links] += flows * bits
    for _ in range(100 * len(adds)):
        if not len(net):
            break
        done += net.advance_to(net.next_finish())
    assert sorted(done) == list(range(len(adds)))
    assert net.carried_bits() == pytest.approx(put)
    # Work-conserving at capacity: the run took at least the busiest link's bits over its rate.
    assert net.t >= (put / CAP).max() * (1 - 1e-9)
