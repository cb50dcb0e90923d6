"""The flow-level simulator: analytic cases, determinism, and that plans stay valid."""

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradlane.errors import ConfigError
from gradlane.policies import Plan, Policy, State, check_plan, get_policy
from gradlane.policies.base import Host, Topology
from gradlane.policies.profiles import trace_layers
from gradlane.policies.sim import (
    Bucket,
    Result,
    Scenario,
    SimJob,
    buckets_of,
    cluster,
    coflow_load,
    full_demand_state,
    heterogeneous,
    one_switch,
    simulate,
)
from gradlane.policies.sim.scenario import (
    BATCH_PER_WORKER,
    SAMPLES_PER_WORKER,
    job_buckets,
    profile_layers,
    shim_buckets,
)
from tests import REPO

G = 1e9


def _one_job(layers, workers=2, nic=G, speeds=None, **kw):  # type: ignore[no-untyped-def]
    return one_switch("t", [("x", layers, speeds or [1.0] * workers)], workers, nic, **kw)


@pytest.mark.parametrize("workers", [2, 4])
def test_one_bucket_iteration_is_compute_plus_the_exchange(workers: int) -> None:
    # One bucket: nothing to overlap. Each worker sends S + (W - 2) * S / W bytes.
    size, fwd, bwd = 10e6, 0.01, 0.02
    result = simulate(_one_job([(size, fwd, bwd)], workers), get_policy("fifo"))
    exchange = (2 * (workers - 1) / workers) * size * 8 / G
    for t in result.iteration_s["job0-x"]:
        assert t == pytest.approx(fwd + bwd + exchange, rel=1e-6)


def test_even_shares_wait_for_the_slow_worker_s_forward_and_backward() -> None:
    # Speeds 1 and 0.5, even batch shares (`fifo` keeps them): the slow worker takes twice
    # the forward and twice the backward, then the exchange.
    size, fwd, bwd = 10e6, 0.01, 0.02
    result = simulate(_one_job([(size, fwd, bwd)], speeds=[1.0, 0.5]), get_policy("fifo"))
    for t in result.iteration_s["job0-x"]:
        assert t == pytest.approx(2 * fwd + 2 * bwd + size * 8 / G, rel=1e-6)


def test_utilization_and_times_measure_the_run() -> None:
    # Two workers on two leaves, uplinks twice the NICs: every bit a host sends crosses its
    # leaf's uplink too, so uplinks are half as busy as host links. Each plan's time holds
    # the policy's own, and the run's wall time holds them all, within the call's.
    size, fwd, bwd = 10e6, 0.01, 0.02
    sc = _one_job([(size, fwd, bwd)])
    topo = Topology((Host("h0", 0, int(G)), Host("h1", 1, int(G))), (int(2 * G),) * 2)
    sc = replace(sc, topology=topo)
    fifo, inner_s = get_policy("fifo"), []

    class Timed(Policy):
        name = "timed"

        def plan(self, state: State) -> Plan:
            began = time.perf_counter()
            plan = fifo.plan(state)
            inner_s.append(time.perf_counter() - began)
            return plan

    started = time.perf_counter()
    result = simulate(sc, Timed())
    took = time.perf_counter() - started
    exchange = size * 8 / G
    assert result.utilization["host"] == pytest.approx(exchange / (fwd + bwd + exchange),
                                                       rel=1e-3)
    assert result.utilization["uplink"] == pytest.approx(result.utilization["host"] / 2)
    assert len(result.plan_ms) == len(inner_s) > 0
    assert all(ms >= s * 1000 for ms, s in zip(result.plan_ms, inner_s, strict=True))
    assert sum(result.plan_ms) / 1000 <= result.wall_s <= took


@pytest.mark.parametrize("workers", [3, 4])
def test_a_chunk_alone_on_the_ring_is_stored_and_forwarded_at_every_hop(workers: int) -> None:
    # One one-chunk bucket: its partial sum takes W-1 hops to the owner, the average W-1
    # more, each a whole chunk time (a hop forwards what it has received in full). As
    # fluid flows the chunk would cross all its links at once: 1 chunk time.
    c, fwd, bwd = 1e6, 0.01, 0.02
    sc = _one_job([(c, fwd, bwd)], workers)
    sc = replace(sc, jobs=(replace(sc.jobs[0], chunk_bytes=int(c), ring=True),))
    for t in simulate(sc, get_policy("fifo")).iteration_s["job0-x"]:
        assert t == pytest.approx(fwd + bwd + 2 * (workers - 1) * c * 8 / G, rel=1e-6)


def _bucket_chunk_times(workers: int, chunks: int, ring: bool,
                        owners: tuple[int, ...] = ()) -> int:
    """A reference for one bucket of `chunks` equal chunks, moved chunk by chunk and
    stage by stage, in chunk times.

    Links: rank r's egress r, its ingress W + r. On the ring a chunk owned by o takes
    2 (W - 1) hops, hop k from rank o + 1 + k to its successor, the first W - 1 partial
    sums, the rest averages. Stored and forwarded on the tree (one switch): the partial
    sums go up to the owner (one chunk on each other rank's egress, W - 1 on the owner's
    ingress), then the average down (the reverse). Each link sends one stage at a time,
    the shim's next: averages before partial sums, then by chunk; a stage is done once
    through all its links. A link that finishes takes its next from the stages already
    waiting; one arriving at that instant waits (the network promotes at the finish).
    """
    from gradlane.policies.chunks import assign_owners

    def stage(owner: int, k: int) -> dict[int, int]:  # link: chunk times
        if ring:
            sender = (owner + 1 + k) % workers
            return {sender: 1, workers + (sender + 1) % workers: 1}
        others = [r for r in range(workers) if r != owner]
        if k == 0:
            return {**{r: 1 for r in others}, workers + owner: workers - 1}
        return {owner: workers - 1, **{workers + r: 1 for r in others}}

    stages, averages_from = (2 * (workers - 1), workers - 1) if ring else (2, 1)
    owners = owners or tuple(assign_owners((1,) * chunks, workers))
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(2 * workers)]  # (key, chunk)
    sending: dict[int, tuple[int, int]] = {}  # link: (chunk, when through)
    left: dict[int, set[int]] = {}  # chunk: links its stage has still to go through
    at = [0] * chunks  # each chunk's stage

    def queue(chunk: int) -> list[tuple[int, tuple[int, int]]]:
        links = stage(owners[chunk], at[chunk])
        left[chunk] = set(links)
        key = 0 if at[chunk] >= averages_from else 1
        return [(link, (key, chunk)) for link in links]

    arrived = [entry for chunk in range(chunks) for entry in queue(chunk)]
    done = t = 0
    while True:
        for batch in ([], arrived):  # links that freed pick first, then the arrivals join
            for link, entry in batch:
                waiting[link].append(entry)
            for link, queued in enumerate(waiting):
                if link not in sending and queued:
                    _, chunk = min(queued)
                    queued.remove(min(queued))
                    sending[link] = (chunk, t + stage(owners[chunk], at[chunk])[link])
        if done == chunks:
            return t
        t += 1
        assert t <= 2 * chunks * stages * workers, "the reference stalled"
        arrived = []
        for link, (chunk, through) in list(sending.items()):
            if through == t:
                del sending[link]
                left[chunk].discard(link)
                if not left[chunk]:
                    at[chunk] += 1
                    if at[chunk] == stages:
                        done += 1
                    else:
                        arrived += queue(chunk)


