import pytest

from gradlane.errors import ConfigError
from gradlane.policies import JobState, Policy, State, get_policy
from gradlane.policies.fair import FairPolicy


def test_fair_splits_the_guaranteed_rate_and_lets_every_job_borrow() -> None:
    state = State(shaped_bps=1000, other_bps=100, jobs=(JobState("a", 1, 4), JobState("b", 2, 8)))
    plan = get_policy("fair").plan(state)
    assert plan.source == "fair"
    assert {n: (c.rate_bps, c.ceil_bps, c.prio) for n, c in plan.job_classes.items()} == {
        "a": (450, 1000, 0),
        "b": (450, 1000, 0),
    }
    assert plan == get_policy("fair").plan(state)  # deterministic
    assert get_policy("fair").plan(State(1000, 100, ())).job_classes == {}


def test_unknown_policy_is_an_error_not_a_default() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'.*fair"):
        get_policy("nope")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        get_policy("no.such.module:Policy")
    with pytest.raises(ConfigError, match="not a gradlane.policies.Policy"):
        get_policy("gradlane.policies.base:State")


def test_third_party_policy_by_module_path() -> None:
    policy = get_policy("gradlane.policies.fair:FairPolicy")
    assert isinstance(policy, FairPolicy) and isinstance(policy, Policy)
