"""Table-driven tests of each policy's algorithm, on small hand-made states."""

import dataclasses
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from gradlane.errors import ConfigError
from gradlane.policies import (
    Coflow,
    FlowTable,
    Host,
    JobClassPlan,
    JobState,
    Plan,
    Policy,
    State,
    Topology,
    Worker,
    check_plan,
    get_policy,
    loadbalance,
)
from gradlane.policies.chunks import assign_owners
from gradlane.policies.coflow import bssi_order, levels
from gradlane.policies.demand import Exchange
from gradlane.policies.fifo import FairPolicy
from gradlane.policies.loadbalance import (
    _shares,
    exchange_time,
    flat_shares,
    host_loads,
    one_switch,
    owner_shares,
    placement_shape,
)
from gradlane.policies.priority import flow_bands
from gradlane.policies.straggler import critical_first, proportional_shares, throughput_shares
from tests import examples

G = 1_000_000_000


def test_fair_splits_the_guaranteed_rate_and_lets_every_job_borrow() -> None:
    state = State(shaped_bps=1000, other_bps=100, jobs=(JobState("a", 1, 4), JobState("b", 2, 8)))
    plan = get_policy("fair").plan(state)
    assert plan.source == "fair"
    assert {n: (c.rate_bps, c.ceil_bps, c.prio) for n, c in plan.job_classes.items()} == {
        "a": (450, 1000, 0),
        "b": (450, 1000, 0),
    }
    assert plan.to_wire() == get_policy("fair").plan(state).to_wire()  # deterministic
    assert get_policy("fair").plan(State(1000, 100, ())).job_classes == {}


@pytest.mark.parametrize("name", ["fifo", "fair", "priority", "coflow", "loadbalance",
                                  "straggler", "gradlane"])
def test_every_policy_gives_a_daemon_a_valid_local_plan(name: str) -> None:
    state = State(shaped_bps=10 * G, other_bps=G, jobs=(JobState("a", 1, 4), JobState("b", 2, 8)))
    plan = get_policy(name).plan(state)
    assert check_plan(state, plan) == []
    assert set(plan.job_classes) == {"a", "b"}


def test_unknown_policy_is_an_error_not_a_default() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'.*fair"):
        get_policy("nope")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        get_policy("no.such.module:Policy")
    with pytest.raises(ConfigError, match="not a gradlane.policies.Policy"):
        get_policy("gradlane.policies.base:State")


