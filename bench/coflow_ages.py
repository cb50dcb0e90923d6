"""`coflow` with its coflows' ages against every age 0, in the simulator.

    .venv/bin/python bench/coflow_ages.py [--hosts 1024] [--loads 0.6,0.8] [--seeds 0,1,2]
                                          [--json PATH]

`coflow` weighs each coflow by its response ratio, 1 + age / its
bottleneck time (HRRN, `gradlane.policies.coflow`), so that a job ordered
last does not starve. The simulator knows each coflow's age; the control
plane does not (a report carries no iteration's start), so there every age
is 0 and the order is BSSI's by load alone. This measures what that costs:
each setting runs `coflow` as the simulator feeds it and `coflow-ageless`,
the same policy given every age as 0, on the same scenario:

- the closed-loop cluster of `gradlane sim cluster` (seed 0; every job's
  next iteration waits for its last);
- the open-loop coflows of `gradlane sim coflows` at each load and seed
  (Poisson arrivals, where a starved job's backlog would grow).

Per run: mean and longest CCT, mean iteration (closed loop), and the ratio
ageless over aged of each (below 1: ages 0 did better).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, write_result  # noqa: E402

from gradlane.errors import ConfigError  # noqa: E402
from gradlane.policies import get_policy  # noqa: E402
from gradlane.policies.base import Plan, Policy, State  # noqa: E402
from gradlane.policies.sim import Scenario, cluster, simulate  # noqa: E402
from gradlane.simulation import open_loop  # noqa: E402

HOSTS = 1024


class Ageless(Policy):
    """`coflow` given every coflow's age as 0, as the control plane gives it."""

    name = "coflow-ageless"

    def __init__(self) -> None:
        self.base = get_policy("coflow")
        self.aged_states = 0  # states that had an age to take away (recorded: it acted)

    def plan(self, state: State) -> Plan:
        self.aged_states += any(c.age_s > 0 for c in state.coflows)
        young = tuple(dataclasses.replace(c, age_s=0.0) for c in state.coflows)
        return dataclasses.replace(self.base.plan(dataclasses.replace(state, coflows=young)),
                                   source=self.name)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _compare(scenario: Scenario, setting: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for policy in (get_policy("coflow"), Ageless()):
        started = time.perf_counter()
        run = simulate(scenario, policy)
        runs[policy.name] = {
            "mean_cct_s": run.mean_cct_s,
            "longest_cct_s": max((max(c) for c in run.cct_s.values() if c), default=0.0),
            # Open loop, coflows arrive whatever iterations do: none measured.
            "mean_iteration_s": (None if math.isnan(run.mean_iteration_s)
                                 else run.mean_iteration_s),
            "wall_s": time.perf_counter() - started,
        }
        if isinstance(policy, Ageless):
            runs[policy.name]["plans_with_ages_taken"] = policy.aged_states
    aged, ageless = runs["coflow"], runs["coflow-ageless"]
    ratios = {key: ageless[key] / aged[key] for key in ("mean_cct_s", "longest_cct_s")
              if aged[key] > 0}
    print(f"{setting}: mean CCT {aged['mean_cct_s'] * 1000:.1f} ms aged, "
          f"{ageless['mean_cct_s'] * 1000:.1f} ageless; longest {aged['longest_cct_s']:.2f} s, "
          f"{ageless['longest_cct_s']:.2f}", flush=True)
    return {**setting, "runs": runs, "ageless_over_aged": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=HOSTS, help="cluster size (whole leaves of 32)")
    ap.add_argument("--loads", default="0.6,0.8", help="open-loop loads, comma-separated")
    ap.add_argument("--seeds", default="0,1,2", help="open-loop seeds, comma-separated")
    ap.add_argument("--json", type=Path, help="result file (default: bench/results/"
                    "coflow_ages.json, coflow_ages-hostsN.json for another size)")
    args = ap.parse_args()
    suffix = "" if args.hosts == HOSTS else f"-hosts{args.hosts}"
    args.json = args.json or REPO / f"bench/results/coflow_ages{suffix}.json"
    try:
        loads, seeds = _floats(args.loads), [int(s) for s in _floats(args.seeds)]
        closed = cluster(hosts=args.hosts, seed=0)
    except (ValueError, ConfigError) as e:
        ap.error(str(e))
    if not all(0 < load < 1 for load in loads):
        ap.error("--loads must each be in (0, 1)")
    settings = [_compare(closed, {"loop": "closed", "seed": 0})]
    for load in loads:
        for seed in seeds:
            scenario = open_loop(cluster(hosts=args.hosts, seed=seed), load, seed)
            settings.append(_compare(scenario, {"loop": "open", "load": load, "seed": seed}))
    write_result(args.json, {
        "benchmark": "coflow with its coflows' ages against every age 0 (simulated)",
        "config": {"hosts": args.hosts, "loads": loads, "seeds": seeds},
        "settings": settings,
    })
    print(f"-> {args.json}")


if __name__ == "__main__":
    main()
