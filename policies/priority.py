"""`priority`: forward-order priority, tensor partitioning and credit (P3, ByteScheduler).

Follows P3 (Jayarajan et al., SysML 2019) and ByteScheduler (Peng et al.,
SOSP 2019):

1. Gradients are cut into chunks (partitioning) so a chunk needed early by
   the next forward pass never waits behind a large one.
2. A chunk's priority is its layer's forward order: 0 is needed first.
3. Priorities map onto the few bands the network enforces (`band_of`):
   with 4 bands, the first quarter of the layers rides band 0.
4. Credit: the shim keeps at most `credit_bytes` unsent in the kernel per
   connection, so a new urgent chunk overtakes queued ones.
5. Partition size and credit are tuned from measured iteration times.

Departures: P3 and ByteScheduler order chunks in one priority queue per
worker; gradlane has one per band connection and relies on the network
(gradlaned's HTB, switch DSCP queues) for strict priority between bands.
ByteScheduler tunes its two knobs by Bayesian optimization; gradlane uses a
compass search on the log2 grid (`next_tuning`): deterministic, needs no
model of the noise, and each step is one measured configuration. Rates are
those of per-flow sharing, served in band order.
"""

from __future__ import annotations

import statistics

import numpy as np

from gradlane.policies import fabric
from gradlane.policies.base import IntArray, Plan, Policy, State, Tuning, register
from gradlane.policies.fifo import local_classes, plain_layout

__all__ = ["CHUNK_GRID", "CREDIT_GRID", "PriorityPolicy", "banded_rates", "flow_bands",
           "next_tuning"]

CHUNK_GRID = tuple(1 << k for k in range(16, 25))  # 64 KiB .. 16 MiB
CREDIT_GRID = tuple(1 << k for k in range(15, 23))  # 32 KiB .. 4 MiB
START = (1 << 20, 128 << 10)  # the shim's defaults


def flow_bands(state: State) -> IntArray:
    """Each flow's band from its priority, scaled by its job's number of priorities.

    A job with ``n`` priorities (its `layers`, else its chunks) puts priority
    ``p`` in band ``min(bands - 1, p * bands // n)`` (`band_of`, vectorized):
    the shim's rule, so a plan and a shim without one agree.
    """
    flows = state.flows
    if not len(flows):
        return np.zeros(0, np.int64)
    per_coflow = np.zeros(len(state.coflows), np.int64)
    np.maximum.at(per_coflow, flows.coflow, flows.priority + 1)
    known = {j.name: j.layers or len(j.chunk_bytes) for j in state.jobs}
    for k, coflow in enumerate(state.coflows):
        per_coflow[k] = max(per_coflow[k], known.get(coflow.job, 0), 1)
    layers = per_coflow[flows.coflow]
    return np.minimum(state.bands - 1, np.maximum(flows.priority, 0) * state.bands // layers)


def banded_rates(state: State, bands: IntArray) -> np.ndarray:
    """Per-flow fair shares, band 0 first on each link, later bands on what is left.

    Flows of a band crossing the same links get the same rate: each band's
    `fabric.max_min` runs on its distinct rows of links, counted once here.
    """
    assert state.topology is not None
    cap = state.topology.capacity_bps
    first, inverse, counts = fabric.distinct_rows(*state.flow_links.T, bands)
    links, row_band, weight = state.flow_links[first], bands[first], counts.astype(np.float64)
    residual = cap.copy()
    rates = np.zeros(len(first))
    for band in range(state.bands):
        members = np.flatnonzero(row_band == band)
        rates[members] = fabric.max_min(links, cap, residual, members, weights=weight[members])
        residual = np.maximum(
            residual - fabric.link_sum(links[members], rates[members] * weight[members],
                                       len(cap)), 0.0)
    return rates[inverse]


def next_tuning(tried: tuple[tuple[int, int, float], ...]) -> Tuning:
    """The next (chunk, credit) to measure, by compass search on the log2 grid.

    1. Untried: start from the shim's defaults.
    2. Take the tried point with the lowest median iteration time (ties: the
       earlier tried).
    3. Return its first untried neighbour (one grid step in chunk or credit,
       in a fixed order); when all are tried, the best point has converged
       and is returned for good.
    """
    if not tried:
        return Tuning(*START)
    times: dict[tuple[int, int], list[float]] = {}
    for chunk, credit, seconds in tried:
        times.setdefault((chunk, credit), []).append(seconds)
    best = min(times, key=lambda p: statistics.median(times[p]))
    ci = min(range(len(CHUNK_GRID)), key=lambda i: abs(CHUNK_GRID[i] - best[0]))
    ri = min(range(len(CREDIT_GRID)), key=lambda i: abs(CREDIT_GRID[i] - best[1]))
    for dc, dr in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        c, r = ci + dc, ri + dr
        if 0 <= c < len(CHUNK_GRID) and 0 <= r < len(CREDIT_GRID):
            point = (CHUNK_GRID[c], CREDIT_GRID[r])
            if point not in times:
                return Tuning(*point)
    return Tuning(*best)


@register("priority")
class PriorityPolicy(Policy):
    def plan(self, state: State) -> Plan:
        tuning = {job.name: next_tuning(job.tuning) for job in state.jobs}
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name, tuning=tuning,
                        version=state.version)
        bands = flow_bands(state)
        rates = banded_rates(state, bands)
        ownership, shares = plain_layout(state)
        job_level = {job.name: 0 for job in state.jobs}
        return Plan(
            job_classes={},
            source=self.name,
            host_classes=fabric.host_classes(state, rates, job_level),
            flow_band=bands,
            flow_rate_bps=rates,
            coflow_order=tuple(c.id for c in state.coflows),
            job_level=job_level,
            ownership=ownership,
            batch_shares=shares,
            tuning=tuning,
            version=state.version,
        )
