"""Property tests: for random cluster states, every policy's plan is valid and deterministic.

Valid means what `check_plan` checks: every flow has a band and a finite
non-negative rate, no link is over capacity, each chunk is owned exactly
once by a rank of its job, batch shares sum to the global batch with each
>= 1, the coflow order is a permutation, the version is the state's.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
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
    links = fabric.flow_links(state)
    for name in ("coflow", "gradlane"):
        rates = get_policy(name).plan(state).flow_rate_bps
        used = fabric.link_sum(links, rates, len(cap))
        full = used >= cap * (1 - 1e-6)
        padded = np.append(full, False)
        assert padded[links].any(axis=1).all(), name
