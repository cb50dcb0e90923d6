"""Several NICs a host on the emulated cluster: one job over one NIC, then over two.

Two hosts, each with two NICs on two switch planes (`gradlane.testbed.Topology`
``nics=2``), gradlaned shaping both. The same gradlane job runs in one cluster:
its ranks given one address each (one NIC), then one per NIC, so that their
chunks spread over the planes by the NICs' rates (`gradlane.shim.engine.Engine`),
then again with eth1 shaped to half the rate. Needs root.
`tests/integration/test_planes_netns.py` asserts on it; ``bench/two_nics.py``
records it as JSON; ``gradlane sim validate`` replays it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradlane.benchmark import PAYLOAD_EFFICIENCY, lower_bound, summarize
from gradlane.control_runs import stop_daemons, trace_totals
from gradlane.demo import SystemRun, collect, launch, nic_tx_bytes, steady_start
from gradlane.testbed import Cluster, Topology
from gradlane.testbed.links import line_rate
from gradlane.units import parse_rate

__all__ = ["TWO_NICS_WORKLOAD", "run_two_nics"]

HOSTS = ["h1", "h2"]
NIC_RATE = "100mbit"
NICS = 2  # a host's NICs, each on a switch plane of its own
# VGG-19 at 4 MB: each host sends a model a step, 0.34 s over one 100 Mbit/s NIC, against
# 30 ms of compute: the exchange is what the NICs change.
TWO_NICS_WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "4",
                     "--forward-ms", "10"]
RUNS = {"gradlane, one NIC": 1, "gradlane, two NICs": 2}
# Then gradlaned restarted, told eth1 is half as fast (it shapes it to half): the shims
# weigh the planes by the rates its welcome gives.
UNEVEN = "gradlane, two NICs, eth1 at half the rate"


def run_two_nics(workdir: Path, steps: int = 40, say: Callable[[str], None] = lambda _: None,
                 layout: str = "auto") -> dict[str, Any]:
    """One gradlane job on 2 hosts over one NIC each, then over both NICs of each.

    Then once more with eth1 shaped to half the rate (gradlaned told so; the
    shims weigh the planes by it) as `UNEVEN`, with its own bound.
    Returns each run's rank-0 iteration times, their medians from
    `steady_start`, each NIC's share of each host's bytes, the ratio, and the
    bound with both NICs (each host's model out and in over twice a NIC's rate).
    `layout` is the shims' gradient grouping (`ShimConfig.layout`; "auto" runs
    the layout trial, whose coarse groups, few chunks an owner, cannot be
    weighed 2:1 between planes).

    Raises:
        TestbedError: the cluster, a daemon or a training step failed.
    """
    args = ["--steps", str(steps), *TWO_NICS_WORKLOAD, "--layout", layout]
    workdir.chmod(0o755)
    runs: dict[str, SystemRun] = {}
    shares: dict[str, list[list[float]]] = {}
    line = line_rate(parse_rate(NIC_RATE))
    with Cluster(Topology.build("nics", len(HOSTS), NIC_RATE, nics=NICS)) as c:

        def run(label: str, nics: int, daemons: dict[str, tuple[Any, Path]]) -> None:
            say(label)
            before = {h: nic_tx_bytes(c.ns(h), NICS) for h in HOSTS}
            runs[label] = collect(c, launch(
                c, "gradlane", args, port=29870 + len(runs), out=workdir / f"run{len(runs)}",
                sockets=[daemons[h][1] for h in HOSTS], hosts=HOSTS,
                rank_args=[["--address", ",".join(c.addr(h, k) for k in range(nics))]
                           for h in HOSTS]))
            sent = [[a - b for a, b in zip(nic_tx_bytes(c.ns(h), NICS), before[h], strict=True)]
                    for h in HOSTS]
            shares[label] = [[n / sum(s) for n in s] for s in sent]

        daemons = c.start_daemons(HOSTS, workdir)
        for label, nics in RUNS.items():
            run(label, nics, daemons)
        codes = stop_daemons({h: proc for h, (proc, _) in daemons.items()})
        daemons = c.start_daemons(HOSTS, workdir, rate=[str(line), str(line // 2)])
        run(UNEVEN, 2, daemons)
        codes += stop_daemons({h: proc for h, (proc, _) in daemons.items()})
    # What gradlaned was told each NIC's line rate is, per run (it shapes under it).
    told = {label: [line] * nics for label, nics in RUNS.items()}
    told[UNEVEN] = [line, line // 2]
    steady = steady_start(steps)
    medians = {label: statistics.median(r.times[steady:]) for label, r in runs.items()}
    compute, size = trace_totals(TWO_NICS_WORKLOAD)
    bound = lower_bound(len(HOSTS), compute, size, 2 * parse_rate(NIC_RATE))
    uneven_bound = lower_bound(len(HOSTS), compute, size, 1.5 * parse_rate(NIC_RATE))
    one, two = RUNS
    uneven = runs.pop(UNEVEN)
    return {
        "scenario": {"name": "two-nics", "hosts": len(HOSTS), "nics": NICS, "rate": NIC_RATE,
                     "steps": steps, "workload": TWO_NICS_WORKLOAD, "layout": layout},
        "steady_from_step": steady,
        "runs": {label: {**_recorded(r), "median_s": medians[label],
                         "nic_shares": shares[label], "daemon_line_bps": told[label]}
                 for label, r in runs.items()},
        # Not in the summary: its bound is its own (one NIC and a half).
        "uneven": {"label": UNEVEN, **_recorded(uneven), "median_s": medians[UNEVEN],
                   "nic_shares": shares[UNEVEN], "daemon_line_bps": told[UNEVEN],
                   "lower_bound_s": uneven_bound,
                   "achieved_over_bound": medians[UNEVEN] / uneven_bound},
        "speedup": medians[one] / medians[two],
        "lower_bound_s": bound,
        "payload_efficiency": PAYLOAD_EFFICIENCY,
        "summary": summarize({k: r.times[steady:] for k, r in runs.items()}, bound,
                             {k: [r] for k, r in runs.items()}),
        "daemon_exit_codes": codes,
    }


def _recorded(run: SystemRun) -> dict[str, Any]:
    """What a replay in the simulator needs of a run (`gradlane sim validate`): rank 0's
    iteration times and waits for averages per step, and the layout its trial kept."""
    waited = run.rank_steps[0].get("waited", []) if run.rank_steps else []
    return {"iteration_s": run.times, "waited_s": list(waited),
            "layout_trial": run.layout_trial}