class _FifoWith(Policy):
    """`fifo`'s plan with the fields `fields` gives for the state."""

    name = "fifo-with"

    def __init__(self, fields: Callable[[State], dict[str, Any]]) -> None:
        self.fields = fields

    def plan(self, state: State) -> Plan:
        return replace(get_policy("fifo").plan(state), **self.fields(state))


@pytest.mark.parametrize("ring, workers, chunks, owners", [
    (True, 2, 5, ()), (True, 3, 5, ()), (True, 3, 7, ()), (True, 3, 8, ()), (True, 4, 6, ()),
    (True, 4, 9, ()), (True, 5, 12, ()), (False, 2, 5, ()), (False, 3, 6, ()),
    (False, 4, 7, ()), (False, 4, 8, ()),
    (True, 3, 6, (1, 0, 1, 1, 0, 2)), (True, 4, 6, (1, 1, 1, 1, 3, 2)),
    (False, 3, 5, (2, 2, 2, 2, 0)), (False, 4, 4, (2, 2, 2, 0))])
def test_a_bucket_moved_chunk_by_chunk_sends_averages_before_partial_sums(
        ring: bool, workers: int, chunks: int, owners: tuple[int, ...]) -> None:
    # More chunks than ranks: the ring's hops, or the tree's stored and forwarded stages
    # (`store_forward`), queue on the links, and the order they leave in sets when the
    # bucket is through. With even owners, on the ring here 6, 7, 12, 12, 10, 18 and 24
    # chunk times, on the tree 6, 10, 14 and 15 (partial sums first would take 5, 7, 10,
    # 11, 10, 15 and 21, then 5, 8, 11 and 12: on a lone bucket the shim's order costs up
    # to 1.27x). Even owners keep the chunks in step, the lower chunk ahead; the owners
    # of the last cases have a later chunk's average wait beside an earlier chunk's
    # partial sum, where chunk order alone or averages from one hop later would differ.
    c, fwd, bwd = 1e6, 0.01, 0.02
    sc = _one_job([(chunks * c, fwd, bwd)], workers)
    sc = replace(sc, jobs=(replace(sc.jobs[0], chunk_bytes=int(c), ring=ring,
                                   store_forward=not ring),))
    policy = (_FifoWith(lambda state: {"ownership": {j.name: owners for j in state.jobs}})
              if owners else get_policy("fifo"))
    expected = _bucket_chunk_times(workers, chunks, ring, owners) * c * 8 / G
    for t in simulate(sc, policy).iteration_s["job0-x"]:
        assert t == pytest.approx(fwd + bwd + expected, rel=1e-6)


@pytest.mark.parametrize("ring", [False, True])
def test_a_job_s_buckets_share_the_links_flat_or_ring(ring: bool) -> None:
    # Four one-chunk buckets on four workers, ready together, one owned by each rank. Flat,
    # each owner receives three contributions and sends its result to three peers: every
    # host link carries 3 flows of the bucket it owns and 1 of each other one, 6 chunks in
    # all. On the ring each rank sends a bucket's partial sum or average to its successor,
    # twice but where it is the owner or the owner's predecessor: 6 again. Alone, a bucket
    # would take 3 chunk times flat (the owner's links), its other links idle, and 6 on the
    # ring, hop after hop; the shim's connections fill the idle links with the other
    # buckets (on the ring, each hop of the four buckets is on a link of its own).
    # One whole-model step (no overlap): the next forward waits for all four.
    c, step = 1e6, 1e-4
    sc = _one_job([(c, step, 0.0)] * 4, 4)
    sc = replace(sc, jobs=(replace(sc.jobs[0], chunk_bytes=int(c), ring=ring, overlap=False),))
    assert len(sc.jobs[0].buckets) == 4
    for t in simulate(sc, get_policy("fifo")).iteration_s["job0-x"]:
        assert t == pytest.approx(4 * step + 6 * c * 8 / G, rel=1e-6)


def _co_located(layers, placement, ring, chunk_bytes=None):  # type: ignore[no-untyped-def]
    """One job of ranks on `placement` (each rank's host), hosts at 1 Gbit/s."""
    sc = _one_job(layers, len(placement))
    job = replace(sc.jobs[0], hosts=tuple(placement), ring=ring,
                  chunk_bytes=chunk_bytes or sc.jobs[0].chunk_bytes)
    hosts = max(placement) + 1
    return replace(sc, topology=Topology(tuple(Host(f"h{i}", 0, int(G))
                                               for i in range(hosts))), jobs=(job,))


