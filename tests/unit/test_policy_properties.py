"""Property tests: for random cluster states, every policy's plan is valid and deterministic.

Valid means what `check_plan` checks: every flow has a band and a finite
non-negative rate, no link is over capacity, each chunk is owned exactly
once by a rank of its job, batch shares sum to the global batch with each
>= 1, the coflow order is a permutation, the version is the state's.
"""

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gradlane.policies import (
    Coflow,
    FlowTable,
    Host,
    JobState,
    State,
    Topology,
    Worker,
    check_plan,
    get_policy,
    policy_names,
)
from tests import examples

RATES = [100_000_000, 1_000_000_000, 10_000_000_000, 25_000_000_000]


@st.composite
def cluster_states(draw: st.DrawFn) -> State:
    n_hosts = draw(st.integers(2, 24))
    n_leaves = draw(st.integers(1, 4))
    hosts = tuple(
        Host(f"h{i}", draw(st.integers(0, n_leaves - 1)) if n_leaves > 1 else 0,
             draw(st.sampled_from(RATES)))
        for i in range(n_hosts)
    )
    leaves = max(h.leaf for h in hosts) + 1
    uplinks = tuple(draw(st.sampled_from(RATES)) for _ in range(leaves)) if leaves > 1 else ()
    topo = Topology(hosts, uplinks)
    jobs, workers, coflows, rows = [], [], [], []
    for j in range(draw(st.integers(1, 4))):
        name = f"job{j}"
        placed = draw(st.lists(st.integers(0, n_hosts - 1), min_size=1, max_size=8, unique=True))
        chunks = tuple(draw(st.lists(st.integers(1, 1 << 24), max_size=30)))
        jobs.append(JobState(name, len(placed), global_batch=draw(st.integers(0, 256)),
                             chunk_bytes=chunks, layers=draw(st.integers(0, 12))))
        for rank, host in enumerate(placed):
            workers.append(Worker(name, rank, host,
                                  throughput=draw(st.sampled_from([0.0, 0.5, 1.0, 3.7, 100.0]))))
        for _ in range(draw(st.integers(0, 2))):
            k = len(coflows)
            coflows.append(Coflow(f"{name}/{k}", name))
            top = max(0, len(chunks) - 1)
            drawn = draw(st.lists(st.tuples(
                st.integers(0, len(placed) - 1), st.integers(0, len(placed) - 1),
                st.integers(1, 1 << 28), st.floats(0, 1), st.integers(0, top)), max_size=25))
            rows += [(placed[s], placed[d], float(b), r, p, k, p if chunks else -1)
                     for s, d, b, r, p in drawn if s != d]
    return State(
        jobs=tuple(sorted(jobs, key=lambda j: j.name)),
        topology=topo,
        workers=tuple(workers),
        coflows=tuple(coflows),
        flows=FlowTable.build(rows),
        bands=draw(st.integers(1, 8)),
        version=draw(st.integers(0, 1000)),
    )


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_states(), st.sampled_from(policy_names()))
def test_every_plan_is_valid_and_deterministic(state: State, name: str) -> None:
    plan = get_policy(name).plan(state)
    assert check_plan(state, plan) == []
    assert plan.source == name
    assert plan.to_wire() == get_policy(name).plan(state).to_wire()


@settings(max_examples=examples(100), deadline=None)
@given(cluster_states())
def test_work_conserving_policies_leave_no_bottleneck_idle(state: State) -> None:
    """Every flow with bytes crosses at least one link that `coflow`/`gradlane` fill."""
    from gradlane.policies import fabric

    assert state.topology is not None
    if not len(state.flows):
        return
    cap = state.topology.capacity_bps
    links = state.flow_links
    for name in ("coflow", "gradlane"):
        rates = get_policy(name).plan(state).flow_rate_bps
        used = fabric.link_sum(links, rates, len(cap))
        full = used >= cap * (1 - 1e-6)
        padded = np.append(full, False)
        assert padded[links].any(axis=1).all(), name


def _max_min_per_flow(links, capacity, residual, members, rounds=64):  # type: ignore[no-untyped-def]
    """`fabric.max_min` as it was before it ran on distinct sets of links: one row per flow."""
    from gradlane.policies import fabric

    rates = np.zeros(len(members))
    if len(members) == 0:
        return rates
    sub = links[members]
    residual = residual.copy()
    active = np.arange(len(members))
    eps = capacity * 1e-9
    for _ in range(rounds):
        add = fabric.equal_split(sub, capacity, residual, active)
        rates[active] += add
        residual = np.maximum(residual - fabric.link_sum(sub[active], add, len(capacity)), 0.0)
        full = np.append(residual <= eps, False)
        active = active[~full[sub[active]].any(axis=1)]
        if len(active) == 0 or add.max(initial=0.0) <= 0:
            break
    return rates


