"""Two NICs a host, on the emulated cluster (needs root).

    sudo .venv/bin/python bench/two_nics.py [--steps 40] [--json PATH]

Runs `gradlane.nic_runs.run_two_nics`: one VGG-19 trace job on 2 hosts, each
with two 100 Mbit/s NICs on two switch planes and gradlaned shaping both; the
ranks listen on one NIC's address, then on both, in one cluster; then on both
with eth1 shaped to half the rate. Writes every run's iteration times, their
medians, each NIC's share of each host's bytes, the ratio and the bounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cluster_args, record_cluster_run, unwind_on_signals  # noqa: E402

from gradlane.nic_runs import run_two_nics  # noqa: E402

if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    args = cluster_args(__doc__, "two_nics", 40).parse_args()
    result = record_cluster_run("two_nics", args.json,
                                lambda workdir: run_two_nics(workdir, args.steps, say=print))
    for label, run in result["runs"].items():
        shares = ", ".join(f"{s[-1]:.0%}" for s in run["nic_shares"])
        print(f"{label}: median iteration {run['median_s'] * 1000:.1f} ms "
              f"(eth1's share of each host's bytes: {shares})")
    print(f"{result['speedup']:.2f}x; bound with both NICs "
          f"{result['lower_bound_s'] * 1000:.1f} ms")
    uneven = result["uneven"]
    shares = ", ".join(f"{s[-1]:.0%}" for s in uneven["nic_shares"])
    print(f"{uneven['label']}: median iteration {uneven['median_s'] * 1000:.1f} ms, "
          f"{uneven['achieved_over_bound']:.2f}x of its bound "
          f"({uneven['lower_bound_s'] * 1000:.1f} ms; eth1's share: {shares}) -> {args.json}")