def test_a_third_party_policy_that_cannot_be_had_is_a_config_error_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon or control plane given a bad --policy says what is wrong with it, never a
    traceback: a malformed name, a module whose own code fails as it is imported, a class
    that needs arguments."""
    (tmp_path / "gl_broken_policy.py").write_text("raise RuntimeError('no licence server')\n")
    (tmp_path / "gl_needy_policy.py").write_text(
        "from gradlane.policies.fifo import FairPolicy\n"
        "class Needy(FairPolicy):\n"
        "    def __init__(self, weights):\n"
        "        super().__init__()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (":", ".relative:Policy", "gradlane.policies.fifo:", "a b:C"):
        with pytest.raises(ConfigError, match=f"^policy '{re.escape(name)}': a third-party "
                                              "one is named 'package.module:Class'$"):
            get_policy(name)
    with pytest.raises(ConfigError, match=r"^policy 'gl_broken_policy:P' cannot be loaded: "
                                          r"importing gl_broken_policy raised RuntimeError: "
                                          r"no licence server$"):
        get_policy("gl_broken_policy:P")
    with pytest.raises(ConfigError, match=r"^policy 'gl_needy_policy:Needy' cannot be made "
                                          r"without arguments: TypeError: "):
        get_policy("gl_needy_policy:Needy")


def test_third_party_policy_by_module_path() -> None:
    policy = get_policy("gradlane.policies.fifo:FairPolicy")
    assert isinstance(policy, FairPolicy) and isinstance(policy, Policy)


def _two_jobs_on_one_link() -> State:
    """Jobs 'big' and 'small' each send one flow across the same 1 Gbit/s egress."""
    topo = Topology(tuple(Host(f"h{i}", 0, G) for i in range(3)))
    flows = FlowTable.build([
        (0, 1, 100e6, 0.0, 0, 0, 0),  # big: 100 MB
        (0, 2, 10e6, 0.0, 0, 1, 0),   # small: 10 MB
    ])
    return State(
        jobs=(JobState("big", 2, chunk_bytes=(100,)), JobState("small", 2, chunk_bytes=(10,))),
        topology=topo,
        workers=(Worker("big", 0, 0), Worker("big", 1, 1), Worker("small", 0, 0),
                 Worker("small", 1, 2)),
        coflows=(Coflow("big/1", "big"), Coflow("small/1", "small")),
        flows=flows,
    )


def test_coflow_loads_are_seconds_and_madd_gives_nothing_where_nothing_can_move() -> None:
    from gradlane.policies import fabric

    state = _two_jobs_on_one_link()
    links = state.flow_links
    load = fabric.per_coflow_link_load(state, links)
    # 100 MB and 10 MB at 1 Gbit/s, on the sender's egress and the receiver's ingress.
    assert load.max(axis=1) == pytest.approx([0.8, 0.08])
    assert (load > 0).sum(axis=1).tolist() == [2, 2]
    cap = state.topology.capacity_bps  # type: ignore[union-attr]
    both = np.arange(2)
    assert fabric.madd(links, state.flows.bytes, cap, both) == pytest.approx([G / 11 * 10,
                                                                              G / 11])
    # Links already full, or flows of no bytes: no rate (not infinite, not NaN).
    assert fabric.madd(links, state.flows.bytes, np.zeros_like(cap), both).tolist() == [0, 0]
    assert fabric.madd(links, np.zeros(2), cap, both).tolist() == [0, 0]
    # A link it does not cross full (big's receiver's ingress): small alone, 10 MB in
    # 0.08 s on its own links, the whole 1 Gbit/s (not held to a second, nor to nothing).
    busy = cap.copy()
    busy[3 + 1] = 0.0
    assert fabric.madd(links, state.flows.bytes, busy, np.array([1])) == pytest.approx([G])


def test_coflow_serves_the_smaller_coflow_first_with_madd_rates() -> None:
    state = _two_jobs_on_one_link()
    plan = get_policy("coflow").plan(state)
    assert check_plan(state, plan) == []
    assert plan.coflow_order == ("small/1", "big/1")
    assert plan.job_level == {"small": 0, "big": 1}
    # MADD gives 'small' the whole bottleneck; nothing is left for 'big' on it.
    assert plan.flow_rate_bps[1] == pytest.approx(G)
    assert plan.flow_rate_bps[0] == pytest.approx(0.0, abs=1.0)
    fair = get_policy("fair").plan(state)
    assert fair.flow_rate_bps.tolist() == pytest.approx([G / 2, G / 2])
    for name in ("fifo", "fair", "priority"):  # no order across jobs: all at the first level
        plain = get_policy(name).plan(state)
        assert plain.job_level == {"big": 0, "small": 0}
        assert {c.prio for classes in plain.host_classes.values() for c in classes.values()
                } == {0}


def test_bssi_puts_the_coflow_heaviest_on_the_bottleneck_last() -> None:
    # Port 0 is the bottleneck; coflow 1 loads it most, so it goes last.
    load = np.array([[1.0, 0.0], [5.0, 1.0], [2.0, 4.0]])
    assert bssi_order(load) == [0, 2, 1]
    assert bssi_order(np.zeros((3, 2))) == [0, 1, 2]


def _bssi_dense(load: np.ndarray, weights: np.ndarray | None = None) -> list[int]:
    """BSSI summing the whole matrix of the coflows left at each step: what `bssi_order`
    did before it summed the nonzeros alone."""
    k = load.shape[0]
    w = np.ones(k) if weights is None else weights.astype(np.float64).copy()
    left, order = list(range(k)), []
    while left:
        on_port = load[left][:, int(np.argmax(load[left].sum(axis=0)))]
        if on_port.max() <= 0:
            order.extend(reversed(left))
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(on_port > 0, w[left] / on_port, np.inf)
        last_pos = int(np.argmin(ratio))
        w[left] = w[left] - w[left[last_pos]] * on_port / on_port[last_pos]
        order.append(left.pop(last_pos))
    return order[::-1]


@given(st.integers(1, 12).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.2, 0.3, 1 / 3, 1.0, 2.5])
                      | st.floats(1e-6, 10), min_size=5, max_size=5), min_size=k, max_size=k),
    st.none() | st.lists(st.floats(0.5, 4), min_size=k, max_size=k))))
def test_bssi_from_the_nonzeros_orders_as_from_the_whole_matrix(
        case: tuple[list[list[float]], list[float] | None]) -> None:
    # Ties between ports' sums are common (symmetric jobs): the sums must match to the bit.
    load = np.array(case[0])
    weights = None if case[1] is None else np.array(case[1])
    assert bssi_order(load, weights) == _bssi_dense(load, weights)


def _total_completion(load: np.ndarray, order: list[int]) -> float:
    """Each port serving the coflows in `order`, one after another: the sum of the times
    their last port is done."""
    done, total = np.zeros(load.shape[1]), 0.0
    for k in order:
        done += load[k]
        total += done[load[k] > 0].max()
    return total


def test_bssi_lowers_the_weights_of_coflows_sharing_the_bottleneck_with_the_last() -> None:
    # Port 0 (4 s) first: coflows 1 and 2 tie (1 / 2 s); 1, the first, goes last, and
    # coflow 2, as loaded on port 0, has its weight lowered by all of 1's: to 0. Then port
    # 1 (3 s): coflow 2 (0 / 2 s) before coflow 0 (1 / 1 s) goes last: 0, 2, 1, done at
    # 1, 3 and 4 s. Weights left alone, or raised, would put coflow 0 last of the two (1 /
    # 1 s against 1 / 2 s): 2, 0, 1, done at 2, 3 and 4 s. (The best order, 0, 1, 2, takes
    # 7 s in all: BSSI is a 4-approximation.)
    load = np.array([[0.0, 1.0], [2.0, 0.0], [2.0, 2.0]])
    assert bssi_order(load) == [0, 2, 1]
    assert _total_completion(load, [0, 2, 1]) == 8.0 < _total_completion(load, [2, 0, 1])
    # By its load over the last's: port 0 (3 s, tied with port 1, the first) puts coflow 2
    # last (1 / 2 s) and lowers coflow 1's weight by 1 s / 2 s, to 0.5. On port 1 coflows 0
    # (1 / 2 s) and 1 (0.5 / 1 s) then tie, and 0 goes last: 1, 0, 2, done at 1, 3 and 3
    # s. Lowered by 1 s x 2 s instead, coflow 1 would go last: 0, 1, 2, at 2, 3 and 3 s.
    load = np.array([[0.0, 2.0], [1.0, 1.0], [2.0, 0.0]])
    assert bssi_order(load) == [1, 0, 2]
    assert _total_completion(load, [1, 0, 2]) == 7.0 < _total_completion(load, [0, 1, 2])
    # A coflow with nothing on the bottleneck is never put last there, even at weight 0:
    # port 0 (4 s) puts coflow 1 last and lowers coflow 2's weight to 0; on port 1 (3 s)
    # coflow 2 has nothing, so coflow 0 goes last there (0 / 0 is no ratio): 2, 0, 1.
    load = np.array([[0.0, 3.0], [2.0, 0.0], [2.0, 0.0]])
    assert bssi_order(load) == [2, 0, 1]


def test_coflows_that_waited_many_times_their_length_move_up() -> None:
    """HRRN's weight, 1 + age / own bottleneck time: the 4 s coflow behind a 1 s one goes
    first once it has waited more than three times its length (weight above 4)."""
    topo = Topology(tuple(Host(f"h{i}") for i in range(2)))  # 10 Gbit/s: 1.25 GB a second
    flows = FlowTable.build([(0, 1, 1.25e9, 0.0, 0, 0, 0), (0, 1, 5e9, 0.0, 0, 1, 0)])
    state = State(jobs=(JobState("big", 2), JobState("small", 2)), topology=topo,
                  workers=tuple(Worker(j, r, r) for j in ("big", "small") for r in range(2)),
                  coflows=(Coflow("small/1", "small"), Coflow("big/1", "big")), flows=flows)

    def order(big_age_s: float) -> tuple[str, ...]:
        aged = (state.coflows[0], Coflow("big/1", "big", age_s=big_age_s))
        return get_policy("coflow").plan(replace(state, coflows=aged)).coflow_order

    assert order(0.0) == order(4.0) == ("small/1", "big/1")  # weights 1 and 2: 2 / 4 s < 1
    assert order(20.0) == ("big/1", "small/1")  # weight 6: 6 / 4 s > 1 / 1 s


def test_levels_keep_the_order_on_eight_levels() -> None:
    assert levels(3) == [0, 1, 2]
    many = levels(20)
    assert many[0] == 0 and many[-1] == 7 and many == sorted(many)


def test_priority_bands_follow_forward_order() -> None:
    topo = Topology(tuple(Host(f"h{i}") for i in range(2)))
    flows = FlowTable.build([(0, 1, 1e6, 0.0, p, 0, p) for p in range(8)])
    state = State(jobs=(JobState("j", 2, chunk_bytes=(1,) * 8),), topology=topo,
                  workers=(Worker("j", 0, 0), Worker("j", 1, 1)),
                  coflows=(Coflow("j/1", "j"),), flows=flows)
    plan = get_policy("priority").plan(state)
    assert plan.flow_band.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # Band 0 is served first on the shared egress: it gets the link, later bands get 0.
    assert plan.flow_rate_bps[:2].sum() == pytest.approx(10 * G)
    assert check_plan(state, plan) == []


def test_priority_bands_scale_each_job_s_priorities_as_its_shim_does() -> None:
    """`band_of` of each flow's priority among its job's: its `layers`, else its chunks,
    else as many as its flows name."""
    topo = Topology(tuple(Host(f"h{i}") for i in range(2)))
    jobs = (JobState("deep", 2, chunk_bytes=(1,) * 4, layers=16),  # 4 chunks of 16 layers
            JobState("four", 2, chunk_bytes=(1,) * 4), JobState("told", 2))
    # "four" has flows of its first two chunks only: its bands still count all four
    rows = ([(0, 1, 1e6, 0.0, p, 0, p) for p in range(4)] + [(0, 1, 1e6, 0.0, p, 1, p)
            for p in range(2)] + [(0, 1, 1e6, 0.0, p, 2, -1) for p in range(6)])
    state = State(jobs=jobs, topology=topo,
                  workers=tuple(Worker(j.name, r, r) for j in jobs for r in range(2)),
                  coflows=tuple(Coflow(f"{j.name}/1", j.name) for j in jobs),
                  flows=FlowTable.build(rows), bands=4)
    assert flow_bands(state).tolist() == [0, 0, 0, 0] + [0, 1] + [0, 0, 1, 2, 2, 3]


def test_loadbalance_gives_a_faster_link_more_chunks() -> None:
    rates = (3 * G, 2 * G, 2 * G, G)
    topo = Topology(tuple(Host(f"h{i}", 0, r) for i, r in enumerate(rates)))
    state = State(jobs=(JobState("j", 3, chunk_bytes=(1,) * 400),), topology=topo,
                  workers=tuple(Worker("j", i, i) for i in range(4)))
    owners = get_policy("loadbalance").plan(state).ownership["j"]
    # flat_shares: the 1 G link needs S / G alone, more than T = 5/7 S / G of the other
    # three with shares (T r - S) / (W - 2): 8/14, 3/14 and 3/14 of S. Shares following the
    # rates (3/8, 2/8, 2/8, 1/8) would leave the 1 G link at 1.25 S / G.
    assert [owners.count(i) for i in range(4)] == pytest.approx([229, 86, 86, 0], abs=1)
    assert get_policy("fifo").plan(state).ownership["j"].count(0) == 100


def test_loadbalance_gives_a_ring_s_slow_link_more_chunks() -> None:
    """On the ring, a rank's own chunks skip its links: the slow one should own them."""
    topo = Topology(tuple(Host(f"h{i}", 0, r) for i, r in enumerate((G, G, G, G // 2))))
    job = JobState("j", 4, chunk_bytes=(1,) * 400, ring=True)
    state = State(jobs=(job,), topology=topo, workers=tuple(Worker("j", i, i) for i in range(4)))
    owners = get_policy("loadbalance").plan(state).ownership["j"]
    assert [owners.count(i) for i in range(4)] == [0, 0, 0, 400]
    even = Topology(tuple(Host(f"h{i}", 0, G) for i in range(4)))
    owners = get_policy("loadbalance").plan(replace(state, topology=even)).ownership["j"]
    assert [owners.count(i) for i in range(4)] == [100] * 4


def test_jobs_placed_alike_share_one_solution_of_their_owner_shares() -> None:
    """Four jobs, each two ranks on each of two hosts (a linear programme's case), on
    hosts numbered apart: one solve for all four; a fifth placed otherwise, another."""
    topo = Topology(tuple(Host(f"h{i}", i // 4, G) for i in range(10)))
    jobs = tuple(JobState(f"j{k}", 4, chunk_bytes=(1,) * 64) for k in range(5))
    placed = [(0, 0, 1, 1), (2, 2, 3, 3), (4, 4, 5, 5), (6, 6, 7, 7), (8, 9, 9, 9)]
    workers = tuple(Worker(f"j{k}", r, h) for k, hosts in enumerate(placed)
                    for r, h in enumerate(hosts))
    _shares.cache_clear()
    plan = get_policy("loadbalance").plan(State(jobs=jobs, topology=topo, workers=workers))
    assert _shares.cache_info().misses == 2
    assert len({plan.ownership[f"j{k}"] for k in range(4)}) == 1  # same shape, same owners
    assert plan.ownership["j4"] != plan.ownership["j0"]


def test_loadbalance_gives_the_ends_of_co_located_runs_the_chunks_on_the_ring() -> None:
    """Ranks 0-3 on one host, 4-7 on another: only ranks 3 -> 4 and 7 -> 0 cross a NIC,
    and a chunk owned at either end of a crossing skips it one way."""
    topo = Topology((Host("a", 0, G), Host("b", 0, G)))
    job = JobState("j", 8, chunk_bytes=(1,) * 400, ring=True)
    state = State(jobs=(job,), topology=topo,
                  workers=tuple(Worker("j", i, i // 4) for i in range(8)))
    owners = get_policy("loadbalance").plan(state).ownership["j"]
    assert [owners.count(i) for i in range(8)] == [100, 0, 0, 100, 100, 0, 0, 100]
    loads, rates = Exchange(np.zeros(8), uplinks=False, host=[0] * 4 + [1] * 4,
                            ring=True).link_loads(in_leaf=False), np.full(4, float(G))
    # Each host's link carries 1.5 models each way, where ring all-reduce's equal shares
    # leave 1.75 (2 (W - 1) / W).
    assert exchange_time(loads, rates, [owners.count(i) / 400 for i in range(8)]) * G == (
        pytest.approx(1.5, rel=1e-5))
    assert exchange_time(loads, rates, [1 / 8] * 8) * G == pytest.approx(1.75)


def test_loadbalance_owners_follow_how_ranks_sharing_a_host_exchange() -> None:
    """Ranks 0 and 1 on host a, rank 2 on host b, equal links. Flat: host b's link
    carries its gradient of the others' chunks (1 - o2) and the results of its own
    to both (2 o2) each way, host a's the same: 1 + o2, so rank 2 owns nothing.
    Within hosts first: one copy a host crosses each way, 1 whoever owns, and the
    most even shares are taken."""
    topo = Topology((Host("a", 0, G), Host("b", 0, G)))
    workers = tuple(Worker("j", r, h) for r, h in enumerate((0, 0, 1)))
    counts = {}
    for by_host in (False, True):
        job = JobState("j", 3, chunk_bytes=(1,) * 300, by_host=by_host)
        owners = get_policy("loadbalance").plan(
            State(jobs=(job,), topology=topo, workers=workers)).ownership["j"]
        counts[by_host] = [owners.count(r) for r in range(3)]
    assert counts == {False: [150, 150, 0], True: [100, 100, 100]}


def test_loadbalance_owners_reduced_within_leaves_first_when_the_spine_is_short() -> None:
    """Two leaves of two hosts, uplinks oversubscribed, host 3 at twice the rate. Within
    leaves first, a chunk owned in a leaf's first host puts 2 on each first host's link
    and 1 on each second's (they relay for their leaf), and the other way round: hosts 0
    and 1 carry 3 between them whoever owns, 1.5 at best, which even shares reach. The
    flat exchange's shares (0.1, 0.1, 0.1, 0.7: `flat_shares`) would leave host 1 at 1.8."""
    topo = Topology((Host("a", 0, G), Host("b", 0, G), Host("c", 1, G), Host("d", 1, 2 * G)),
                    uplink_bps=(G, G))
    job = JobState("j", 3, chunk_bytes=(1,) * 400)
    state = State(jobs=(job,), topology=topo, workers=tuple(Worker("j", r, r) for r in range(4)))
    plan = get_policy("loadbalance").plan(state)
    assert plan.reduce_in_leaf
    owners = plan.ownership["j"]
    shares = [owners.count(r) / 400 for r in range(4)]
    assert shares == [0.25] * 4
    loads = Exchange([0, 0, 1, 1], uplinks=True).link_loads(in_leaf=True)
    rates = np.array([1.0, 1.0, 1.0, 2.0] * 2)
    assert exchange_time(loads, rates, shares) == pytest.approx(1.5)
    assert exchange_time(loads, rates, flat_shares([1.0, 1.0, 1.0, 2.0])) == pytest.approx(1.8)


def test_loadbalance_counts_what_other_jobs_leave_of_a_shared_nic() -> None:
    """Job j's ranks on three hosts of equal NICs, job k's on the third: j has half of
    that one. Flat, `flat_shares` with rates 1, 1, 1/2: the slow link alone carries the
    model in 2 S / G, more than the T = 1.5 S / G of the other two with shares 1/2 each,
    so the rank there owns nothing (alone, the three would own a third each)."""
    topo = Topology(tuple(Host(f"h{i}", 0, G) for i in range(3)))
    j = JobState("j", 3, chunk_bytes=(1,) * 300)
    workers = tuple(Worker("j", r, r) for r in range(3))
    alone = get_policy("loadbalance").plan(State(jobs=(j,), topology=topo, workers=workers))
    assert [alone.ownership["j"].count(r) for r in range(3)] == [100, 100, 100]
    shared = State(jobs=(j, JobState("k", 4, chunk_bytes=(1,) * 8)), topology=topo,
                   workers=(*workers, Worker("k", 0, 2)))
    owners = get_policy("loadbalance").plan(shared).ownership["j"]
    assert [owners.count(r) for r in range(3)] == [150, 150, 0]


def test_loadbalance_plans_owners_only_for_jobs_with_workers_and_chunks() -> None:
    topo = Topology(tuple(Host(f"h{i}", 0, G * (i + 1)) for i in range(2)))
    jobs = (JobState("no-chunks", 1), JobState("no-workers", 2, chunk_bytes=(1,) * 4),
            JobState("both", 3, chunk_bytes=(1,) * 4))
    workers = (Worker("no-chunks", 0, 0), Worker("both", 0, 0), Worker("both", 1, 1))
    plan = get_policy("loadbalance").plan(State(jobs=jobs, topology=topo, workers=workers))
    assert set(plan.ownership) == {"both"}


@pytest.mark.parametrize("rates", [[1.0, 0.0, 2.0], [1.0, -1.0], [], [1.0, float("nan")]])
def test_owner_shares_refuse_links_that_cannot_carry_anything(rates: list[float]) -> None:
    with pytest.raises(ConfigError, match="positive rates"):
        flat_shares(rates)
    if rates:
        loads, link_rates = one_switch([1.0] * len(rates), ring=False)
        with pytest.raises(ConfigError, match="positive rates"):
            owner_shares(loads, np.array(rates * 2))
    with pytest.raises(ConfigError, match="one per link"):
        owner_shares(*one_switch([1.0, 2.0], ring=False)[:1], np.ones(3))


def test_link_loads_keep_co_located_ranks_off_the_nic() -> None:
    # Ring of 4 ranks, 0 and 1 on host 0: a chunk owned by 1 skips 1 -> 2 going round
    # (host 0's egress, host 1's ingress) and its average skips 0 -> 1 (loopback).
    loads = Exchange(np.zeros(4), uplinks=False, host=[0, 0, 1, 2],
                     ring=True).link_loads(in_leaf=False)
    # Columns: egress of hosts 0, 1, 2, then their ingress.
    assert loads[1].tolist() == [1, 2, 2, 2, 1, 2]
    # Flat, owner 0: rank 1's gradient and result stay on host 0; ranks 2 and 3 send one
    # each and take one back.
    loads = Exchange(np.zeros(4), uplinks=False, host=[0, 0, 1, 2]).link_loads(in_leaf=False)
    assert loads[0].tolist() == [2, 1, 1, 2, 1, 1]


placements = st.integers(3, 5).flatmap(lambda world: st.tuples(
    st.lists(st.integers(0, 2), min_size=world, max_size=world),
    st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0]), min_size=3, max_size=3), st.booleans()))


@settings(max_examples=examples(40), deadline=None)
@given(placements)
def test_owner_shares_finish_no_later_than_any_shares_on_a_grid(
    placement: tuple[list[int], list[float], bool],
) -> None:
    hosts, host_rates, ring = placement
    used = sorted(set(hosts))
    loads = Exchange(np.zeros(len(hosts)), uplinks=False, host=hosts,
                     ring=ring).link_loads(in_leaf=False)
    rates = np.array([host_rates[h] for h in used] * 2)
    shares = owner_shares(loads, rates)
    assert sum(shares) == pytest.approx(1) and min(shares) >= 0
    world, steps = len(hosts), 12
    grid = np.array([[*parts, steps - sum(parts)]
                     for parts in itertools.product(range(steps + 1), repeat=world - 1)
                     if sum(parts) <= steps]) / steps
    best_on_grid = (grid @ loads / rates).max(axis=1).min()
    assert exchange_time(loads, rates, shares) <= best_on_grid * (1 + 1e-5)
    # Ranks loading the links alike (ranks of one host here) are one class: one share each.
    for a, b in itertools.combinations(range(world), 2):
        if np.array_equal(loads[a], loads[b]):
            assert shares[a] == pytest.approx(shares[b])


@pytest.mark.parametrize("kind", ["flat", "host", "ring"])
def test_owner_shares_of_equal_links_and_hosts_alike_are_even_without_solving(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Four hosts of two ranks at one rate: every owner's chunk puts as much on the links
    # in all, and even shares load every link for as long: nothing can do better.
    hosts = [0, 0, 1, 1, 2, 2, 3, 3]
    loads = Exchange(np.zeros(8), uplinks=False, host=hosts, ring=kind == "ring",
                     by_host=kind == "host").link_loads(in_leaf=kind == "host")
    solved, solver = owner_shares(loads, np.ones(8)), loadbalance._linprog()
    monkeypatch.setattr(loadbalance, "_linprog", lambda: pytest.fail("solved"))
    assert owner_shares(loads, np.ones(8)) == [1 / 8] * 8 == pytest.approx(solved)
    # One host's links faster: the programme is solved, and (but on the ring, whose
    # slow links carry as much whoever owns) its shares beat even ones.
    rates = np.array([2.0, 1, 1, 1] * 2)
    calls: list[int] = []
    monkeypatch.setattr(loadbalance, "_linprog", lambda: calls.append(1) or solver)
    shares = owner_shares(loads, rates)
    assert calls
    even = exchange_time(loads, rates, [1 / 8] * 8)
    assert exchange_time(loads, rates, shares) <= even * (1 + 1e-9)
    if kind != "ring":
        assert exchange_time(loads, rates, shares) < even


def test_owner_shares_spread_ties_over_ranks_not_over_classes_of_ranks() -> None:
    # Ranks 0-2 load both links, rank 3 the first only: any shares take the first link
    # a whole model's time. The most even shares are a quarter each, whichever class a
    # rank is of (a half to each class would give rank 3 half of the bytes).
    loads = np.array([[1.0, 1.0]] * 3 + [[1.0, 0.0]])
    assert owner_shares(loads, np.ones(2)) == pytest.approx([0.25] * 4)


@st.composite
def numbered_placements(draw: st.DrawFn) -> tuple[list[int], list[int], list[float]]:
    """Ranks on hosts with numbers anywhere in a large cluster (some sharing a host),
    each host's leaf, and the used hosts' links in host order."""
    used = sorted(draw(st.sets(st.integers(0, 4095), min_size=1, max_size=4)))
    leaf_of = {h: draw(st.integers(0, 127)) for h in used}
    hosts = draw(st.lists(st.sampled_from(used), min_size=2, max_size=6))
    rates = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in sorted(set(hosts))]
    return hosts, [leaf_of[h] for h in hosts], rates


@settings(max_examples=examples(60), deadline=None)
@given(numbered_placements(), st.booleans(), st.sampled_from(["flat", "leaf", "host", "ring"]))
def test_owner_shares_depend_on_the_placement_s_shape_not_its_numbers(
    placement: tuple[list[int], list[int], list[float]], uplinks: bool, kind: str,
) -> None:
    """`job_shares` solves for `placement_shape`s (jobs placed alike share a solution):
    the same shares as the hosts' and leaves' own numbers give."""
    hosts, leaves, rates = placement
    solve = _shares.__wrapped__  # not the cache: each side solved for itself
    as_numbered = solve(tuple(hosts), tuple(leaves), uplinks, kind, tuple(rates))
    shaped = solve(placement_shape(hosts), placement_shape(leaves), uplinks, kind, tuple(rates))
    assert shaped == as_numbered


@settings(max_examples=examples(80), deadline=None)
@given(numbered_placements(), st.booleans(), st.sampled_from(["flat", "host"]))
# Host 0 (two ranks at half the rate) is the slowest with no share: ties, spread evenly.
@example(([0, 0, 1, 1, 2], [0, 0, 0, 0, 0], [0.5, 1.0, 0.5]), False, "flat")
@example(([0, 0, 1, 2, 3], [0] * 5, [1.0, 1.0, 3.0, 0.25]), False, "host")
# As many ranks on each host, two rates: the slow host owns less (not the even shares
# that one rate would give).
@example(([0, 0, 1, 1, 2, 2], [0] * 6, [0.5, 1.0, 1.0]), False, "host")
def test_host_loads_are_every_rank_s_link_loads_and_give_its_shares(
    placement: tuple[list[int], list[int], list[float]], uplinks: bool, kind: str,
) -> None:
    """Flat or within hosts first, `job_shares` weighs hosts, their loads in closed form
    (`host_loads`): the link loads of each of their ranks' trees; and its shares (in
    closed form too, by water-filling, where it can) are those the linear programmes
    give every rank's own rows, to their tolerance, and finish no later. (One rank a
    host has closed forms of its own.)"""
    hosts, leaves, rates = placement
    exchange = Exchange(leaves, uplinks=uplinks, host=hosts, by_host=kind == "host")
    every = exchange.link_loads(in_leaf=kind == "host")
    _, of_host, count = np.unique(hosts, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(host_loads(kind, count)[of_host.reshape(-1)], every)
    assume(len(set(hosts)) < len(hosts))
    solve = _shares.__wrapped__  # not the cache
    shares = solve(tuple(hosts), tuple(leaves), uplinks, kind, tuple(rates)).each
    link_rates = np.array(rates * 2)
    solved = owner_shares(every, link_rates)
    assert shares == pytest.approx(solved, abs=1e-6)
    assert sum(shares) == pytest.approx(1)
    assert exchange_time(every, link_rates, shares) <= exchange_time(
        every, link_rates, solved) * (1 + 1e-9)


@st.composite
def runs_of_hosts(draw: st.DrawFn) -> tuple[list[int], list[int], list[float], str]:
    """Ranks numbered host by host (each host's a run, as torchrun numbers them), round
    the hosts (a cyclic launcher's, as many on each) or in any order, a few a host,
    hosts under a few leaves, each host's link (sorted host order), and which
    numbering."""
    count = draw(st.integers(2, 7))
    order = draw(st.permutations(range(count)))  # host numbers need not rise with ranks
    per_host = draw(st.lists(st.integers(1, 4), min_size=count, max_size=count))
    leaf_of = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    numbered = draw(st.sampled_from(["runs", "cyclic", "any"]))
    if numbered == "cyclic":  # as many ranks on every host
        hosts = [h for _ in range(per_host[0]) for h in order]
    else:
        hosts = [h for h, k in zip(order, per_host, strict=True) for _ in range(k)]
    if numbered == "any":
        hosts = draw(st.permutations(hosts))
    rates = draw(st.lists(st.sampled_from([0.5, 1.0, 2.5]), min_size=count, max_size=count))
    return hosts, [leaf_of[h] for h in hosts], rates, numbered


@settings(max_examples=examples(80), deadline=None)
@given(runs_of_hosts())
def test_within_leaves_a_host_s_first_rank_is_weighed_for_its_ranks(
    placement: tuple[list[int], list[int], list[float], str],
) -> None:
    """Within leaves, ranks of a host often load the links alike (`_alike_by_host`:
    always when numbered host by host or round the hosts), and `job_shares` weighs
    each host's first rank for all of them: every rank's rows give the same slowest
    link and the same largest share, and ranks of one host the same share. (Ranks
    in another order need not load alike: every rank is weighed then.)"""
    hosts, leaves, rates, numbered = placement
    assume(len(set(hosts)) < len(hosts))  # one rank a host has closed forms of its own
    every = Exchange(leaves, uplinks=True, host=hosts).link_loads(in_leaf=True)
    _, of_host, count = np.unique(hosts, return_inverse=True, return_counts=True)
    firsts = loadbalance._alike_by_host(of_host, count, leaves)
    assert firsts is not None or numbered == "any"
    alike = firsts is not None
    for h in set(hosts):
        ranks = [r for r, host in enumerate(hosts) if host == h]
        if alike:
            assert firsts[np.searchsorted(sorted(set(hosts)), h)] == ranks[0]
            np.testing.assert_array_equal(every[ranks], every[[ranks[0]] * len(ranks)])
    shares = _shares.__wrapped__(tuple(hosts), tuple(leaves), True, "leaf", tuple(rates)).each
    link_rates = np.array(rates * 2)
    solved = owner_shares(every, link_rates)
    assert sum(shares) == pytest.approx(1)
    assert exchange_time(every, link_rates, shares) == pytest.approx(  # to HiGHS' tolerance
        exchange_time(every, link_rates, solved), rel=1e-6)
    assert max(shares) == pytest.approx(max(solved), rel=1e-6)
    for a, b in itertools.combinations(range(len(hosts)), 2):
        if hosts[a] == hosts[b] and alike:
            assert shares[a] == shares[b]


@settings(max_examples=examples(80), deadline=None)
@given(runs_of_hosts(), st.data())
def test_sparse_loads_are_the_dense_ones_and_give_their_shares(
    placement: tuple[list[int], list[int], list[float], str], data: st.DataObject,
) -> None:
    """A large job's loads are weighed sparse (`Exchange.sparse_link_loads`: one flow
    each way on every link, and what each owner's tree puts there beyond it): the
    same loads as dense, no cell listed twice or at nothing beyond, and `owner_shares`
    of them as fast and as even as of the dense ones, rows standing for any number of
    ranks."""
    hosts, leaves, rates, _ = placement
    exchange = Exchange(leaves, uplinks=True, host=hosts)
    owners = data.draw(st.lists(st.integers(0, len(hosts) - 1), min_size=1, max_size=8))
    sparse = exchange.sparse_link_loads(True, owners)
    dense = exchange.link_loads(True, owners)
    np.testing.assert_array_equal(sparse.dense(), dense)
    assert np.all(sparse.extra != 0) and sparse.rows == len(owners)
    assert len(set(zip(sparse.row.tolist(), sparse.col.tolist(), strict=True))) == len(sparse.row)
    members = data.draw(st.lists(st.integers(1, 4), min_size=len(owners),
                                 max_size=len(owners)))
    link_rates = np.array(rates * 2)
    solved, weighed = (owner_shares(loads, link_rates, members) for loads in (dense, sparse))
    each = np.repeat(solved, members)
    rows = np.repeat(dense, members, axis=0)
    assert sum(np.repeat(weighed, members)) == pytest.approx(1)
    assert exchange_time(rows, link_rates, np.repeat(weighed, members)) == pytest.approx(
        exchange_time(rows, link_rates, each), rel=1e-6)
    assert max(weighed) == pytest.approx(max(solved), rel=1e-6)
    for a, b in itertools.combinations(range(len(owners)), 2):
        if owners[a] == owners[b]:  # the same rows: one class
            assert weighed[a] == weighed[b]


def test_shares_are_as_even_where_highs_presolve_calls_the_most_even_infeasible() -> None:
    """Found by the test above: on these dense loads HiGHS's presolve called the second
    programme (the most even of the fastest shares: a hair over the first's optimum, eight
    links tight at once) infeasible, with either method, and one rank was given every
    byte. Without presolve it is solved: the shares of the sparse loads, as even as the
    links allow."""
    exchange = Exchange([0, 1, 0, 1, 1, 2], uplinks=True, host=[1, 2, 0, 3, 4, 5])
    rates = np.array([0.5, 1.0, 1.0, 0.5, 2.5, 0.5] * 2)
    owners = [0, 1, 3, 4]
    for loads in (exchange.link_loads(True, owners), exchange.sparse_link_loads(True, owners)):
        assert owner_shares(loads, rates) == pytest.approx([0, 1 / 3, 0, 2 / 3], abs=1e-6)


def test_ranks_of_a_host_are_weighed_as_one_only_where_their_trees_match() -> None:
    def alike(hosts: list[int], leaves: list[int]) -> list[int] | None:
        _, of_host, count = np.unique(hosts, return_inverse=True, return_counts=True)
        firsts = loadbalance._alike_by_host(of_host, count, leaves)
        return None if firsts is None else firsts.tolist()

    assert alike([0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1]) == [0, 2, 4]  # host by host
    assert alike([1, 0, 1, 0], [0, 1, 0, 1]) == [1, 0]  # round the hosts (first: host 0's)
    # Host 0's ranks 0 and 3 lead before and after host 1's: orders differ by place.
    assert alike([0, 1, 1, 0], [0, 0, 0, 0]) is None
    assert alike([0, 0, 1, 1], [0, 1, 2, 2]) is None  # a host under two leaves


def test_a_job_the_solver_finds_no_shares_for_gets_even_owners_and_the_others_are_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two jobs reducing within leaves: "a" on hosts of two rates (a programme to solve),
    # "b" on hosts of one rate (even shares, no programme). HiGHS fails once: "a" gets
    # even owners and a note, "b" its plan as ever; the next plan solves "a" again.
    topo = Topology(tuple(Host(f"h{i}", i // 2, G // 2 if i == 0 else G) for i in range(8)),
                    uplink_bps=(G, G, G, G))
    jobs = (JobState("a", 4, chunk_bytes=(1,) * 40), JobState("b", 4, chunk_bytes=(1,) * 40))
    workers = tuple(Worker("a", r, h) for r, h in enumerate((0, 1, 2, 3))) + tuple(
        Worker("b", r, h) for r, h in enumerate((4, 5, 6, 7)))
    state = State(jobs=jobs, topology=topo, workers=workers)
    solver = loadbalance._linprog()

    def failing(*args: object, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(success=False, message="numerical trouble")

    loadbalance._shares.cache_clear()
    monkeypatch.setattr(loadbalance, "_linprog", lambda: failing)
    plan = get_policy("gradlane").plan(state)
    assert plan.notes == ("job 'a': even chunk owners: owner shares: numerical trouble",)
    assert [plan.ownership["a"].count(r) for r in range(4)] == [10] * 4
    assert [plan.ownership["b"].count(r) for r in range(4)] == [10] * 4
    monkeypatch.setattr(loadbalance, "_linprog", lambda: solver)
    again = get_policy("gradlane").plan(state)  # the failure was not cached
    assert again.notes == () and [again.ownership["a"].count(r) for r in range(4)] != [10] * 4


def test_where_the_interior_point_method_fails_the_simplex_solves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads, rates = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), np.array([1.0, 2.0])
    solved, solver = owner_shares(loads, rates), loadbalance._linprog()
    methods = []

    def ipm_fails(*args: object, method: str, **kwargs: object) -> object:
        methods.append(method)
        if method == loadbalance.LP_METHOD:
            return SimpleNamespace(success=False, message="numerical trouble")
        return solver(*args, method=method, **kwargs)

    monkeypatch.setattr(loadbalance, "_linprog", lambda: ipm_fails)
    assert owner_shares(loads, rates) == pytest.approx(solved, abs=1e-9)
    assert methods == ["highs-ipm", "highs-ds"] * 2  # each programme, then the simplex


def test_owner_shares_of_rows_standing_for_several_ranks() -> None:
    # Two ranks loading the first link, one the second: as the three rows, each rank's.
    loads, rates = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1.0, 2.0])
    three = owner_shares(loads[[0, 0, 1]], rates)
    assert owner_shares(loads, rates, [2, 1]) == pytest.approx([three[0], three[2]])
    assert sum(three) == pytest.approx(1) and three[0] == pytest.approx(three[1])
    for members in ([2], [0, 1], [1, 2, 3]):
        with pytest.raises(ConfigError, match="a count of at least 1 ranks per row"):
            owner_shares(loads, rates, members)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=n, max_size=n),
    st.lists(st.sampled_from([0.5, 1.0, 2.5]), min_size=4, max_size=4),
    st.lists(st.integers(1, 3), min_size=n, max_size=n))))
def test_owner_shares_solve_the_programmes_as_written_out_whole(
    case: tuple[list[list[int]], list[float], list[int]],
) -> None:
    """Any loads, rows standing for `members` ranks: the slowest link's time and the
    largest share a rank gets are those of the two programmes written out whole (a
    variable per rank, every load in the matrix), which `owner_shares` solves with
    each link's most common load taken out (sparse) and ranks loading alike as one."""
    rows, link_rates, members = case
    loads, rates = np.array(rows, dtype=np.float64), np.array(link_rates)
    assume(loads.any())
    each = np.repeat(loads, members, axis=0)  # a row per rank
    w, n_links = len(each), loads.shape[1]
    linprog = loadbalance._linprog()
    last = np.append(np.zeros(w), 1.0)
    one = np.append(np.ones(w), 0.0)[None, :]
    per_share = np.hstack([(each / rates).T, -np.ones((n_links, 1))])
    slowest = linprog(last, A_ub=per_share, b_ub=np.zeros(n_links), A_eq=one, b_eq=[1.0])
    spread = linprog(last, A_ub=np.vstack([np.hstack([(each / rates).T, np.zeros((n_links, 1))]),
                                           np.hstack([np.eye(w), -np.ones((w, 1))])]),
                     b_ub=np.append(np.full(n_links, slowest.fun * (1 + 1e-9)), np.zeros(w)),
                     A_eq=one, b_eq=[1.0])
    assert slowest.success and spread.success
    shares = owner_shares(loads, rates, members)
    assert np.dot(shares, members) == pytest.approx(1)
    assert exchange_time(loads, rates, np.multiply(shares, members)) == pytest.approx(
        slowest.fun, rel=1e-6)
    assert max(shares) == pytest.approx(spread.fun, rel=1e-5, abs=1e-7)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=3), min_size=1, max_size=12),
       st.booleans())
def test_distinct_rows_come_in_first_order_and_rebuild_the_matrix(
    rows: list[list[int]], clash: bool,
) -> None:
    a = np.array(rows, dtype=np.float64)
    if clash:  # every row hashes alike: told apart by sorting instead
        loadbalance.hash = lambda _: 0  # type: ignore[attr-defined]
    try:
        distinct, of = loadbalance._distinct_rows(a)
    finally:
        vars(loadbalance).pop("hash", None)
    assert np.array_equal(distinct[of], a)
    assert len(distinct) == len(np.unique(a, axis=0))
    # Numbered as they first come: each row's class is one already seen or the next.
    seen = np.maximum.accumulate(of)
    assert of[0] == 0 and set(np.diff(seen).tolist()) <= {0, 1} and np.all(of <= seen)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=9),
                min_size=1, max_size=4).map(lambda r: [x + [0.5] * (9 - len(x)) for x in r]))
