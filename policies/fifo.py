"""`fifo` and `fair`: no priorities, the baselines.

`fifo` is what a transport without scheduling does: one band, every flow at
the same level, max-min fair rates (what per-flow TCP fairness converges
to), chunks owned round-robin, the batch split evenly. `fair` is the same
plan under the name gradlaned has always used for it on one host: every job
on the host gets an equal guaranteed share and all may borrow up to the link.
"""

from __future__ import annotations

import numpy as np

from gradlane.policies import fabric
from gradlane.policies.base import JobClassPlan, Plan, Policy, State, register

__all__ = ["FairPolicy", "FifoPolicy", "even_shares", "local_classes", "plain_layout"]


def local_classes(state: State, prio: dict[str, int] | None = None) -> dict[str, JobClassPlan]:
    """A daemon's classes: an equal guaranteed share per job, all borrowing up to the link."""
    if not state.jobs:
        return {}
    share = max(1, (state.shaped_bps - state.other_bps) // len(state.jobs))
    ceil = max(share, state.shaped_bps)
    return {
        job.name: JobClassPlan(rate_bps=share, ceil_bps=ceil, prio=(prio or {}).get(job.name, 0))
        for job in state.jobs
    }


def even_shares(global_batch: int, workers: int) -> tuple[int, ...]:
    """`global_batch` split as evenly as integers allow (the first ranks take the remainder)."""
    base, extra = divmod(global_batch, workers)
    return tuple(base + (1 if r < extra else 0) for r in range(workers))


def plain_layout(state: State) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """Ownership round-robin by chunk index and even batch shares, per job."""
    ownership, shares = {}, {}
    for job in state.jobs:
        workers = state.workers_of(job.name)
        if workers and job.chunk_bytes:
            chunks, ranks = len(job.chunk_bytes), [w.rank for w in workers]
            # Chunk i to rank i mod W: the ranks repeated (a plan of 400 jobs owns 170,000)
            ownership[job.name] = tuple((ranks * -(-chunks // len(ranks)))[:chunks])
        if workers and job.global_batch >= len(workers):
            shares[job.name] = even_shares(job.global_batch, len(workers))
    return ownership, shares


@register("fifo")
class FifoPolicy(Policy):
    def plan(self, state: State) -> Plan:
        if not state.cluster:
            return Plan(job_classes=local_classes(state), source=self.name, version=state.version)
        assert state.topology is not None
        links = state.flow_links
        cap = state.topology.capacity_bps
        rates = fabric.max_min(links, cap, cap, np.arange(len(state.flows)))
        ownership, shares = plain_layout(state)
        return Plan(
            job_classes={},
            source=self.name,
            host_classes=fabric.host_classes(state, rates, {}),
            flow_band=np.zeros(len(state.flows), np.int64),
            flow_rate_bps=rates,
            coflow_order=tuple(c.id for c in state.coflows),
            job_level={job.name: 0 for job in state.jobs},
            ownership=ownership,
            batch_shares=shares,
            version=state.version,
        )


@register("fair")
class FairPolicy(FifoPolicy):
    """The same plan as `fifo`; the daemon's historical default name."""