@pytest.mark.parametrize("ring", [False, True])
def test_ranks_sharing_hosts_send_each_other_nothing_over_the_network(ring: bool) -> None:
    # Two ranks on each of two hosts, one one-chunk bucket. Reduced within hosts first, one
    # copy crosses each way: the other host's partial sum in, the average out (flat, four
    # hosts: 1.5 chunks). On the ring of ranks 0, 1 | 2, 3 only the hops 1 -> 2 and 3 -> 0
    # cross, three of a chunk's six whatever its owner, one after the other.
    c, fwd, bwd = 1e6, 0.01, 0.02
    sc = _co_located([(c, fwd, bwd)], (0, 0, 1, 1), ring, chunk_bytes=int(c))
    hops = 3 if ring else 1
    for t in simulate(sc, get_policy("fifo")).iteration_s["job0-x"]:
        assert t == pytest.approx(fwd + bwd + hops * c * 8 / G, rel=1e-6)
    # All on one host: nothing crosses at all.
    alone = _co_located([(c, fwd, bwd)], (0, 0, 0), ring, chunk_bytes=int(c))
    for t in simulate(alone, get_policy("fifo")).iteration_s["job0-x"]:
        assert t == pytest.approx(fwd + bwd, rel=1e-9)


@pytest.mark.parametrize("placement, ring, by_host", [
    ((0, 0, 1, 1), False, True), ((0, 0, 1, 1), True, False), ((0, 1, 2, 3), False, False)])
def test_the_planner_sees_a_job_reduced_within_hosts(placement: tuple[int, ...], ring: bool,
                                                     by_host: bool) -> None:
    # As the shim tells gradlaned: ranks sharing hosts, off the ring, reduce within hosts
    # first (`JobState.by_host`: `loadbalance` plans their owners for that exchange).
    policy = _Recording(get_policy("fifo"))
    simulate(_co_located([(1e6, 0.01, 0.02)], placement, ring), policy)
    assert {s.jobs[0].by_host for s in policy.states} == {by_host}


def test_ranks_sharing_hosts_ring_and_within_hosts_as_on_the_testbed() -> None:
    # `bench/co_located.py`'s placement: eight ranks, four on each of two hosts, an 8 MB
    # model in eight buckets. On the ring, even owners put 1.75 models on each host link
    # each way; `loadbalance` gives the chunks to the ranks at either end of each host's
    # run (1.5). Within hosts first carries one model each way, the bound.
    size = 8e6
    placement = (0,) * 4 + (1,) * 4
    ring = _co_located([(size / 8, 0.001, 0.002)] * 8, placement, ring=True)
    even = simulate(ring, get_policy("fifo")).mean_iteration_s
    planned = simulate(ring, get_policy("loadbalance")).mean_iteration_s
    within = simulate(_co_located([(size / 8, 0.001, 0.002)] * 8, placement, ring=False),
                      get_policy("loadbalance")).mean_iteration_s
    least = size * 8 / G  # a host link: one model out, one in
    assert even >= 1.75 * least
    assert 1.5 * least <= planned <= 1.6 * least  # the hops' latency on top
    assert least <= within <= 1.1 * least


@pytest.mark.parametrize("ring", [False, True])
def test_loadbalance_owners_relieve_a_slow_link_flat_or_ring(ring: bool) -> None:
    # Four workers, the last at half the rate, an 8 MB model in eight buckets. With even
    # owners (`fifo`) the slow link carries 1.5 models each way either way. `loadbalance`
    # plans for the exchange: flat, the slow worker owns nothing and its link carries one
    # model each way, the least possible (`flat_shares`); on the ring it owns everything,
    # which also leaves it one model (`owner_shares`), the ring's hops adding their latency.
    size = 8e6
    sc = _one_job([(size / 8, 0.001, 0.002)] * 8, 4)
    rates = (G, G, G, G / 2)
    sc = replace(sc, topology=Topology(tuple(Host(f"h{i}", 0, int(r))
                                             for i, r in enumerate(rates))),
                 jobs=(replace(sc.jobs[0], ring=ring),))
    even = simulate(sc, get_policy("fifo")).mean_iteration_s
    planned = simulate(sc, get_policy("loadbalance")).mean_iteration_s
    least = size * 8 / (G / 2)  # the slow link: its gradient out, the average in
    assert even >= 1.5 * least
    assert least <= planned <= (1.35 if ring else 1.05) * least
    assert even / planned > (1.2 if ring else 1.45)


def test_priority_overlaps_the_exchange_with_the_next_forward() -> None:
    # Eight layers, eight buckets; the big last layer is ready first, layer 0 last.
    layers = [(4e6, 0.02, 0.04)] * 7 + [(30e6, 0.02, 0.04)]
    sc = _one_job(layers, 4, nic=G)
    assert len(sc.jobs[0].buckets) == 8
    fifo = simulate(sc, get_policy("fifo")).mean_iteration_s
    prio = simulate(sc, get_policy("priority")).mean_iteration_s
    assert prio < fifo


@pytest.mark.parametrize(("policy", "overlap", "period_ms"), [
    ("priority", True, 65.0), ("priority", False, 75.0),
    # FIFO serves layer 0, needed first, last: waiting for it is waiting for all.
    ("fifo", True, 75.0), ("fifo", False, 75.0),
])
def test_without_overlap_the_next_forward_waits_for_every_average(
    policy: str, overlap: bool, period_ms: float
) -> None:
    # Two workers at 1 Gbit/s; layers of 10 ms forward and 20 ms backward; each host sends a
    # bucket's size per exchange: layer 0 5 ms, layer 1 30 ms. With f the end of a forward:
    # layer 1 is ready at f+20 and sends until layer 0, ready at f+40, preempts it for 5 ms
    # (done f+45); layer 1 ends at f+55. Per-layer steps: the next forward runs layer 0 at
    # f+45, layer 1 once its average is in at f+55, so f' = f+65. One step for the whole
    # model: the next forward starts at f+55 and its layer 1 ends at f+75.
    sc = _one_job([(625_000.0, 0.01, 0.02), (3_750_000.0, 0.01, 0.02)], 2, iterations=4)
    sc = replace(sc, jobs=(replace(sc.jobs[0], overlap=overlap),))
    times = simulate(sc, get_policy(policy)).iteration_s["job0-x"]
    assert times == pytest.approx([period_ms / 1000] * 4)