def test_most_common_is_each_row_s_most_frequent_value_the_least_of_ties(
    rows: list[list[float]],
) -> None:
    common = loadbalance._most_common(np.array(rows))
    for row, value in zip(rows, common, strict=True):
        counts = {v: row.count(v) for v in row}
        top = max(counts.values())
        assert value == min(v for v, c in counts.items() if c == top)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=4))
def test_ring_loads_are_two_models_less_each_end_s_share(rates: list[float]) -> None:
    """One rank a host: the link from rank i to i+1 carries 2 - o_i - o_i+1 of the model
    (`ring_routes`), at the slower of the two rates."""
    shares = owner_shares(*one_switch(rates, ring=True))
    o, r = np.array(shares), np.array(rates)
    by_hand = ((2 - o - np.roll(o, -1)) / np.minimum(r, np.roll(r, -1))).max()
    assert exchange_time(*one_switch(rates, ring=True), shares) == pytest.approx(by_hand)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.floats(0.1, 10), min_size=1, max_size=12))
def test_flat_shares_finish_the_flat_exchange_no_later_than_other_shares(
    rates: list[float],
) -> None:
    shares = flat_shares(rates)
    assert sum(shares) == pytest.approx(1) and min(shares) >= 0
    loads, link_rates = one_switch(rates, ring=False)
    best = exchange_time(loads, link_rates, shares)
    world = len(rates)
    # The closed form and the linear programme agree.
    assert best <= exchange_time(loads, link_rates, owner_shares(loads, link_rates)) * (
        1 + 1e-9)
    for other in ([1 / world] * world, [r / sum(rates) for r in rates]):  # bytes, rates
        assert best <= exchange_time(loads, link_rates, other) * (1 + 1e-9)
    if world > 2:
        # Optimal: either the slowest links own nothing (so no shares could speed them up:
        # each carries its own gradient and the results), or every owning link finishes
        # with them (any share moved would finish later).
        times = [(1 + (world - 2) * s) / r for r, s in zip(rates, shares, strict=True)]
        assert max(times) == pytest.approx(best)
        slowest = [i for i, t in enumerate(times) if t == pytest.approx(best)]
        if any(shares[i] > 1e-12 for i in slowest):
            assert all(t == pytest.approx(best) for t, s in zip(times, shares, strict=True)
                       if s > 1e-12)
        else:
            assert best == pytest.approx(max(1 / r for r in rates))


