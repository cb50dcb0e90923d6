"""`fair`: every job on the host gets an equal guaranteed share, all may borrow.

The interim local policy until the policies issue brings priority, coflow
and straggler-aware plans. Within a job, bands keep strict priority (the
daemon's tree gives each band its own leaf); across jobs there is none.
"""

from __future__ import annotations

from gradlane.policies.base import JobClassPlan, Plan, Policy, State, register

__all__ = ["FairPolicy"]


@register("fair")
class FairPolicy(Policy):
    def plan(self, state: State) -> Plan:
        jobs = state.jobs
        if not jobs:
            return Plan(job_classes={}, source=self.name)
        share = max(1, (state.shaped_bps - state.other_bps) // len(jobs))
        return Plan(
            job_classes={
                job.name: JobClassPlan(rate_bps=share, ceil_bps=state.shaped_bps, prio=0)
                for job in jobs
            },
            source=self.name,
        )