def test_the_testbed_replay_groups_layers_as_the_shim_did() -> None:
    from gradlane.benchmark import PAYLOAD_EFFICIENCY
    from gradlane.daemon.config import DEFAULT_SHAPE_FRACTION
    from gradlane.policies.chunks import MIN_GROUP_BYTES
    from gradlane.simulation import layout_kept, testbed_scenario

    workload = {"kind": "trace", "model": "vgg19", "model_mb": 10, "forward_ms": 50}

    def result(**scenario: object) -> dict[str, object]:
        runs = {"gradlane": [{"layout_trial": {"chosen": c}} for c in ("coarse", "fine", "coarse")],
                "fifo": [{"layout_trial": None}]}
        return {"scenario": {"name": "x", "hosts": 4, "workload": workload, **scenario},
                "link_bps": 1e8, "runs": runs}

    assert layout_kept(result(), "gradlane") == "coarse" and layout_kept(result(), "fifo") == "fine"
    assert layout_kept(result(layout="fine"), "gradlane") == "fine"  # pinned: no trial
    tie = {**result(), "runs": {"gradlane": [{"layout_trial": {"chosen": c}}
                                             for c in ("coarse", "fine")]}}
    assert layout_kept(tie, "gradlane") == "fine"
    fine = testbed_scenario(result(layout="fine"), None, "gradlane").jobs[0]
    coarse = testbed_scenario(result(), None, "gradlane").jobs[0]
    fifo = testbed_scenario(result(), None, "fifo").jobs[0]
    assert fine.overlap and not fifo.overlap
    assert fine.store_forward and fifo.store_forward  # chunks of tens of ms, as the shim's
    # gradlaned shapes the hosts' links under the rate; fifo runs without it.
    nic = {system: testbed_scenario(result(), None, system).topology.hosts[0].nic_bps
           for system in ("gradlane", "fifo")}
    assert nic["fifo"] == int(1e8 * PAYLOAD_EFFICIENCY)
    assert nic["gradlane"] == int(1e8 * PAYLOAD_EFFICIENCY * DEFAULT_SHAPE_FRACTION)
    told = {**result(), "daemon_line_bps": 1.02e8}  # the NIC's line rate, told since 2026-11-24
    assert testbed_scenario(told, None, "gradlane").topology.hosts[0].nic_bps == int(
        1.02e8 * PAYLOAD_EFFICIENCY * DEFAULT_SHAPE_FRACTION)
    # About 10 MiB on 4 ranks: fine chunks are a sixteenth of it, coarse ones an eighth;
    # on the ring (the exchange recorded since b01346d), fine ones a 48th.
    assert (fine.chunk_bytes, coarse.chunk_bytes) == (int(fine.bytes) // 16, int(fine.bytes) // 8)
    ring = testbed_scenario(result(layout="fine", exchange="auto"), None, "gradlane").jobs[0]
    assert ring.ring and not fine.ring and ring.chunk_bytes == int(fine.bytes) // 48
    # Groups close at 64 KiB (fine) or 4 MiB (coarse), and at a band's end: VGG-19's
    # first quarter of layers (band 0 of four) holds under 64 KiB, so gradlane's first group
    # ends there, fifo's (one band) goes on.
    assert len(coarse.buckets) < len(fine.buckets)
    assert fine.buckets[0].bytes < MIN_GROUP_BYTES <= fifo.buckets[0].bytes
    layers = trace_layers("vgg19", 10, 50, None)
    assert fine.buckets == shim_buckets(layers, 4)[0]  # the shim's four bands
    assert fifo.buckets == shim_buckets(layers, 4, bands=1)[0]
    # (VGG-19's groups happen to end where two bands would; ResNet-50's do not.)
    resnet = {**workload, "model": "resnet50"}
    one_band = testbed_scenario({**result(), "scenario": {"name": "x", "hosts": 4,
                                                          "workload": resnet}}, None, "fifo")
    layers = trace_layers("resnet50", 10, 50, None)
    assert one_band.jobs[0].buckets == shim_buckets(layers, 4, bands=1)[0] != \
        shim_buckets(layers, 4, bands=2)[0]
    assert fine.bytes == pytest.approx(coarse.bytes) == pytest.approx(fifo.bytes)


def test_same_scenario_same_result() -> None:
    sc = cluster(hosts=64, hosts_per_leaf=16, jobs=4, iterations=2)  # jobs share uplinks
    a = simulate(sc, get_policy("gradlane")).to_json()
    b = simulate(sc, get_policy("gradlane")).to_json()
    for key in ("iteration_s", "cct_s", "utilization", "simulated_s"):
        assert a[key] == b[key]


class _Checked(Policy):
    """Wraps a policy and checks every plan it makes during a simulation."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name, self.plans = inner, inner.name, 0

    def plan(self, state: State) -> Plan:
        plan = self.inner.plan(state)
        assert check_plan(state, plan) == []
        self.plans += 1
        return plan


@pytest.mark.parametrize("name", ["fifo", "coflow", "gradlane"])
def test_every_plan_made_during_a_cluster_run_is_valid(name: str) -> None:
    sc = cluster(hosts=64, hosts_per_leaf=16, jobs=4, iterations=3)
    policy = _Checked(get_policy(name))
    result = simulate(sc, policy)
    assert policy.plans > 3
    assert set(result.iteration_s) == {j.name for j in sc.jobs}
    assert all(len(v) == 3 and min(v) > 0 for v in result.iteration_s.values())
    assert 0 < result.utilization["host"] <= 1 and 0 < result.utilization["uplink"] <= 1


def test_straggler_brings_the_heterogeneous_job_within_1_1x_of_ideal() -> None:
    """The ideal: the global batch over the summed throughputs (4 workers' batches at
    speeds 1, 1, 1, 0.5: 4 / 3.5 of one worker's compute), plus the all-reduce's
    2 (W-1) / W model sizes at the 10 Gbit/s line rate."""
    from gradlane.simulation import run_heterogeneous

    (job,) = heterogeneous().jobs
    result = run_heterogeneous(("fifo", "straggler"))
    assert result["ideal_compute_s"] == pytest.approx(job.compute_s * 4 / 3.5)
    assert result["ideal_comm_s"] == pytest.approx(1.5 * job.bytes * 8 / 10e9)
    ideal = result["ideal_compute_s"] + result["ideal_comm_s"]
    assert result["ideal_s"] == pytest.approx(ideal)
    straggler, fifo = (result["results"][p]["mean_iteration_s"] for p in ("straggler", "fifo"))
    assert result["over_ideal"]["straggler"] == pytest.approx(straggler / ideal)
    assert straggler <= 1.1 * ideal
    assert straggler < fifo  # even shares wait for the slow worker


def test_coflow_order_serves_the_smaller_job_first_on_a_shared_link() -> None:
    # Two 2-worker jobs on one 4-host switch share nothing: ordering changes nothing.
    # Put both jobs' workers behind one shared uplink instead: 2 leaves, 1 Gbit/s spine.
    sc = cluster(hosts=64, hosts_per_leaf=32, jobs=2, group=8, nic_bps=G,
                 oversubscription=8.0, iterations=3)
    fair = simulate(sc, get_policy("fair"))
    coflow = simulate(sc, get_policy("coflow"))
    small = min(sc.jobs, key=lambda j: j.bytes * j.workers).name
    assert sum(coflow.cct_s[small]) < sum(fair.cct_s[small])


def test_open_loop_coflow_takes_its_exchange_time_and_waits_for_the_one_before() -> None:
    # One bucket of S on 2 workers: a coflow alone takes S * 8 / G (each sends S/2 and
    # receives S/2 of the result... one flow each way per rank: S bits per link).
    size = 10e6
    base = _one_job([(size, 0.01, 0.02)])
    exchange = size * 8 / G
    # Two coflows 0.1 exchange apart: the second waits for the first; the third is alone.
    sc = replace(base, arrivals=((0.0, 0.1 * exchange, 10 * exchange),), warmup=0)
    result = simulate(sc, get_policy("fair"))
    assert result.iteration_s == {} and result.to_json()["mean_iteration_s"] is None
    first, second, third = result.cct_s["job0-x"]
    assert first == pytest.approx(exchange, rel=1e-6)
    assert second == pytest.approx(1.9 * exchange, rel=1e-6)
    assert third == pytest.approx(exchange, rel=1e-6)


def _levels(jobs: int, levels: dict[str, int], band_one: str) -> tuple[Result, float]:
    """`jobs` 2-worker jobs j0, j1, ... on the same two hosts, one bucket each, released
    at once on two bands, at the job `levels` given, `band_one`'s flows in band 1: the
    run, and one job's exchange alone."""
    size = 10e6
    base = _one_job([(size, 0.01, 0.02)])
    named = tuple(replace(base.jobs[0], name=f"j{i}") for i in range(jobs))
    sc = replace(base, jobs=named, bands=2, arrivals=((0.0,),) * jobs, warmup=0)

    def fields(state: State) -> dict[str, Any]:
        job = np.array([state.coflows[k].job for k in state.flows.coflow])
        return {"job_level": levels, "flow_band": (job == band_one).astype(np.int64)}

    return simulate(sc, _FifoWith(fields)), size * 8 / G


def test_each_job_s_band_is_a_queue_of_its_own() -> None:
    # Job 0's band 1 and job 2's band 0 (level 1) both sit at HTB prio 1: as two queues
    # they share the links and finish together at 2 exchanges (one queue would serve them
    # one after the other: 1 and 2). Job 1, at level 5, goes last.
    result, exchange = _levels(3, {"j0": 0, "j1": 5, "j2": 1}, band_one="j0")
    assert result.cct_s["j0"] == pytest.approx([2 * exchange], rel=1e-6)
    assert result.cct_s["j2"] == pytest.approx([2 * exchange], rel=1e-6)
    assert result.cct_s["j1"] == pytest.approx([3 * exchange], rel=1e-6)


def test_priorities_past_the_last_level_share_it() -> None:
    # HTB has 8 prios: job level 7 in band 1 is prio min(7, 8) = 7, as level 7 in band 0.
    # The two jobs share the links (both through at 2 exchanges), neither goes first.
    result, exchange = _levels(2, {"j0": 7, "j1": 7}, band_one="j1")
    for name in ("j0", "j1"):
        assert result.cct_s[name] == pytest.approx([2 * exchange], rel=1e-6)


class _Recording:
    def __init__(self, inner: Policy) -> None:
        self.inner, self.name = inner, inner.name
        self.states: list[State] = []

    def plan(self, state: State) -> Plan:
        self.states.append(state)
        return self.inner.plan(state)


def test_open_loop_backlog_is_one_coflow_per_arrival_each_with_its_age() -> None:
    # What the planner sees while the second coflow waits behind the first: two coflows,
    # the older partly sent, the younger whole (not one big coflow as young as the newest).
    size = 10e6
    base = _one_job([(size, 0.01, 0.02)])
    exchange = size * 8 / G
    policy = _Recording(get_policy("coflow"))
    simulate(replace(base, arrivals=((0.0, 0.1 * exchange),), warmup=0), policy)
    both = [s for s in policy.states if len(s.coflows) == 2]
    assert both, [len(s.coflows) for s in policy.states]
    state = both[0]
    older, younger = state.coflows
    assert (older.id, younger.id) == ("job0-x/0", "job0-x/1")
    assert older.age_s == pytest.approx(younger.age_s + 0.1 * exchange, rel=1e-6)
    sent = [float(state.flows.bytes[state.flows.coflow == k].sum()) for k in (0, 1)]
    assert 0 < sent[0] < sent[1]  # the older one is partly through, the younger whole
    # A departure plans again too, react_s after the last plan (the arrival's, itself
    # react_s after the first): the younger alone, aged since it came.
    alone = [s.coflows for s in policy.states if [c.id for c in s.coflows] == ["job0-x/1"]]
    assert alone and alone[0][0].age_s == pytest.approx(2 * base.react_s - 0.1 * exchange)
    assert check_plan(state, get_policy("coflow").plan(state)) == []


def _bucket_bytes(state: State, coflow: int) -> np.ndarray:
    """A coflow's demand per bucket (its flows carry their bucket's first chunk)."""
    (job,) = state.jobs
    mine = state.flows.coflow == coflow
    bucket = np.array(job.chunk_layers)[state.flows.chunk[mine]]
    return np.bincount(bucket, state.flows.bytes[mine], job.layers)


@pytest.mark.parametrize("ring", [False, True])
def test_closed_loop_planner_sees_what_is_left_of_each_bucket(ring: bool) -> None:
    # Six buckets of 4 chunks on 3 workers, 30 ms of backward each: the last bucket's
    # exchange starts while the others are still computed. Every plan made while a coflow
    # is in flight sees each of its buckets at most whole, partly sent once queued, and
    # whole while still in the backward (ready 30 ms apart, last bucket first).
    c, bwd, nb = 1e6, 0.03, 6
    sc = _one_job([(4 * c, 0.001, bwd)] * nb, 3)
    sc = replace(sc, jobs=(replace(sc.jobs[0], chunk_bytes=int(c), ring=ring),),
                 iterations=2, warmup=0)
    whole = _bucket_bytes(full_demand_state(sc, get_policy("fifo")), 0)
    policy = _Recording(get_policy("fifo"))
    simulate(sc, policy)
    in_flight = [s for s in policy.states if s.coflows[0].age_s > 0]
    assert in_flight
    for state in in_flight:
        (coflow,) = state.coflows
        left = _bucket_bytes(state, 0) / whole
        computing = [nb - 1 - k for k in range(nb) if k * bwd > coflow.age_s]
        assert computing, coflow.age_s  # the plan comes while the backward goes on
        assert np.all(left <= 1 + 1e-9), left
        assert left[computing] == pytest.approx(1.0)
        assert 0 < left[nb - 1] < 1  # the first bucket ready is on its way


def test_coflow_load_matches_the_simulated_time_alone() -> None:
    sc = cluster(hosts=64, hosts_per_leaf=32, jobs=2, group=8, nic_bps=G, iterations=1)
    load, alone = coflow_load(sc)
    assert load.shape == (2, len(sc.topology.capacity_bps))
    for i, job in enumerate(sc.jobs):
        one = replace(sc, jobs=(job,), arrivals=((0.0,),), warmup=0)
        (cct,) = simulate(one, get_policy("fair")).cct_s[job.name]
        # Released at once, a coflow takes its busiest link's time: every link serves its
        # part on its own. `coflow_load` owns chunks as at the start (bytes balanced), `fair`
        # round-robin, which puts 0.5% (ResNet-50) and 1.8% (GPT-2) more on the busiest link.
        assert alone[i] == pytest.approx(load[i].max())
        assert alone[i] <= cct <= 1.02 * alone[i]


def test_open_loop_arrivals_are_checked() -> None:
    base = _one_job([(1e6, 0.01, 0.02)])
    with pytest.raises(ConfigError, match="arrivals"):
        replace(base, arrivals=((0.2, 0.1),))
    with pytest.raises(ConfigError, match="arrivals"):
        replace(base, arrivals=((0.1,), (0.2,)))


def test_full_demand_state_gives_every_job_a_coflow() -> None:
    sc = cluster(hosts=128, hosts_per_leaf=32, jobs=4)
    state = full_demand_state(sc, get_policy("fifo"))
    assert {c.job for c in state.coflows} == {j.name for j in sc.jobs}
    assert len(state.flows) > 0 and check_plan(state, get_policy("gradlane").plan(state)) == []


def test_buckets_group_layers_and_keep_totals() -> None:
    layers = [(1.0, 0.1, 0.2), (0.0, 0.1, 0.2), (8.0, 0.1, 0.2), (1.0, 0.1, 0.2)]
    buckets = buckets_of(layers, 2)
    assert sum(b.bytes for b in buckets) == 10.0
    assert sum(b.forward_s for b in buckets) == pytest.approx(0.4)
    assert sum(b.backward_s for b in buckets) == pytest.approx(0.8)
    assert buckets[0].bytes == 9.0  # closes once it holds half the bytes
    even = buckets_of([(1.0, 0.1, 0.2)] * 4, 2)  # ... or exactly half
    assert [b.bytes for b in even] == [2.0, 2.0]
    # Compute-only layers at the end (a head without weights) join the last bucket.
    tail = buckets_of([(2.0, 0.1, 0.2), (2.0, 0.1, 0.2), (0.0, 0.1, 0.2), (0.0, 0.1, 0.2)], 2)
    assert [(b.bytes, b.forward_s, b.backward_s) for b in tail] == [
        (2.0, 0.1, 0.2), (2.0, pytest.approx(0.3), pytest.approx(0.6))]
    # DDP-like buckets of a 16 MiB model on 4 workers, cut into the shim's fine chunks: a
    # quarter of a worker's share, 1 MiB.
    grouped, chunk = job_buckets([(float(1 << 20), 0.1, 0.2)] * 16, 4, buckets=4)
    assert [b.bytes for b in grouped] == [4 << 20] * 4 and chunk == 1 << 20


@pytest.mark.parametrize("model, seconds", [
    ("resnet50", 0.100), ("vgg19", 0.480), ("bert_base", 0.340), ("gpt2", 0.890)])
def test_compute_follows_the_stated_calibration(model: str, seconds: float) -> None:
    """The module docstring's iteration times (a V100 at half its FP32 peak, 32 samples a
    worker, GPT-2 8 sequences, backward twice forward), from the profiles' FLOPs."""
    layers = profile_layers(model, SAMPLES_PER_WORKER.get(model, BATCH_PER_WORKER))
    forward, backward = (sum(layer[k] for layer in layers) for k in (1, 2))
    assert forward + backward == pytest.approx(seconds, rel=0.01)
    assert backward == pytest.approx(2 * forward)


def test_a_cluster_s_slow_fraction_of_host_groups_runs_at_the_slow_speed() -> None:
    half = cluster(hosts=64, jobs=4, slow_fraction=0.5, slow_speed=0.5)  # 8 groups of 8
    speeds = [s for job in half.jobs for s in job.speed]
    assert len(speeds) == 64 and speeds.count(0.5) == 32 and speeds.count(1.0) == 32
    every = cluster(hosts=64, jobs=4, slow_fraction=1.0, slow_speed=0.5)
    assert {s for job in every.jobs for s in job.speed} == {0.5}


def test_a_cluster_s_leaves_share_a_spine_and_one_leaf_has_none() -> None:
    two = cluster(hosts=64, jobs=4)  # 32 hosts a leaf at 25 Gbit/s, 2:1 oversubscribed
    assert two.topology.leaves == 2 and two.topology.uplink_bps == (400_000_000_000,) * 2
    one = cluster(hosts=32, jobs=4)
    assert one.topology.leaves == 1 and one.topology.uplink_bps == ()


def test_bad_scenarios_are_refused() -> None:
    with pytest.raises(ConfigError, match="a host per worker"):
        SimJob("j", "resnet50", (), (Bucket(1, 1, 1),), 8)
    with pytest.raises(ConfigError, match="one sample per worker"):
        SimJob("j", "resnet50", (0, 1), (Bucket(1, 1, 1),), 1)
    assert SimJob("j", "resnet50", (0, 1), (Bucket(1, 1, 1),), 2).workers == 2  # one each
    for speeds in ((1.0,), (1.0, 0.0), (1.0, -1.0)):
        with pytest.raises(ConfigError, match="one positive speed per worker"):
            SimJob("j", "resnet50", (0, 1), (Bucket(1, 1, 1),), 8, speeds=speeds)
    sc = _one_job([(1e6, 0.01, 0.02)])
    for hosts in ((0, 9), (0, 2), (-1, 0)):  # two hosts: 0 and 1
        with pytest.raises(ConfigError, match="a host outside 0..1"):
            Scenario("bad", sc.topology, (replace(sc.jobs[0], hosts=hosts),))
    for bad in ({"iterations": 0}, {"warmup": -1}, {"replan_s": 0.0}, {"react_s": -0.1}):
        with pytest.raises(ConfigError, match="need iterations >= 1, warmup >= 0"):
            replace(sc, **bad)
    assert replace(sc, iterations=1, warmup=0, react_s=0.0).iterations == 1
    with pytest.raises(ConfigError, match="whole leaves of 32, .* got 100 hosts"):
        cluster(hosts=100)
    with pytest.raises(ConfigError, match="give each of the 8 jobs a group: got 32 hosts"):
        cluster(hosts=32)  # 4 groups of 8 hosts
    for fraction, speed in ((-0.1, 0.5), (1.1, 0.5), (0.5, 0.0)):
        with pytest.raises(ConfigError, match="slow_fraction must be in 0..1"):
            cluster(hosts=64, slow_fraction=fraction, slow_speed=speed)


def test_measured_compute_is_iteration_minus_rank0s_wait_over_the_steady_steps() -> None:
    # 40 steps of 0.2 s, rank 0 waiting 0.05 s in each steady one (another rank 0.1 s):
    # the compute replayed is 0.15 s. Older results kept rank 0's series as `waited_s`.
    from gradlane.simulation import measured_compute

    times = [0.2] * 40
    waited = [0.0] * 18 + [0.05] * 22
    run = {"iteration_s": times,
           "rank_steps": [{"waited": waited}, {"waited": [0.1] * 40}]}
    assert measured_compute({"runs": {"gradlane": [run]}}, "gradlane") == pytest.approx(0.15)
    old = {"iteration_s": times, "waited_s": waited}
    assert measured_compute({"runs": {"gradlane": [old]}}, "gradlane") == pytest.approx(0.15)
    assert measured_compute({"runs": {"gradlane": [{"iteration_s": times}]}}, "gradlane") is None


@pytest.mark.parametrize(("placement", "fluid", "staged"), [
    ((0, 1), 1, 2),  # the contribution, then the average
    ((0, 1, 2, 3), 3, 6),  # three contributions into the owner, then three averages out
    ((0, 0, 1, 1), 1, 2),  # within hosts first: one copy each way crosses
])
def test_a_stored_and_forwarded_chunk_goes_up_its_tree_then_down(
    placement: tuple[int, ...], fluid: int, staged: int
) -> None:
    # One one-chunk bucket. As fluid flows its contributions and its average cross at
    # once; stored and forwarded (`store_forward`), as the shim sends a chunk whole, the
    # average leaves only once every contribution is in.
    c, fwd, bwd = 1e6, 0.01, 0.02
    sc = _co_located([(c, fwd, bwd)], placement, ring=False, chunk_bytes=int(c))
    for chunk_times, store_forward in ((fluid, False), (staged, True)):
        run = replace(sc, jobs=(replace(sc.jobs[0], store_forward=store_forward),))
        for t in simulate(run, get_policy("fifo")).iteration_s["job0-x"]:
            assert t == pytest.approx(fwd + bwd + chunk_times * c * 8 / G, rel=1e-6)


def test_a_connection_sends_waiting_buckets_in_forward_order() -> None:
    # Three one-chunk buckets on two workers, one band, ready in backward order 2, 1, 0
    # while bucket 2 is being sent. The shim's connection pops its queue by forward
    # position, so bucket 0 goes next and the next forward starts one chunk time after
    # bucket 2's; bucket 1's comes in while forward 0 runs. An iteration: bucket 2's
    # backward, three chunk times, forwards 1 and 2 (first come, first served, bucket 0
    # would wait for bucket 1's chunk too: 3 tau + 3 f + b).
    c, f, b = 1e6, 0.005, 1e-4
    tau = c * 8 / G
    sc = _one_job([(c, f, b)] * 3, 2)
    sc = replace(sc, jobs=(replace(sc.jobs[0], chunk_bytes=int(c)),))
    for t in simulate(sc, get_policy("fifo")).iteration_s["job0-x"]:
        assert t == pytest.approx(3 * tau + 2 * f + b, rel=1e-6)


def test_the_cct_ceiling_weighs_each_job_as_fair_s_mean_does() -> None:
    """`fair`'s mean CCT is over coflows, so a job whose run ended one coflow short counts
    less there; the jobs alone are weighed alike (an unweighted mean of the jobs gave 0.98x
    on 64 hosts, where no job shares a link with another and no order can gain anything)."""
    from gradlane.simulation import cct_ceiling, run_cluster

    fair = {"cct_s": {"a": [1.0, 1.0, 1.0], "b": [3.0, 3.0]}, "mean_cct_s": 9.0 / 5}
    assert cct_ceiling(fair, {"a": 1.0, "b": 3.0}) == pytest.approx(1.0)  # unweighted: 0.9
    assert cct_ceiling(fair, {"a": 0.5, "b": 1.5}) == pytest.approx(2.0)
    assert run_cluster(("fair",), seed=0, hosts=64, buckets=2)["cct_ceiling"] == \
        pytest.approx(1.0)


@pytest.mark.parametrize("nic_bps", [G, 100 * G])  # at 100G, ResNet-50's 30 coflows a second
def test_open_loop_offers_each_job_its_coflows_so_the_busiest_link_is_at_the_load(
    nic_bps: float,
) -> None:
    """Each job arrives at a rate proportional to 1 / its coflow's time alone (every job
    keeps itself the same fraction busy), scaled so that the busiest link is `load` busy
    on average; the rarest job gets about `COFLOWS_OF_RAREST` coflows, and every job its
    arrivals up to the end, however often it arrives."""
    from gradlane.simulation import COFLOWS_OF_RAREST, open_loop

    # Leaves of 16: the jobs share uplinks, so the busiest link is not any job's alone.
    base = cluster(hosts=64, hosts_per_leaf=16, jobs=4, group=8, nic_bps=nic_bps,
                   iterations=1)
    seconds, alone = coflow_load(base)
    assert float((seconds / alone[:, None]).sum(axis=0).max()) > 1.05
    sc = open_loop(base, 0.6, seed=3)
    rate = np.array([sc.notes["arrivals_per_s"][j.name] for j in base.jobs])
    assert [sc.notes["coflow_alone_s"][j.name] for j in base.jobs] == pytest.approx(alone)
    assert rate * alone == pytest.approx(np.full(len(rate), rate[0] * alone[0]))
    assert float((seconds * rate[:, None]).sum(axis=0).max()) == pytest.approx(0.6)
    assert sc.notes["horizon_s"] == pytest.approx(COFLOWS_OF_RAREST / rate.min())
    for times, r in zip(sc.arrivals, rate, strict=True):
        horizon = sc.notes["horizon_s"]
        assert list(times) == sorted(times) and times[0] > 0 and times[-1] < horizon
        # Poisson: within 4 standard deviations, and arriving until the end (no arrival in
        # the last quarter has odds of exp(-6) for the rarest job).
        expected = r * horizon
        assert abs(len(times) - expected) < 4 * expected**0.5 + 1
        assert times[-1] > 0.75 * horizon
    assert open_loop(base, 0.6, seed=3).arrivals == sc.arrivals  # the seed decides them
    assert open_loop(base, 0.6, seed=4).arrivals != sc.arrivals


def test_a_job_is_growing_when_its_later_coflows_took_over_1_5x_its_earlier_ones() -> None:
    from gradlane.simulation import growing_jobs

    cct_s = {
        "grew": [1.0, 1.0, 2.0, 2.0],
        "steady": [1.0, 1.0, 1.4, 1.4],
        "at_the_factor": [1.0, 1.0, 1.5, 1.5],  # not more than 1.5x
        "odd": [1.0, 1.0, 3.0],  # halves [1.0] and [1.0, 3.0]
        "one": [5.0],  # no halves to compare
        "shrank": [2.0, 2.0, 1.0, 1.0],
        "late": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0],  # halves of three: 1 and 5/3
    }
    assert growing_jobs(cct_s) == ["grew", "odd", "late"]
    assert growing_jobs(cct_s, factor=1.2) == ["grew", "steady", "at_the_factor", "odd", "late"]


def test_a_control_run_replays_the_layout_its_trial_kept_or_fine() -> None:
    from gradlane.simulation import _kept

    assert _kept({"layout_trial": {"chosen": "coarse"}}) == "coarse"
    assert _kept({"layout_trial": {"chosen": None}}) == "fine"  # the trial never ended
    assert _kept({"layout_trial": None}) == "fine"
    assert _kept({}) == "fine"  # results from before the trial


def test_validate_skips_the_control_runs_that_predate_their_recorded_waits(
        tmp_path: Path) -> None:
    """A run without its waits (or a result without gradlaned's line rates) has no
    compute to replay with: left out, the others kept."""
    from gradlane.simulation import run_validate

    measured = json.loads((REPO / "bench/results/slow_link.json").read_text())
    del measured["with_control"]["waited_s"]
    (tmp_path / "slow_link.json").write_text(json.dumps(measured))
    rows = run_validate(tmp_path)["rows"]
    assert [(r["scenario"], r["system"]) for r in rows] == [("control-slow-link", "gradlane")]
    del measured["daemon_line_bps"]
    (tmp_path / "slow_link.json").write_text(json.dumps(measured))
    with pytest.raises(ConfigError, match="no trace-scenario results"):
        run_validate(tmp_path)
    (tmp_path / "slow_link.json").unlink()
    # The two-NIC runs keep their waits and line rates each.
    measured = json.loads((REPO / "bench/results/two_nics.json").read_text())
    del measured["runs"]["gradlane, one NIC"]["waited_s"]
    del measured["runs"]["gradlane, two NICs"]["daemon_line_bps"]
    (tmp_path / "two_nics.json").write_text(json.dumps(measured))
    rows = run_validate(tmp_path)["rows"]
    assert [r["system"] for r in rows] == [measured["uneven"]["label"]]


def test_each_experiment_runs_every_policy_it_compares_unless_told_which(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gradlane import simulation

    ran: list[tuple[str, tuple[str, ...]]] = []
    for name in ("cluster", "coflows", "heterogeneous"):
        monkeypatch.setattr(simulation, f"run_{name}",
                            lambda policies, *a, name=name, **kw: ran.append((name, policies)))
    for name in ("cluster", "coflows", "heterogeneous"):
        simulation.run_experiment(name)
        simulation.run_experiment(name, policies=("fifo",))
    assert ran == [
        ("cluster", simulation.CLUSTER_POLICIES), ("cluster", ("fifo",)),
        ("coflows", ("fair", "coflow")), ("coflows", ("fifo",)),
        ("heterogeneous", ("fifo", "priority", "straggler", "gradlane")),
        ("heterogeneous", ("fifo",))]
    assert simulation.CLUSTER_POLICIES == (
        "fifo", "fair", "priority", "coflow", "loadbalance", "straggler", "gradlane")
