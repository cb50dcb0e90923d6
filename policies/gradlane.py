"""`gradlane`: the default composition.

1. Bands: `priority` (forward order onto the bands), with `straggler`'s
   critical flows moved up one band (inert in today's states: see
   `straggler`). Every job's band 0 goes before any
   job's band 1: what blocks a forward pass now goes first, whoever owns it.
2. Rates: per-flow max-min in band order (`priority`).
3. Chunk ownership: `loadbalance` (owners weighted by link rate; reduction
   within leaves first when uplinks are oversubscribed).
4. Batch shares: `straggler` (proportional to measured throughput).
5. Partition size: not planned; the shim's layout trial tunes it from the
   job's measured iterations (`priority`, 5).
6. The coflow order (`coflow`'s BSSI) is computed and reported, but does
   not set job levels: all jobs share level 0.

Why not order jobs: the order pays where jobs contend for the spine, and
reducing within leaves takes most of them off it. In `gradlane sim cluster`
(1,024 hosts, 8 jobs) `coflow`'s order makes the average iteration 1.16x
shorter than fair sharing on the flat exchange, with its uplinks 68-83%
busy; under `gradlane` they are 11% busy, and setting job levels from the
order on top of everything else made it 0.6% longer (531 against 528 ms).
Strict order across closed-loop jobs also has a cost of its own: the jobs
ordered last wait while the first ones come back sooner (one VGG-19 job's
iteration 693 -> 740 ms under `coflow`). `coflow` stays available for
fabrics where jobs keep sharing links.

On a daemon's own state (no cluster view) this is the `fair` plan.
"""

from __future__ import annotations

from gradlane.policies import fabric
from gradlane.policies.base import Plan, Policy, State, register
from gradlane.policies.coflow import bssi_order
from gradlane.policies.fifo import local_classes
from gradlane.policies.loadbalance import balanced_ownership
from gradlane.policies.priority import banded_rates, flow_bands
from gradlane.policies.straggler import critical_first, throughput_shares

__all__ = ["GradlanePolicy"]


@register("gradlane")
class GradlanePolicy(Policy):
    def plan(self, state: State) -> Plan:
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name,
                        version=state.version)
        bands = critical_first(state, flow_bands(state))
        rates = banded_rates(state, bands)
        links = state.flow_links
        order = bssi_order(fabric.per_coflow_link_load(state, links))
        job_level = {job.name: 0 for job in state.jobs}
        ownership, notes = balanced_ownership(state)
        return Plan(
            job_classes={},
            source=self.name,
            host_classes=fabric.host_classes(state, rates, job_level),
            flow_band=bands,
            flow_rate_bps=rates,
            coflow_order=tuple(state.coflows[k].id for k in order),
            job_level=job_level,
            ownership=ownership,
            batch_shares=throughput_shares(state),
            reduce_in_leaf=fabric.oversubscribed(state.topology),
            version=state.version,
            notes=notes,
        )
