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
5. Partition size is tuned from measured iteration times, by the shim, which
   owns the chunking: its layout trial (`ShimConfig.layout` "auto") runs
   fine groups and chunks, then coarse ones of about DDP's bucket size, for
   a few steps each and keeps coarse only if the job's iterations (each
   step's slowest rank) were faster beyond chance
   (`gradlane.shim.sync.pick_layout`).

Departures: P3 and ByteScheduler order chunks in one priority queue per
worker; gradlane has one per band connection and relies on the network
(gradlaned's HTB, switch DSCP queues) for strict priority between bands.
ByteScheduler tunes partition size and credit together by Bayesian
optimization over many trial runs; gradlane searches partition size only,
over two points with a one-sided test, in the job's own first steps. Credit
stays at the shim's 128 KiB: on the four-host traces, 32 KiB to 1 MiB
(VGG-19) and 4 MiB (ResNet-50) moved the iteration time less than it moves
from run to run (`bench/README.md`).
Rates are those of per-flow sharing, served in band order.
"""

from __future__ import annotations

import numpy as np

from gradlane.policies import fabric
from gradlane.policies.base import IntArray, Plan, Policy, State, register
from gradlane.policies.fifo import local_classes, plain_layout

__all__ = ["PriorityPolicy", "banded_rates", "flow_bands"]


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


@register("priority")
class PriorityPolicy(Policy):
    def plan(self, state: State) -> Plan:
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name,
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
            version=state.version,
        )
