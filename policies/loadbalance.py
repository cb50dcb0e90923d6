"""`loadbalance`: tensor-aware choice of chunk owners so the most loaded link finishes first.

With reduce-scatter and all-gather through per-chunk owners (gradlane's
data path, and BytePS's co-located servers), a worker sends and receives
``S + (W - 2) * owned`` bytes per iteration, ``S`` the model and ``owned``
its chunks' bytes. Its link finishes at that over its rate, so:

1. Each worker's weight is the rate its NIC can give this job: the NIC
   rate divided by the number of jobs with workers on that host.
2. Chunks go to owners by list scheduling on uniform machines
   (`assign_owners`): in priority order, each chunk to the worker whose
   owned bytes / weight would be smallest after taking it. Equal rates give
   equal bytes; a worker on a 2x faster link owns about twice as much.
3. When the job says which layer each chunk belongs to, each layer is
   balanced on its own first (its chunks are exchanged together, so its
   slowest owner sets its time), overall balance breaking ties.

4. When a leaf's hosts can send more than its uplink carries
   (`fabric.oversubscribed`), the plan asks shims to reduce each chunk
   within each leaf first (`Plan.reduce_in_leaf`): one copy per leaf
   crosses the spine instead of one per rank, hierarchical all-reduce as in
   Horovod and PLink (which finds the locality by probing; here the daemons
   report their leaf).

Departures from TicTac/BytePS-style balancing: ownership is by measured
link rate, not only bytes; hosts have one NIC here, so there is no path to
choose (with several NICs the weight would be their sum and the path the
least loaded one). Bands and rates are `priority`'s.
"""

from __future__ import annotations

from dataclasses import replace

from gradlane.policies import fabric
from gradlane.policies.base import Plan, Policy, State, register
from gradlane.policies.chunks import assign_owners
from gradlane.policies.priority import PriorityPolicy

__all__ = ["LoadBalancePolicy", "balanced_ownership"]


def balanced_ownership(state: State) -> dict[str, tuple[int, ...]]:
    """Per job with known chunks, an owner rank per chunk weighted by link rate."""
    out: dict[str, tuple[int, ...]] = {}
    if state.topology is None:
        return out
    jobs_on_host: dict[int, set[str]] = {}
    for w in state.workers:
        jobs_on_host.setdefault(w.host, set()).add(w.job)
    nic = [h.nic_bps for h in state.topology.hosts]
    for job in state.jobs:
        workers = state.workers_of(job.name)
        if workers and job.chunk_bytes:
            weights = [nic[w.host] / len(jobs_on_host[w.host]) for w in workers]
            layers = job.chunk_layers if len(job.chunk_layers) == len(job.chunk_bytes) else None
            owners = assign_owners(job.chunk_bytes, len(workers), weights, layers)
            out[job.name] = tuple(workers[o].rank for o in owners)
    return out


@register("loadbalance")
class LoadBalancePolicy(Policy):
    def plan(self, state: State) -> Plan:
        base = PriorityPolicy().plan(state)
        return replace(base, source=self.name, ownership=balanced_ownership(state),
                       reduce_in_leaf=fabric.oversubscribed(state.topology))
