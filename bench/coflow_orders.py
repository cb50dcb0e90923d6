"""Coflow orders against fair sharing on closed-loop training jobs, in the simulator.

    .venv/bin/python bench/coflow_orders.py [--hosts 1024] [--seed 0] [--iterations 12]
                                            [--json PATH]

`gradlane sim cluster`'s scenario (1,024 hosts under 2:1 leaves, 8 jobs),
each job's coflow one iteration's gradient exchange, every job's next
iteration waiting for its last. What decides a job's wait is the level
its coflow gets (the simulator applies plans' job levels and bands), so
each row below is a plan whose job levels come from one order of the
coflows, replanned as `gradlane sim` replans (when a coflow starts or ends,
and every second):

- `fair`: no order (every job on one level), the baseline;
- `coflow`: gradlane's policy (Sincronia's BSSI, HRRN-weighted by age);
- `bssi`: BSSI by load alone;
- `sebf`: Varys' smallest effective bottleneck first (its bottleneck
  link's time alone);
- `srpt`: shortest remaining first, a coflow's remaining time being the
  longer of its bottleneck time and the compute still to come before
  its last gradient is ready;
- `oldest`: the coflow that started first goes first (FIFO over coflows);
- `loadbalance`, and `loadbalance` with `coflow`'s levels: chunk owners and
  reduction within leaves first, without and with the order.

The question it answers: how much of the gap between `fair`'s mean CCT
and each job's alone (`cct_ceiling`) any order closes. Orders of the
ordering rows are this script's, not policies gradlane ships.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, write_result  # noqa: E402

from gradlane.errors import ConfigError  # noqa: E402
from gradlane.policies import fabric, get_policy  # noqa: E402
from gradlane.policies.base import LEVELS, FloatArray, Plan, Policy, State  # noqa: E402
from gradlane.policies.coflow import bssi_order, coflow_schedule, levels  # noqa: E402
from gradlane.policies.sim import cluster, simulate  # noqa: E402
from gradlane.simulation import cct_ceiling, isolated_cct  # noqa: E402

HOSTS = 1024
Order = Callable[[State, FloatArray], list[int]]


def _by(key: FloatArray) -> list[int]:
    """Coflow indices by `key`, smallest first, ties by index."""
    return [int(k) for k in np.lexsort((np.arange(len(key)), key))]


def _bottleneck(load: FloatArray) -> FloatArray:
    return load.max(axis=1) if load.size else np.zeros(len(load))


def _compute_left(state: State) -> FloatArray:
    """Per coflow, the latest of its flows' ready times (0: every flow ready)."""
    out = np.zeros(len(state.coflows))
    np.maximum.at(out, state.flows.coflow, state.flows.ready_s)
    return out


ORDERS: dict[str, Order] = {
    "bssi": lambda state, load: bssi_order(load),
    "sebf": lambda state, load: _by(_bottleneck(load)),
    "srpt": lambda state, load: _by(np.maximum(_bottleneck(load), _compute_left(state))),
    "oldest": lambda state, load: _by(np.array(
        [-c.age_s if c.age_s > 0 else np.inf for c in state.coflows])),
}


def _with_levels(state: State, plan: Plan, order: list[int]) -> Plan:
    """`plan` with job levels from `order` (`coflow`'s mapping onto the levels)."""
    job_level: dict[str, int] = {}
    for pos, level in zip(order, levels(len(order)), strict=True):
        job_level.setdefault(state.coflows[pos].job, level)
    for job in state.jobs:
        job_level.setdefault(job.name, LEVELS - 1)
    return dataclasses.replace(
        plan, job_level=job_level, coflow_order=tuple(state.coflows[k].id for k in order),
        host_classes=fabric.host_classes(state, plan.flow_rate_bps, job_level))


class Ordered(Policy):
    """`base`'s plan with its job levels from `order` of the state's coflows."""

    def __init__(self, name: str, base: str, order: Order | None) -> None:
        self.name, self.base, self.order = name, get_policy(base), order

    def plan(self, state: State) -> Plan:
        plan = self.base.plan(state)
        if not state.cluster or not state.coflows:
            return plan
        if self.order is None:  # `coflow`'s own order and levels
            order, _, _ = coflow_schedule(state)
        else:
            order = self.order(state, fabric.per_coflow_link_load(state, state.flow_links))
        return _with_levels(state, plan, order)


def rows() -> list[Policy]:
    return [get_policy("fair"), get_policy("coflow"),
            *(Ordered(name, "fair", order) for name, order in ORDERS.items()),
            get_policy("loadbalance"), Ordered("loadbalance+coflow", "loadbalance", None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=HOSTS, help="cluster size (whole leaves of 32)")
    ap.add_argument("--seed", type=int, default=0, help="placement and job-mix seed")
    ap.add_argument("--iterations", type=int, default=12,
                    help="iterations measured per job (gradlane sim cluster's 12)")
    ap.add_argument("--json", type=Path, help="result file (default: bench/results/"
                    "coflow_orders.json, coflow_orders-hostsN.json for another size)")
    args = ap.parse_args()
    suffix = "" if args.hosts == HOSTS else f"-hosts{args.hosts}"
    args.json = args.json or REPO / f"bench/results/coflow_orders{suffix}.json"
    if args.iterations < 1:
        ap.error("--iterations must be at least 1")
    try:
        scenario = cluster(hosts=args.hosts, seed=args.seed, iterations=args.iterations)
    except ConfigError as e:
        ap.error(f"--hosts: {e}")
    results: dict[str, Any] = {}
    for policy in rows():
        started = time.perf_counter()
        run = simulate(scenario, policy)
        results[policy.name] = {
            "mean_cct_s": run.mean_cct_s,
            "mean_iteration_s": run.mean_iteration_s,
            "job_mean_cct_s": {job: float(np.mean(c)) for job, c in run.cct_s.items()},
            "cct_s": run.cct_s,
            "wall_s": time.perf_counter() - started,
        }
        print(f"{policy.name:>20}: mean CCT {run.mean_cct_s * 1000:6.1f} ms, mean iteration "
              f"{run.mean_iteration_s * 1000:6.1f} ms", flush=True)
    fair = results["fair"]["mean_cct_s"]
    for row in results.values():
        row["fair_over_this_cct"] = fair / row["mean_cct_s"]
    alone = isolated_cct(scenario)
    ceiling = cct_ceiling(results["fair"], alone)
    write_result(args.json, {
        "benchmark": "coflow orders against fair sharing, closed-loop jobs (simulated)",
        "config": {"hosts": args.hosts, "seed": args.seed, "iterations": args.iterations,
                   "jobs": [j.name for j in scenario.jobs],
                   "replan_s": scenario.replan_s, "react_s": scenario.react_s},
        "results": results,
        "isolated_cct_s": alone,
        "cct_ceiling": ceiling,
    })
    best = max((r for r in results if r != "fair" and not r.startswith("loadbalance")),
               key=lambda r: results[r]["fair_over_this_cct"])
    print(f"best order {best}: {results[best]['fair_over_this_cct']:.2f}x over fair's mean CCT; "
          f"no order can beat {ceiling:.2f}x -> {args.json}")


if __name__ == "__main__":
    main()