def test_assign_owners_equal_and_weighted_paths_agree_on_equal_weights() -> None:
    sizes = [5, 3, 8, 1, 1, 9, 2] * 10
    assert assign_owners(sizes, 4) == assign_owners(sizes, 4, [1.0, 1.0, 1.0, 1.0])
    assert assign_owners(sizes, 4, [3.0] * 4) == assign_owners(sizes, 4)
    # The general path on weights (2, 1, 1): rank 0 ends with about half the bytes.
    owners = assign_owners(sizes, 3, [2.0, 1.0, 1.0])
    owned = sum(s for s, o in zip(sizes, owners, strict=True) if o == 0)
    assert abs(owned - sum(sizes) / 2) <= max(sizes)


def test_assign_owners_gives_a_group_s_tie_to_the_rank_that_finishes_first_overall() -> None:
    """Ranks of weights 1 and 2. Group 0 (two chunks of 10) leaves each owning 10. In
    group 1 (two chunks of 4) rank 1 takes the first; for the second, both would end the
    group at 4 (4 / 1 and 8 / 2), and rank 1 ends sooner overall with it (18 / 2 against
    14 / 1), so it takes it."""
    owners = assign_owners([10, 10, 4, 4], 2, [1.0, 2.0], [0, 0, 1, 1])
    assert owners == [1, 0, 1, 1]


