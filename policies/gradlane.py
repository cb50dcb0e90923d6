"""`gradlane`: the default composition.

1. Bands: `priority` (forward order onto the bands), with `straggler`'s
   critical flows moved up one band.
2. Coflow order, job levels and rates: `coflow` (BSSI order, MADD rates,
   backfilled), so jobs sharing links are served smallest-bottleneck first.
3. Chunk ownership: `loadbalance` (owners weighted by link rate).
4. Batch shares: `straggler` (proportional to measured throughput).
5. Partition size and credit: `priority`'s compass search.

On a daemon's own state (no cluster view) this is the `fair` plan: a host
alone cannot see other hosts' coflows, so it keeps every job's guarantee.
"""

from __future__ import annotations

from gradlane.policies import fabric
from gradlane.policies.base import Plan, Policy, State, register
from gradlane.policies.coflow import coflow_schedule
from gradlane.policies.fifo import local_classes
from gradlane.policies.loadbalance import balanced_ownership
from gradlane.policies.priority import flow_bands, next_tuning
from gradlane.policies.straggler import critical_first, throughput_shares

__all__ = ["GradlanePolicy"]


@register("gradlane")
class GradlanePolicy(Policy):
    def plan(self, state: State) -> Plan:
        tuning = {job.name: next_tuning(job.tuning) for job in state.jobs}
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name, tuning=tuning,
                        version=state.version)
        order, job_level, rates = coflow_schedule(state)
        return Plan(
            job_classes={},
            source=self.name,
            host_classes=fabric.host_classes(state, rates, job_level),
            flow_band=critical_first(state, flow_bands(state)),
            flow_rate_bps=rates,
            coflow_order=tuple(state.coflows[k].id for k in order),
            job_level=job_level,
            ownership=balanced_ownership(state),
            batch_shares=throughput_shares(state),
            tuning=tuning,
            version=state.version,
        )
