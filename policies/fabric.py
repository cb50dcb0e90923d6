"""Link arithmetic shared by the policies: loads, feasible rates, MADD.

Everything is vectorized over the state's `FlowTable`: a flow crosses up to
four links (`Topology.links`), and per-link sums are one `np.bincount`.
"""

from __future__ import annotations

import math

import numpy as np

from gradlane.policies.base import FloatArray, IntArray, JobClassPlan, State, Topology

__all__ = [
    "MIN_CLASS_SHARE",
    "distinct_rows",
    "equal_split",
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
    links: IntArray, capacity: FloatArray, residual: FloatArray, members: IntArray,
    weights: FloatArray | None = None,
) -> FloatArray:
    """Rates for flows `members`: each gets its tightest link's residual / flow count.

    What per-flow fair sharing (TCP) gives before any redistribution. Never
    oversubscribes a link: a link with ``n`` member flows gives each at most
    ``residual / n``. A row of `links` may stand for several flows alike:
    `weights` (aligned with `members`) counts them. Returns rates aligned
    with `members`, per flow.
    """
    if len(members) == 0:
        return np.zeros(0)
    sub = links[members]
    count = link_sum(sub, np.ones(len(members)) if weights is None else weights, len(capacity))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(count > 0, residual / count, np.inf)
    return np.maximum(_tightest(sub, share), 0.0)


def distinct_rows(*columns: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """The distinct rows of integer `columns` (of one length): (a row index of each,
    inverse, counts).

    Row ``first[inverse[i]]`` equals row ``i``. A row is packed into one
    integer, each column offset by its least value and scaled by the spans of
    those after it, when the product of the spans fits (a sort of ``n`` keys,
    not of ``n`` rows: at 1,024 hosts a flow's links and band take 34 bits).
    """
    n = len(columns[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    low = [int(c.min()) for c in columns]
    spans = [int(c.max()) - base + 1 for c, base in zip(columns, low, strict=True)]
    if math.prod(spans) < 2 ** 63:
        keys = np.zeros(n, np.int64)
        for column, base, span in zip(columns, low, spans, strict=True):
            keys = keys * span + (column - base)
        # No first indices asked: a quicksort, not a stable one (twice as fast); any
        # row of a group stands for it.
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    else:
        _, inverse, counts = np.unique(np.column_stack(columns), axis=0, return_inverse=True,
                                       return_counts=True)
    inverse = inverse.ravel()
    first = np.empty(len(counts), np.int64)
    first[inverse] = np.arange(n)
    return first, inverse, counts


def max_min(
    links: IntArray, capacity: FloatArray, residual: FloatArray, members: IntArray,
    rounds: int = 64, weights: FloatArray | None = None,
) -> FloatArray:
    """Max-min fair rates for flows `members` on `residual` (progressive filling).

    1. Every active flow gets its tightest link's residual / active flows there
       (`equal_split`: never oversubscribes).
    2. Flows that now cross a full link stop; the others repeat on what is left.
    Each round fills at least the link with the smallest fair share, so this
    ends with every flow crossing a full link (work conserving) within
    `rounds` on all but adversarial inputs. Returns rates aligned with
    `members`, per flow.

    Flows crossing the same links get the same rate at every round, so it
    runs on each distinct row of links once, weighed by its flows (a 1,024-host
    cluster's 60,000 flows are 2,048 rows). Given `weights` (aligned with
    `members`), the caller has done so: each member row stands for that many
    flows.
    """
    if len(members) == 0:
        return np.zeros(0)
    if weights is None:
        first, inverse, counts = distinct_rows(*links[members].T)
        rates = max_min(links, capacity, residual, members[first], rounds,
                        counts.astype(np.float64))
        return np.asarray(rates[inverse], dtype=np.float64)
    sub = links[members]
    rates = np.zeros(len(sub))
    residual = residual.copy()
    active = np.arange(len(sub))
    eps = capacity * 1e-9
    for _ in range(rounds):
        add = equal_split(sub, capacity, residual, active, weights[active])
        rates[active] += add
        residual = np.maximum(
            residual - link_sum(sub[active], add * weights[active], len(capacity)), 0.0)
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
    if not state.workers:
        return {}
    jobs = sorted({w.job for w in state.workers})
    column = {job: j for j, job in enumerate(jobs)}
    nic_bps = [h.nic_bps for h in state.topology.hosts]
    nic = np.asarray(nic_bps, dtype=np.float64)[:, None]
    on = np.zeros((len(nic_bps), len(jobs)), dtype=bool)
    on[[w.host for w in state.workers], [column[w.job] for w in state.workers]] = True
    # Each (host, job)'s egress: its coflows' flows from the host, summed per coflow
    # in flow order, then over the job's coflows in coflow order.
    egress = np.zeros(on.shape)
    known = np.zeros(on.shape, dtype=bool)  # some flow of the job leaves the host
    if len(state.flows):
        k = max(1, len(state.coflows))
        keys = state.flows.src * k + state.flows.coflow
        sums = np.bincount(keys, weights=rates, minlength=on.shape[0] * k).reshape(-1, k)
        seen = np.bincount(keys, minlength=on.shape[0] * k).reshape(-1, k) > 0
        for c, coflow in enumerate(state.coflows):
            if (j := column.get(coflow.job)) is not None:
                egress[:, j] += sums[:, c]
                known[:, j] |= seen[:, c]
    count = on.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(on, np.where(known, egress, nic / count * 0.999), 0.0)
        asked = want.sum(axis=1, keepdims=True)
        floor = nic * MIN_CLASS_SHARE
        scale = np.where(asked > 0, np.minimum(1.0, (nic - floor * count) / asked), 0.0)
    rate = np.maximum(1, (floor + want * scale).astype(np.int64))
    prio = [job_level.get(job, 0) for job in jobs]
    out: dict[int, dict[str, JobClassPlan]] = {}
    hosts, columns = (a.tolist() for a in np.nonzero(on))
    for host, j, r in zip(hosts, columns, rate[on].tolist(), strict=True):
        out.setdefault(host, {})[jobs[j]] = JobClassPlan(rate_bps=r, ceil_bps=nic_bps[host],
                                                         prio=prio[j])
    return out
