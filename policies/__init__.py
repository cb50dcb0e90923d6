"""Pure scheduling policies: ``plan(state) -> Plan``, registered by name."""

from gradlane.policies import fair
from gradlane.policies.base import (
    JobClassPlan,
    JobState,
    Plan,
    Policy,
    State,
    get_policy,
    register,
)

__all__ = [
    "JobClassPlan",
    "JobState",
    "Plan",
    "Policy",
    "State",
    "fair",
    "get_policy",
    "register",
]
