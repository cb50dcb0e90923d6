"""`straggler`: heterogeneous workers finish their compute together.

Load-balanced bulk-synchronous parallelism (LB-BSP: Chen et al.,
"Semi-dynamic load balancing", SoCC 2020):

1. Each worker's throughput (samples/s of compute) is measured by its shim.
2. The global batch is split in proportion to throughput, as integers by
   the largest-remainder method (Hamilton's apportionment), every worker
   keeping at least one sample, so the shares always sum to the global batch.
3. Workers whose throughput is not measured yet keep an even split.
4. Critical flows first: of the flows carrying the same chunk (same coflow,
   chunk and priority) from different workers, those that became ready last
   (the slowest worker's) are on the critical path; at a shared bottleneck
   (the owner's link) they move up one band. Inert in every state planned
   today: the demand the control plane and the simulator build gives all
   flows of a bucket one ready time (`gradlane.policies.demand`), so no flow
   of a chunk is later than another and no band moves (counted, ad hoc, over a
   simulated 64-host cluster and the heterogeneous run: none of 0.9 M flow
   bands moved); and the shims band chunks by layer order, not by a plan's
   per-flow bands. It acts on states that tell the ready times apart (the
   unit tests'). Making it act would take shims that report when each
   chunk was ready, and that take their bands from the plan.

Departures: LB-BSP predicts throughput with a NARX model; gradlane plans
from the latest measurement and relies on re-planning every few
iterations. The shim weights its average by actual sample counts, so
unequal shares leave the update unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gradlane.policies.base import IntArray, Plan, Policy, State, register
from gradlane.policies.fifo import even_shares
from gradlane.policies.priority import PriorityPolicy

__all__ = ["StragglerPolicy", "critical_first", "proportional_shares", "throughput_shares"]


def proportional_shares(total: int, throughputs: list[float]) -> tuple[int, ...]:
    """`total` split in proportion to `throughputs`, each >= 1 (largest remainder).

    Raises:
        ValueError: fewer samples than workers, or a non-positive throughput.
    """
    n = len(throughputs)
    if total < n:
        raise ValueError(f"a batch of {total} cannot give {n} workers one sample each")
    if any(t <= 0 for t in throughputs):
        raise ValueError(f"throughputs must be positive, got {throughputs}")
    t = np.asarray(throughputs, dtype=np.float64)
    quota = total * t / t.sum()
    share = np.maximum(np.floor(quota), 1).astype(np.int64)
    left = total - int(share.sum())
    # Too few handed out: the largest remainders get one more (ties: lower rank).
    for i in np.argsort(-(quota - share), kind="stable")[:max(left, 0)]:
        share[i] += 1
    # Too many (the floor of one sample each): the most over-served give one back.
    for _ in range(max(-left, 0)):
        over = np.where(share > 1, share - quota, -np.inf)
        share[int(np.argmax(over))] -= 1
    return tuple(int(x) for x in share)


def throughput_shares(state: State) -> dict[str, tuple[int, ...]]:
    out = {}
    for job in state.jobs:
        workers = state.workers_of(job.name)
        if not workers or job.global_batch < len(workers):
            continue
        rates = [w.throughput for w in workers]
        if all(r > 0 for r in rates):
            out[job.name] = proportional_shares(job.global_batch, rates)
        else:
            out[job.name] = even_shares(job.global_batch, len(workers))
    return out


def critical_first(state: State, bands: IntArray) -> IntArray:
    """`bands` with the last-ready flows of each chunk moved up one band."""
    flows = state.flows
    if not len(flows):
        return bands
    # One group per (coflow, chunk): the same gradient from different workers.
    chunk_span = int(flows.chunk.max()) + 2
    prio_span = int(flows.priority.max()) - int(flows.priority.min()) + 1
    key = ((flows.coflow * chunk_span + flows.chunk + 1) * prio_span
           + flows.priority - flows.priority.min())
    _, group = np.unique(key, return_inverse=True)
    latest = np.full(group.max() + 1, -np.inf)
    earliest = np.full(group.max() + 1, np.inf)
    np.maximum.at(latest, group, flows.ready_s)
    np.minimum.at(earliest, group, flows.ready_s)
    critical = (latest[group] > earliest[group]) & (flows.ready_s >= latest[group])
    return np.where(critical, np.maximum(bands - 1, 0), bands)


@register("straggler")
class StragglerPolicy(Policy):
    def plan(self, state: State) -> Plan:
        base = PriorityPolicy().plan(state)
        bands = critical_first(state, base.flow_band) if state.cluster else base.flow_band
        return replace(base, source=self.name, flow_band=bands,
                       batch_shares=throughput_shares(state))