def _host_classes_per_host(state, rates, job_level):  # type: ignore[no-untyped-def]
    """`fabric.host_classes` as it was before it was vectorized: a loop over hosts."""
    from gradlane.policies.base import JobClassPlan
    from gradlane.policies.fabric import MIN_CLASS_SHARE

    nic = [h.nic_bps for h in state.topology.hosts]
    job_of_coflow = [c.job for c in state.coflows]
    out, egress, jobs_on = {}, {}, {}
    if len(state.flows):
        keys = state.flows.src * max(1, len(state.coflows)) + state.flows.coflow
        uniq, inverse = np.unique(keys, return_inverse=True)
        sums = np.bincount(inverse, weights=rates)
        for key, total in zip(uniq.tolist(), sums.tolist(), strict=True):
            host, coflow = divmod(key, max(1, len(state.coflows)))
            job = job_of_coflow[coflow]
            egress[host, job] = egress.get((host, job), 0.0) + total
    for w in state.workers:
        jobs_on.setdefault(w.host, set()).add(w.job)
    for host, jobs in jobs_on.items():
        floor = nic[host] * MIN_CLASS_SHARE
        want = {job: egress.get((host, job), nic[host] / len(jobs) * 0.999) for job in jobs}
        asked = sum(want.values())
        scale = min(1.0, (nic[host] - floor * len(jobs)) / asked) if asked > 0 else 0.0
        out[host] = {
            job: JobClassPlan(rate_bps=max(1, int(floor + want[job] * scale)),
                              ceil_bps=nic[host], prio=job_level.get(job, 0))
            for job in sorted(jobs)
        }
    return out


@settings(max_examples=examples(100), deadline=None)
@given(cluster_states(), st.randoms(use_true_random=False))
def test_link_arithmetic_is_the_per_flow_arithmetic(state: State, rnd) -> None:  # type: ignore[no-untyped-def]
    """max_min and banded_rates on distinct rows of links, host_classes vectorized: the
    rates and classes of the loops over flows and hosts they were."""
    from gradlane.policies import fabric
    from gradlane.policies.priority import banded_rates

    assert state.topology is not None
    cap = state.topology.capacity_bps
    links = state.flow_links
    members = np.flatnonzero([rnd.random() < 0.7 for _ in range(len(state.flows))])
    residual = cap * np.array([rnd.choice([0.0, 0.3, 1.0]) for _ in cap])
    for m, r in ((np.arange(len(state.flows)), cap), (members, residual)):
        got = fabric.max_min(links, cap, r, m)
        assert np.allclose(got, _max_min_per_flow(links, cap, r, m), rtol=1e-9, atol=1e-3)
    bands = np.array([rnd.randrange(state.bands) for _ in range(len(state.flows))], np.int64)
    residual, banded = cap.copy(), np.zeros(len(state.flows))
    for band in range(state.bands):
        m = np.flatnonzero(bands == band)
        banded[m] = _max_min_per_flow(links, cap, residual, m)
        residual = np.maximum(residual - fabric.link_sum(links[m], banded[m], len(cap)), 0.0)
    assert np.allclose(banded_rates(state, bands), banded, rtol=1e-9, atol=1e-3)
    rates = get_policy("fair").plan(state).flow_rate_bps
    level = {job.name: rnd.randrange(8) for job in state.jobs}
    got = fabric.host_classes(state, rates, level)
    want = _host_classes_per_host(state, rates, level)
    assert got.keys() == want.keys()
    for host, classes in want.items():
        assert got[host].keys() == classes.keys()
        for job, c in classes.items():
            g = got[host][job]
            assert (g.ceil_bps, g.prio) == (c.ceil_bps, c.prio)
            assert abs(g.rate_bps - c.rate_bps) <= 1  # sums in another order


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 4).flatmap(lambda width: st.lists(
    st.lists(st.integers(-3, 40) | st.integers(-(2**40), 2**40), min_size=width,
             max_size=width), max_size=30)))
@example([[2**32, 0], [0, 2**32]])  # spans past 2**64 that wrap onto one key if packed
def test_distinct_rows_are_numpy_s_distinct_rows(rows: list[list[int]]) -> None:
    """Rows packed into one integer each (or, spans too wide, compared as rows) group as
    numpy's own distinct rows do: one group per distinct row, every row in its own."""
    from gradlane.policies import fabric

    table = np.array(rows, np.int64).reshape(len(rows), -1 if rows else 1)
    first, inverse, counts = fabric.distinct_rows(*table.T)
    assert len(first) == len(counts) == len(np.unique(table, axis=0))
    assert (table[first[inverse]] == table).all()  # each row is its group's row
    assert np.bincount(inverse, minlength=len(counts)).tolist() == counts.tolist()
    assert len({tuple(table[f]) for f in first}) == len(first)  # groups differ


def test_max_min_on_link_numbers_too_large_to_pack() -> None:
    """Rows whose link numbers cannot be packed into one integer are told apart as rows."""
    from gradlane.policies import fabric

    n = 1 << 17  # each column spans almost n: n ** 4 > 2 ** 63
    cap = np.full(n, 1e9)
    links = np.array([[0, 1, 2, n - 1], [n - 2, n - 3, n - 4, 3], [0, 1, 2, n - 1]])
    got = fabric.max_min(links, cap, cap, np.arange(3))
    assert np.allclose(got, _max_min_per_flow(links, cap, cap, np.arange(3)))
    assert np.allclose(got, [0.5e9, 1e9, 0.5e9])
