"""Link arithmetic shared by the policies: loads, feasible rates, MADD.

Everything is vectorized over the state's `FlowTable`: a flow crosses up to
four links (`Topology.links`), and per-link sums are one `np.bincount`.
"""

from __future__ import annotations

import numpy as np

from gradlane.policies.base import FloatArray, IntArray, JobClassPlan, State, Topology

__all__ = [
    "MIN_CLASS_SHARE",
    "equal_split",
    "flow_links",
    "host_classes",
    "link_sum",
    "madd",
    "max_min",
    "oversubscribed",
    "per_coflow_link_load",
]

MIN_CLASS_SHARE = 0.001  # of the host's NIC: the least a job class is guaranteed (`host_classes`)


def oversubscribed(topology: Topology | None) -> bool:
    """Whether some leaf's hosts can send more than its uplink carries.

    Then every byte kept off the spine counts, and shims should reduce each
    chunk within each leaf first (`Plan.reduce_in_leaf`); on a non-blocking
    fabric the extra hop would only add latency.
    """
    if topology is None or not topology.uplink_bps:
        return False
    nic = np.zeros(topology.leaves)
    np.add.at(nic, topology.host_leaf, [h.nic_bps for h in topology.hosts])
    return bool(np.any(nic > np.asarray(topology.uplink_bps)))


def flow_links(state: State) -> IntArray:
    """The ``(n, 4)`` link array of the state's flows.

    An unused column holds ``n_links``: a null link past the real ones, so
    per-link sums are one `np.bincount` with no masking (its entry is dropped)
    and per-link lookups pad one value (+inf capacity, never full).
    """
    assert state.topology is not None
    links = state.topology.links(state.flows.src, state.flows.dst)
    links[links < 0] = len(state.topology.capacity_bps)
    return links


def link_sum(links: IntArray, values: FloatArray, n_links: int) -> FloatArray:
    """Per link, the sum of `values` over the flows crossing it."""
    sums = np.bincount(links.ravel(), weights=np.repeat(values.astype(np.float64), links.shape[1]),
                       minlength=n_links + 1)
    return np.asarray(sums[:n_links], dtype=np.float64)


def _tightest(links: IntArray, per_link: FloatArray) -> FloatArray:
    """Per flow, the minimum of `per_link` over its links."""
    padded = np.append(per_link, np.inf)  # the null link -> +inf
    return np.asarray(padded[links].min(axis=1), dtype=np.float64)


def equal_split(
    links: IntArray, capacity: FloatArray, residual: FloatArray, members: IntArray
) -> FloatArray:
    """Rates for flows `members`: each gets its tightest link's residual / flow count.

    What per-flow fair sharing (TCP) gives before any redistribution. Never
    oversubscribes a link: a link with ``n`` member flows gives each at most
    ``residual / n``. Returns rates aligned with `members`.
    """
    if len(members) == 0:
        return np.zeros(0)
    sub = links[members]
    count = link_sum(sub, np.ones(len(members)), len(capacity))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(count > 0, residual / count, np.inf)
    return np.maximum(_tightest(sub, share), 0.0)


def max_min(
    links: IntArray, capacity: FloatArray, residual: FloatArray, members: IntArray,
    rounds: int = 64,
) -> FloatArray:
    """Max-min fair rates for flows `members` on `residual` (progressive filling).

    1. Every active flow gets its tightest link's residual / active flows there
       (`equal_split`: never oversubscribes).
    2. Flows that now cross a full link stop; the others repeat on what is left.
    Each round fills at least the link with the smallest fair share, so this
    ends with every flow crossing a full link (work conserving) within
    `rounds` on all but adversarial inputs. Returns rates aligned with `members`.
    """
    rates = np.zeros(len(members))
    if len(members) == 0:
        return rates
    sub = links[members]
    residual = residual.copy()
    active = np.arange(len(members))
    eps = capacity * 1e-9
    for _ in range(rounds):
        add = equal_split(sub, capacity, residual, active)
        rates[active] += add
        residual = np.maximum(residual - link_sum(sub[active], add, len(capacity)), 0.0)
        full = np.append(residual <= eps, False)  # the null link is never full
        active = active[~full[sub[active]].any(axis=1)]
        if len(active) == 0 or add.max(initial=0.0) <= 0:
            break
    return rates


def madd(
    links: IntArray, bytes_: FloatArray, residual: FloatArray, members: IntArray
) -> FloatArray:
    """Varys' MADD for one coflow: rates that make all its flows finish together.

    1. The coflow's effective bottleneck time is
       ``gamma = max over links of (its bytes on the link / residual capacity)``.
    2. Each flow gets ``bytes / gamma``: the slowest-possible rate that still
       finishes at ``gamma``, leaving the rest of every link to later coflows.
    A coflow whose links are already full gets zero (it waits its turn).
    """
    if len(members) == 0:
        return np.zeros(0)
    sub = links[members]
    load = link_sum(sub, bytes_[members] * 8.0, len(residual))
    with np.errstate(divide="ignore", invalid="ignore"):
        times = np.where(load > 0, load / np.maximum(residual, 0.0), 0.0)
    gamma = float(np.max(times)) if len(times) else 0.0
    if not np.isfinite(gamma) or gamma <= 0:
        return np.zeros(len(members))
    return np.asarray(bytes_[members] * 8.0 / gamma, dtype=np.float64)


def per_coflow_link_load(state: State, links: IntArray) -> FloatArray:
    """A ``(coflows, links)`` matrix of seconds: each coflow's bits on a link / its capacity."""
    assert state.topology is not None
    cap = state.topology.capacity_bps
    span, k = len(cap) + 1, len(state.coflows)  # + the null link
    flat = (state.flows.coflow[:, None] * span + links).ravel()
    bits = np.repeat(state.flows.bytes * 8.0, links.shape[1])
    load = np.bincount(flat, weights=bits, minlength=k * span).reshape(k, span)[:, :-1]
    return np.asarray(load / cap[None, :], dtype=np.float64)


def host_classes(
    state: State, rates: FloatArray, job_level: dict[str, int]
) -> dict[int, dict[str, JobClassPlan]]:
    """Per host, one class per job with workers there: rate = its flows' egress rates.

    The ceiling is the host's NIC (a class may borrow what others leave);
    prio is the job's coflow level. A job with no flows from the host
    (nothing known of its demand there, e.g. not all its ranks reported
    yet) asks for an equal share of the NIC among the host's jobs. Every
    class is guaranteed `MIN_CLASS_SHARE` of the NIC plus what it asks for,
    scaled down if need be so that the host's classes fit in its NIC: a
    flow's fair share at a plan's instant may be nil (higher bands fill a
    link), but a guarantee of nothing would leave a job only what others
    lend.
    """
    assert state.topology is not None
    nic = [h.nic_bps for h in state.topology.hosts]
    job_of_coflow = [c.job for c in state.coflows]
    out: dict[int, dict[str, JobClassPlan]] = {}
    egress: dict[tuple[int, str], float] = {}
    if len(state.flows):
        keys = state.flows.src * max(1, len(state.coflows)) + state.flows.coflow
        uniq, inverse = np.unique(keys, return_inverse=True)
        sums = np.bincount(inverse, weights=rates)
        for key, total in zip(uniq.tolist(), sums.tolist(), strict=True):
            host, coflow = divmod(key, max(1, len(state.coflows)))
            job = job_of_coflow[coflow]
            egress[host, job] = egress.get((host, job), 0.0) + total
    jobs_on: dict[int, set[str]] = {}
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