def test_assign_owners_takes_weights_a_rounding_apart_as_equal() -> None:
    # What a solver hands back for equal shares: the lowest rank must not lose every tie.
    sizes = [5, 3, 8, 1, 1, 9, 2] * 10
    noisy = [0.24999999999999992, 0.25000000000000006, 0.25000000000000006, 0.25]
    assert assign_owners(sizes, 4, noisy) == assign_owners(sizes, 4)
    layers = [i // 7 for i in range(len(sizes))]
    assert assign_owners(sizes, 4, noisy, layers) == assign_owners(sizes, 4, None, layers)
    assert assign_owners(sizes, 3, [0.5, 0.25000000000000006, 0.24999999999999992]) == (
        assign_owners(sizes, 3, [0.5, 0.25, 0.25]))


def test_straggler_shares_follow_throughput() -> None:
    assert proportional_shares(64, [1, 1, 1, 0.5]) == (19, 18, 18, 9)
    assert sum(proportional_shares(7, [100, 1, 1])) == 7
    assert min(proportional_shares(7, [100, 1, 1])) == 1
    with pytest.raises(ValueError, match="one sample each"):
        proportional_shares(2, [1, 1, 1])
    assert proportional_shares(4, [1, 1, 1, 0.5]) == (1, 1, 1, 1)  # one each: just enough
    with pytest.raises(ValueError, match="must be positive"):
        proportional_shares(10, [1, 0])
    # One sample each for the three slow ones hands out two too many (quotas 4.70, 2.01,
    # 0.10 each, floors 4, 2, 1, 1, 1): the most over-served give one back, 2.01's first.
    assert proportional_shares(7, [49, 21, 1, 1, 1]) == (3, 1, 1, 1, 1)
    assert proportional_shares(4, [22, 17]) == (2, 2)  # quotas 2.26, 1.74: 0.74 remains most


def test_straggler_shares_each_job_s_batch_by_its_measured_throughputs() -> None:
    speeds = {"j": [2.0, 1.0, 1.0], "k": [1.0, 1.0, 1.0], "slow": [0.5, 0.25],
              "new": [1.0, 0.0]}
    state = State(jobs=(JobState("j", 3, global_batch=3), JobState("k", 3, global_batch=2),
                        JobState("new", 2, global_batch=6), JobState("slow", 2, global_batch=6)),
                  workers=tuple(Worker(job, r, r, throughput=t)
                                for job in sorted(speeds) for r, t in enumerate(speeds[job])))
    # j: one sample each, just enough; k: fewer samples than workers, none; slow: samples
    # per second under one are measured ones; new: one worker not measured yet, even.
    assert throughput_shares(state) == {"j": (1, 1, 1), "new": (3, 3), "slow": (4, 2)}


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 3), st.integers(0, 4),
                          st.sampled_from([0.0, 0.1, 0.3])), min_size=1, max_size=30))
