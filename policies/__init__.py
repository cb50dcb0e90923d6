"""Pure scheduling policies: ``plan(state) -> Plan``, registered by name.

Registered: `fifo` and `fair` (baselines), `priority` (P3/ByteScheduler),
`coflow` (Sincronia/Varys), `loadbalance`, `straggler`, and `gradlane`
(the composition). `check_plan` says what a valid plan is; the flow-level
simulator that evaluates them is `gradlane.policies.sim`.
"""

from gradlane.policies import chunks, coflow, fifo, gradlane, loadbalance, priority, straggler
from gradlane.policies.base import (
    DEFAULT_BANDS,
    DEFAULT_MAX_WEIGHED,
    LEVELS,
    Coflow,
    FlowTable,
    Host,
    JobClassPlan,
    JobState,
    Plan,
    Policy,
    State,
    Topology,
    Worker,
    get_policy,
    policy_names,
    register,
)
from gradlane.policies.check import check_plan


def clear_caches() -> None:
    """Forget what plans keep from one state to the next (each job placement's owner
    shares, each job shape's chunk owners), as a fresh control plane has nothing: for
    timing a first plan."""
    loadbalance._shares.cache_clear()
    chunks._equal_weights.cache_clear()


__all__ = [
    "DEFAULT_BANDS",
    "DEFAULT_MAX_WEIGHED",
    "LEVELS",
    "Coflow",
    "FlowTable",
    "Host",
    "JobClassPlan",
    "JobState",
    "Plan",
    "Policy",
    "State",
    "Topology",
    "Worker",
    "check_plan",
    "clear_caches",
    "coflow",
    "fifo",
    "get_policy",
    "gradlane",
    "loadbalance",
    "policy_names",
    "priority",
    "register",
    "straggler",
]
