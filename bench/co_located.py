"""Chunk owners for ranks that share hosts, on the emulated cluster (needs root).

    sudo .venv/bin/python bench/co_located.py [--steps 60] [--json PATH]

Runs `gradlane.control_runs.run_co_located`: one VGG-19 trace job of 8 ranks,
4 on each of 2 hosts; the workers compute alone (the bound's measured
compute), then gradlane on the ring runs without `gradlane control` (owned
bytes equal) and with it (the shims take the plan's owners: the ranks at
either end of each host's run), then with the shims' default for ranks
sharing hosts (reduced within hosts first), in one cluster. Writes every
run's iteration times, their medians, the ratio, the bytes each rank owned
and the slowest link's modelled times.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cluster_args, record_cluster_run, unwind_on_sigterm  # noqa: E402
from slow_link import print_summary  # noqa: E402

from gradlane.control_runs import run_co_located  # noqa: E402


def main() -> None:
    args = cluster_args(__doc__, "co_located", 60).parse_args()
    result = record_cluster_run("co_located", args.json, lambda workdir: run_co_located(
        workdir, args.steps, say=print, reference=True))
    print_summary(result, args.json)
    for label, run in result["also"].items():
        print(f"{label} ({run['exchange']}): median iteration {run['median_s'] * 1000:.1f} ms")


if __name__ == "__main__":
    unwind_on_sigterm()  # a SIGTERM removes this run's clusters, as Ctrl-C does
    main()