@example([(0, 0, 3, 0.0), (1, 0, 3, 0.3)])  # one priority: two coflows' chunks stay apart
def test_critical_flows_are_the_last_ready_of_each_chunk(
        rows: list[tuple[int, int, int, float]]) -> None:
    """Of the flows of one (coflow, chunk, priority), those ready last move up a band when
    some were ready earlier; flows of different ones never count as one (chunk -1 and
    the highest chunk, priorities apart, included)."""
    flows = FlowTable.build([(0, 1, 1e6, ready, prio, coflow, chunk)
                             for coflow, chunk, prio, ready in rows])
    state = State(coflows=tuple(Coflow(f"j/{k}", "j") for k in range(3)), flows=flows)
    bands = np.full(len(rows), 2, np.int64)
    readies: dict[tuple[int, int, int], list[float]] = {}
    for coflow, chunk, prio, ready in rows:
        readies.setdefault((coflow, chunk, prio), []).append(ready)
    expected = [1 if ready == max(readies[c, k, p]) > min(readies[c, k, p]) else 2
                for c, k, p, ready in rows]
    assert critical_first(state, bands).tolist() == expected


def test_straggler_promotes_the_last_ready_flows() -> None:
    topo = Topology(tuple(Host(f"h{i}") for i in range(3)))
    flows = FlowTable.build([(0, 2, 1e6, 0.0, 7, 0, 0), (1, 2, 1e6, 0.3, 7, 0, 0)])
    state = State(jobs=(JobState("j", 3, global_batch=30),), topology=topo,
                  workers=tuple(Worker("j", r, r, throughput=t) for r, t in
                                enumerate([100.0, 50.0, 100.0])),
                  coflows=(Coflow("j/1", "j"),), flows=flows, bands=4)
    plan = get_policy("straggler").plan(state)
    assert plan.batch_shares["j"] == (12, 6, 12)
    assert plan.flow_band.tolist()[1] == plan.flow_band.tolist()[0] - 1
    assert check_plan(state, plan) == []


