"""What a valid plan is, checked: `check_plan(state, plan)` lists every violation.

Used by the property tests, and by whoever receives a plan it did not
compute (a daemon from the control plane) before enforcing it.
"""

from __future__ import annotations

import numpy as np

from gradlane.policies import fabric
from gradlane.policies.base import LEVELS, Plan, State

__all__ = ["check_plan"]

SLACK = 1e-6  # relative rounding allowed on link sums


def check_plan(state: State, plan: Plan) -> list[str]:
    """Every way `plan` is not a valid plan for `state` (empty: valid)."""
    problems: list[str] = []
    if plan.version != state.version:
        problems.append(f"plan version {plan.version} is not the state's {state.version}")
    if not plan.ttl_s > 0:
        problems.append(f"time-to-live {plan.ttl_s} is not positive")
    if not state.cluster:
        for job in state.jobs:
            cls = plan.job_classes.get(job.name)
            if cls is None:
                problems.append(f"job {job.name} has no class")
            elif not (0 < cls.rate_bps <= cls.ceil_bps <= max(state.shaped_bps, cls.rate_bps)
                      and 0 <= cls.prio < LEVELS):
                problems.append(f"job {job.name}: bad class {cls}")
        return problems
    assert state.topology is not None
    n = len(state.flows)
    if len(plan.flow_band) != n or len(plan.flow_rate_bps) != n:
        problems.append(f"{n} flows but {len(plan.flow_band)} bands, "
                        f"{len(plan.flow_rate_bps)} rates")
        return problems
    if n and (plan.flow_band.min() < 0 or plan.flow_band.max() >= state.bands):
        problems.append(f"a band outside 0..{state.bands - 1}")
    rates = plan.flow_rate_bps
    if n and not (np.all(np.isfinite(rates)) and rates.min() >= 0):
        problems.append("a flow rate is negative or not finite")
    cap = state.topology.capacity_bps
    used = fabric.link_sum(state.flow_links, rates, len(cap))
    over = np.flatnonzero(used > cap * (1 + SLACK))
    if len(over):
        problems.append(f"{len(over)} links over capacity, e.g. link {over[0]}: "
                        f"{used[over[0]]:.0f} > {cap[over[0]]:.0f} bit/s")
    for host, classes in plan.host_classes.items():
        total = sum(c.rate_bps for c in classes.values())
        nic = state.topology.hosts[host].nic_bps
        if total > nic * (1 + SLACK) + len(classes):
            problems.append(f"host {host}: job classes sum to {total} > NIC {nic}")
        if any(not 0 <= c.prio < LEVELS or c.rate_bps > c.ceil_bps for c in classes.values()):
            problems.append(f"host {host}: a class has a bad prio or rate above ceil")
    ids = [c.id for c in state.coflows]
    if sorted(plan.coflow_order) != sorted(ids):
        problems.append("the coflow order is not a permutation of the coflows")
    for job in state.jobs:
        ranks = {w.rank for w in state.workers_of(job.name)}
        if not 0 <= plan.job_level.get(job.name, -1) < LEVELS:
            problems.append(f"job {job.name}: no level in 0..{LEVELS - 1}")
        if job.chunk_bytes and ranks:
            owners = plan.ownership.get(job.name)
            if owners is None or len(owners) != len(job.chunk_bytes):
                problems.append(f"job {job.name}: not every chunk has exactly one owner")
            elif not set(owners) <= ranks:
                problems.append(f"job {job.name}: a chunk owned by a rank not in the job")
        if ranks and job.global_batch >= len(ranks):
            shares = plan.batch_shares.get(job.name)
            if shares is None or len(shares) != len(ranks):
                problems.append(f"job {job.name}: no batch share per worker")
            elif sum(shares) != job.global_batch or min(shares) < 1:
                problems.append(f"job {job.name}: shares {shares} do not sum to "
                                f"{job.global_batch} with each >= 1")
    return problems
