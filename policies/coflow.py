"""`coflow`: order the coflows of jobs sharing links (Sincronia, Varys).

1. Order (Sincronia's BSSI, Agarwal et al., SIGCOMM 2018, Algorithm 1):
   with all coflows unordered, repeatedly find the most loaded port ``b``
   (summed over unordered coflows), and put LAST the coflow with the
   smallest ``weight / load on b``; lower the other coflows' weights by
   ``weight_last * load(c, b) / load(last, b)``; remove it and repeat.
   This is a 4-approximation of minimum total weighted completion time.
2. Levels: the order maps onto the 8 priority levels switches and HTB have,
   keeping it monotone (Sincronia's "order-preserving" mapping): with ``k``
   coflows, position ``i`` gets level ``i * 8 // k``; fewer than 8 coflows
   get one level each.
3. Rates (Varys' MADD, Chowdhury et al., SIGCOMM 2014): in order, each
   coflow gets the rates that finish all its flows together at its
   bottleneck on what earlier coflows left, then what is still free is
   split among all flows (Varys' backfilling), so no link idles.

Departures: Sincronia's ports are a big switch's ingress and egress; here
the leaf uplinks and downlinks are ports too, and loads are in seconds
(bytes / capacity), so a slow link counts as a loaded one. Training jobs
send a new coflow every iteration, so a job ordered last would starve: a
coflow's weight is its response ratio, 1 + age / its bottleneck time (as in
Brinch Hansen's HRRN), so one that has waited many times its own length
moves up. Only the simulator gives coflows an age (`Coflow.age_s`, from when
its first flow was ready): the control plane's coflow is a job's next
iteration, whose start no report carries, so there every age is 0, the
weights are all 1 and the order follows the load alone (in the simulator's
1,024-host runs, ages all 0 lengthened neither the mean CCT, 0-3% shorter,
nor the longest: bench/README.md, "The simulator"). Flows within a
coflow share one band (`priority` adds bands; `gradlane` composes both).
"""

from __future__ import annotations

import numpy as np

from gradlane.policies import fabric
from gradlane.policies.base import LEVELS, FloatArray, IntArray, Plan, Policy, State, register
from gradlane.policies.fifo import local_classes, plain_layout

__all__ = ["CoflowPolicy", "bssi_order", "levels", "ordered_rates"]


def bssi_order(load: FloatArray, weights: FloatArray | None = None) -> list[int]:
    """Sincronia's BSSI order of coflows from a ``(coflows, ports)`` load matrix (seconds).

    Each step sums the ports' loads over the coflows left from the matrix's nonzeros
    alone (a coflow loads the few ports of its hosts): with hundreds of jobs, summing
    the whole matrix each step was most of a plan. The sums are the same to the last
    bit (each port's loads added in coflow order, as a column sum adds them)."""
    k = load.shape[0]
    w = np.ones(k) if weights is None else weights.astype(np.float64).copy()
    rows, cols = np.nonzero(load)  # row by row: a port's loads in coflow order
    values = load[rows, cols]
    alive = np.ones(k, dtype=bool)
    left = list(range(k))
    order: list[int] = []
    while left:
        kept = alive[rows]
        sums = np.bincount(cols[kept], weights=values[kept], minlength=load.shape[1])
        port = int(np.argmax(sums))
        on_port = load[left, port]
        if on_port.max() <= 0:  # nothing loaded left: keep the given order
            order.extend(reversed(left))
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(on_port > 0, w[left] / on_port, np.inf)
        last_pos = int(np.argmin(ratio))  # first minimum: deterministic
        last = left[last_pos]
        w[left] = w[left] - w[last] * on_port / on_port[last_pos]
        order.append(last)
        alive[last] = False
        left.pop(last_pos)
    order.reverse()
    return order


def response_ratio(state: State, load: FloatArray) -> FloatArray:
    """Each coflow's weight: 1 + its age over its own bottleneck time (HRRN's response ratio)."""
    alone = load.max(axis=1) if load.size else np.zeros(len(state.coflows))
    age = np.array([c.age_s for c in state.coflows], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(1.0 + np.where(alone > 0, age / alone, 0.0), dtype=np.float64)


def levels(count: int, n_levels: int = LEVELS) -> list[int]:
    """The level of each position in an order of `count` coflows (monotone, 0 first)."""
    if count <= n_levels:
        return list(range(count))
    return [i * n_levels // count for i in range(count)]


def ordered_rates(state: State, order: list[int], links: IntArray) -> FloatArray:
    """MADD rates in coflow `order`, then the leftover split among all flows."""
    assert state.topology is not None
    cap = state.topology.capacity_bps
    residual = cap.copy()
    rates = np.zeros(len(state.flows))
    by_coflow = np.argsort(state.flows.coflow, kind="stable")
    bounds = np.searchsorted(state.flows.coflow[by_coflow], np.arange(len(state.coflows) + 1))
    for k in order:
        members = by_coflow[bounds[k]:bounds[k + 1]]
        rates[members] = fabric.madd(links, state.flows.bytes, residual, members)
        residual = np.maximum(
            residual - fabric.link_sum(links[members], rates[members], len(cap)), 0.0
        )
    everyone = np.arange(len(state.flows))
    rates += fabric.max_min(links, cap, residual, everyone)
    return rates


def coflow_schedule(state: State) -> tuple[list[int], dict[str, int], FloatArray]:
    """(order, job levels, rates) for a cluster state."""
    links = state.flow_links
    load = fabric.per_coflow_link_load(state, links)
    order = bssi_order(load, response_ratio(state, load))
    level_of = levels(len(order))
    job_level: dict[str, int] = {}
    for pos, k in enumerate(order):
        job_level.setdefault(state.coflows[k].job, level_of[pos])
    for job in state.jobs:
        job_level.setdefault(job.name, LEVELS - 1)  # no traffic now: last
    return order, job_level, ordered_rates(state, order, links)


@register("coflow")
class CoflowPolicy(Policy):
    def plan(self, state: State) -> Plan:
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name, version=state.version)
        order, job_level, rates = coflow_schedule(state)
        ownership, shares = plain_layout(state)
        return Plan(
            job_classes={},
            source=self.name,
            host_classes=fabric.host_classes(state, rates, job_level),
            flow_band=np.zeros(len(state.flows), np.int64),
            flow_rate_bps=rates,
            coflow_order=tuple(state.coflows[k].id for k in order),
            job_level=job_level,
            ownership=ownership,
            batch_shares=shares,
            version=state.version,
        )