def test_a_flow_crosses_its_hosts_nics_and_between_leaves_their_uplinks() -> None:
    """Links numbered egress 0..H-1, ingress H..2H-1, leaf up 2H.., leaf down 2H+L..; the
    capacities in that order."""
    topo = Topology((Host("a", 0, 10), Host("b", 0, 20), Host("c", 1, 30)), (40, 50))
    links = topo.links(np.array([0, 2, 1]), np.array([2, 1, 0]))
    assert links.tolist() == [[0, 5, 6, 9], [2, 4, 7, 8], [1, 3, -1, -1]]
    assert topo.capacity_bps.tolist() == [10, 20, 30, 10, 20, 30, 40, 50, 40, 50]
    assert topo.leaves == 2 and Topology((Host("a"), Host("b"))).leaves == 1  # one switch


def test_no_flows_is_an_empty_table_and_a_plan_of_none() -> None:
    for empty in (FlowTable.empty(), FlowTable.build([]), FlowTable.concat([])):
        assert len(empty) == 0
        assert all(len(getattr(empty, k)) == 0 for k in ("src", "dst", "bytes", "ready_s",
                                                          "priority", "coflow", "chunk"))
    plan = Plan(job_classes={}, source="t")
    assert len(plan.flow_band) == len(plan.flow_rate_bps) == 0


@pytest.mark.parametrize("hosts, uplinks, says", [
    ((), (), "a topology needs at least one host"),
    ((Host("a", 0, G), Host("b", -1, G)), (), "leaves are numbered from 0, got -1"),
    ((Host("a", 0, G), Host("b", 1, G)), (G,), r"need one uplink rate per leaf \(2\), got 1"),
    ((Host("a", 0, G), Host("b", 0, 0)), (), "link rates must be positive"),
    ((Host("a", 0, G), Host("b", 1, G)), (G, 0), "link rates must be positive"),
])
def test_a_topology_that_cannot_be_is_refused_saying_why(
        hosts: tuple[Host, ...], uplinks: tuple[int, ...], says: str) -> None:
    assert Topology((Host("a", 0, G), Host("b", 1, G)), (G, G)).leaves == 2
    with pytest.raises(ConfigError, match=f"^{says}"):
        Topology(hosts, uplinks)


def _valid_cluster_plan() -> tuple[State, Plan]:
    """`_two_jobs_on_one_link` with batches and a second chunk for 'big', and fair's plan."""
    state = replace(_two_jobs_on_one_link(), version=3, jobs=(
        JobState("big", 2, global_batch=8, chunk_bytes=(100, 50)),
        JobState("small", 2, global_batch=4, chunk_bytes=(10,))))
    plan = get_policy("fair").plan(state)
    assert check_plan(state, plan) == []
    return state, plan


