"""The flow-level simulator: evaluates the policies at cluster scale.

`scenario` builds what to run (topologies, jobs from the shipped model
profiles), `engine.simulate` runs it under one policy, deterministically.
"""

from gradlane.policies.sim.engine import Result, coflow_load, full_demand_state, simulate
from gradlane.policies.sim.scenario import (
    Bucket,
    Scenario,
    SimJob,
    buckets_of,
    cluster,
    heterogeneous,
    job_buckets,
    one_switch,
    profile_layers,
    shim_buckets,
)

__all__ = [
    "Bucket",
    "Result",
    "Scenario",
    "SimJob",
    "buckets_of",
    "cluster",
    "coflow_load",
    "full_demand_state",
    "heterogeneous",
    "job_buckets",
    "one_switch",
    "profile_layers",
    "shim_buckets",
    "simulate",
]