_CLASS = JobClassPlan(G // 4, G, 0)
# Each way a cluster plan can be invalid, and what `check_plan` says of it.
BROKEN_PLANS: list[tuple[str, dict[str, object], str]] = [
    ("version", {"version": 2}, "plan version 2 is not the state's 3"),
    ("ttl", {"ttl_s": 0.0}, "time-to-live 0.0 is not positive"),
    ("a flow without a band", {"flow_band": np.zeros(1, np.int64)}, "2 flows but 1 bands, 2 rates"),
    ("a band past the last", {"flow_band": np.array([0, 4])}, "a band outside 0..3"),
    ("a negative rate", {"flow_rate_bps": np.array([-1.0, 0.0])},
     "a flow rate is negative or not finite"),
    ("a rate not a number", {"flow_rate_bps": np.array([np.nan, 0.0])},
     "a flow rate is negative or not finite"),
    ("a link over capacity", {"flow_rate_bps": np.array([G, G], np.float64)},
     "1 links over capacity, e.g. link 0: 2000000000 > 1000000000 bit/s"),
    ("classes over the NIC", {"host_classes": {0: {"big": JobClassPlan(G, G, 0),
                                                   "small": JobClassPlan(G, G, 0)}}},
     "host 0: job classes sum to 2000000000 > NIC 1000000000"),
    ("a prio past the last", {"host_classes": {0: {"big": JobClassPlan(1, G, 8)}}},
     "host 0: a class has a bad prio or rate above ceil"),
    ("a rate above the ceil", {"host_classes": {0: {"big": JobClassPlan(2, 1, 0)}}},
     "host 0: a class has a bad prio or rate above ceil"),
    ("a coflow left out of the order", {"coflow_order": ("big/1",)},
     "the coflow order is not a permutation of the coflows"),
    ("a job without a level", {"job_level": {"small": 0}}, "job big: no level in 0..7"),
    ("a level past the last", {"job_level": {"small": 0, "big": 8}},
     "job big: no level in 0..7"),
    ("a chunk without an owner", {"ownership": {"big": (0,), "small": (1,)}},
     "job big: not every chunk has exactly one owner"),
    ("a job without owners", {"ownership": {"small": (1,)}},
     "job big: not every chunk has exactly one owner"),
    ("an owner not in the job", {"ownership": {"big": (0, 2), "small": (1,)}},
     "job big: a chunk owned by a rank not in the job"),
    ("a job without shares", {"batch_shares": {"small": (2, 2)}},
     "job big: no batch share per worker"),
    ("shares off the global batch", {"batch_shares": {"big": (4, 3), "small": (2, 2)}},
     "job big: shares (4, 3) do not sum to 8 with each >= 1"),
    ("a worker with no samples", {"batch_shares": {"big": (8, 0), "small": (2, 2)}},
     "job big: shares (8, 0) do not sum to 8 with each >= 1"),
]


@pytest.mark.parametrize("change, says", [pytest.param(c, s, id=what)
                                           for what, c, s in BROKEN_PLANS])
def test_check_plan_names_each_way_a_cluster_plan_is_invalid(
        change: dict[str, object], says: str) -> None:
    """The property tests' "every plan is valid" means what `check_plan` finds: each
    violation, made alone in a valid plan, is found, and only it."""
    state, plan = _valid_cluster_plan()
    problems = check_plan(state, replace(plan, **change))  # type: ignore[arg-type]
    assert problems == [says]


def test_check_plan_takes_the_edges_of_valid() -> None:
    """A time-to-live under a second, a class at its ceiling, one of 1 bit/s, a link and a
    NIC's classes full to the rounding allowed (a millionth, and a bit/s a class), one
    sample a worker: valid, and the last still checked."""
    state, plan = _valid_cluster_plan()
    assert check_plan(state, replace(plan, ttl_s=0.5)) == []
    full = G * (1 + 1e-6)
    assert check_plan(state, replace(plan, flow_rate_bps=np.array([full, 0.0]))) == []
    halves = {"big": JobClassPlan(G // 2 + 500, G, 0), "small": JobClassPlan(G // 2 + 501, G, 0)}
    assert check_plan(state, replace(plan, host_classes={0: halves})) == []
    halves["big"] = JobClassPlan(G // 2 + 501, G, 0)
    assert check_plan(state, replace(plan, host_classes={0: halves})) == [
        "host 0: job classes sum to 1000001002 > NIC 1000000000"]
    daemon = State(shaped_bps=G, other_bps=0, jobs=(JobState("a", 1), JobState("b", 1)))
    assert check_plan(daemon, Plan(job_classes={"a": JobClassPlan(G, G, 0), "b": _CLASS},
                                   source="t")) == []
    assert check_plan(daemon, Plan(job_classes={"a": JobClassPlan(1, G, 0), "b": _CLASS},
                                   source="t")) == []
    one_each = replace(state, jobs=(state.jobs[0], replace(state.jobs[1], global_batch=2)))
    assert check_plan(one_each, replace(plan, batch_shares={**plan.batch_shares,
                                                            "small": (1, 1)})) == []
    assert check_plan(one_each, replace(plan, batch_shares={"big": plan.batch_shares["big"]})
                      ) == ["job small: no batch share per worker"]


@pytest.mark.parametrize("classes, says", [
    ({"a": _CLASS}, "job b has no class"),
    ({"a": _CLASS, "b": JobClassPlan(0, G, 0)}, "job b: bad class"),
    ({"a": _CLASS, "b": JobClassPlan(G // 4, 2 * G, 0)}, "job b: bad class"),
    ({"a": _CLASS, "b": JobClassPlan(G // 4, G, 8)}, "job b: bad class"),
])
def test_check_plan_names_a_daemon_s_missing_or_bad_class(
        classes: dict[str, JobClassPlan], says: str) -> None:
    state = State(shaped_bps=G, other_bps=0, jobs=(JobState("a", 1), JobState("b", 1)))
    assert check_plan(state, Plan(job_classes={"a": _CLASS, "b": _CLASS}, source="t")) == []
    problems = check_plan(state, Plan(job_classes=classes, source="t"))
    assert len(problems) == 1 and problems[0].startswith(says)


def test_reduction_within_leaves_only_when_an_uplink_is_oversubscribed() -> None:
    hosts = tuple(Host(f"h{i}", i // 2, G) for i in range(4))  # two hosts per leaf
    state = State(jobs=(JobState("j", 4),), topology=Topology(hosts, (G, G)),
                  workers=tuple(Worker("j", r, r) for r in range(4)))
    assert get_policy("gradlane").plan(state).reduce_in_leaf  # 2 Gbit/s of hosts, 1 up
    assert get_policy("loadbalance").plan(state).reduce_in_leaf
    assert not get_policy("fifo").plan(state).reduce_in_leaf
    for fabric in (Topology(hosts, (2 * G, 2 * G)), Topology(tuple(Host(h.name) for h in hosts))):
        assert not get_policy("gradlane").plan(
            State(jobs=state.jobs, topology=fabric, workers=state.workers)
        ).reduce_in_leaf


def test_host_classes_follow_demand_and_never_guarantee_nothing() -> None:
    from gradlane.policies.fabric import MIN_CLASS_SHARE, host_classes

    # Host 0 runs jobs a and b, host 1 only a; only a's demand is known (b's other ranks
    # have not reported): a flow h0 -> h1 of a, at the rate the planner gives it.
    topo = Topology((Host("h0", 0, G), Host("h1", 0, G)))
    state = State(
        jobs=(JobState("a", 2), JobState("b", 1)), topology=topo,
        workers=(Worker("a", 0, 0), Worker("a", 1, 1), Worker("b", 0, 0)),
        coflows=(Coflow("a", "a"),), flows=FlowTable.build([(0, 1, 1e6, 0.0, 0, 0, 0)]))
    floor = MIN_CLASS_SHARE * G
    for rate in (0.4 * G, 0.0):
        classes = host_classes(state, np.array([rate]), {})
        assert classes[0]["a"].rate_bps == int(floor + rate)  # its flows' rate, and the floor
        assert classes[0]["b"].rate_bps == int(floor + G / 2 * 0.999)  # unknown: equal share
        assert abs(classes[1]["a"].rate_bps - G) <= 1  # alone on h1, no flow from it: all
        assert all(c.ceil_bps == G for h in classes.values() for c in h.values())
    # Levels where given (a coflow order's), else the first.
    levelled = host_classes(state, np.array([0.4 * G]), {"a": 3})
    assert [(h, j, c.prio) for h, cs in sorted(levelled.items()) for j, c in sorted(cs.items())
            ] == [(0, "a", 3), (0, "b", 0), (1, "a", 3)]
    # More asked than the NIC carries: scaled into it, the floors kept.
    classes = host_classes(state, np.array([0.9 * G]), {})
    assert sum(c.rate_bps for c in classes[0].values()) <= G
    assert min(c.rate_bps for c in classes[0].values()) > floor


@pytest.mark.parametrize("policy", ["fifo", "straggler", "gradlane"])
def test_a_job_whose_global_batch_is_unknown_gets_no_shares(policy: str) -> None:
    # Even a job of one worker: a share of 1 sample would be a batch made up.
    state = State(jobs=(JobState("j", 1),), topology=Topology((Host("h0"),)),
                  workers=(Worker("j", 0, 0, throughput=10.0),))
    assert "j" not in get_policy(policy).plan(state).batch_shares
    told = replace(state, jobs=(JobState("j", 1, global_batch=8),))
    assert get_policy(policy).plan(told).batch_shares["j"] == (8,)


def test_a_job_with_a_worker_not_yet_timed_gets_even_shares() -> None:
    # Rank 1 has no throughput yet (its first iterations): weighing it at any guess
    # would starve or flood it.
    state = State(jobs=(JobState("j", 2, global_batch=30),),
                  topology=Topology((Host("h0"), Host("h1"))),
                  workers=(Worker("j", 0, 0, throughput=100.0), Worker("j", 1, 1)))
    assert get_policy("straggler").plan(state).batch_shares["j"] == (15, 15)


def test_a_plan_s_wire_form_holds_every_field() -> None:
    # The determinism tests compare plans by `to_wire`: a field it left out would never be
    # compared, and a form of nothing would make them pass whatever the plans.
    _, plan = _valid_cluster_plan()
    wire = plan.to_wire()
    assert set(wire) == {f.name for f in dataclasses.fields(Plan)}
    assert json.loads(json.dumps(wire)) == wire
    assert replace(plan, flow_band=plan.flow_band + 1).to_wire() != wire
    assert plan.host_classes
    bumped = {h: {j: replace(p, rate_bps=p.rate_bps - 1) for j, p in c.items()}
              for h, c in plan.host_classes.items()}
    assert replace(plan, host_classes=bumped).to_wire() != wire


def test_a_state_s_flow_links_are_read_only() -> None:
    # Computed once per state and shared by every policy that plans from it.
    links = _two_jobs_on_one_link().flow_links
    with pytest.raises(ValueError, match="read-only"):
        links[0, 0] = 1
