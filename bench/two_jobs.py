"""Two jobs across an oversubscribed uplink, with and without the control plane (needs root).

    sudo .venv/bin/python bench/two_jobs.py [--steps 50] [--layout auto] [--json PATH]

Runs `gradlane.control_runs.run_two_jobs`: 9 hosts on two leaves under a
4:1 uplink, jobs a and b with two workers on each leaf, both at once:
computing alone first (`local`, nothing exchanged: the bound's measured
compute), then under `fifo`, under gradlane with the daemons' local policy,
and under gradlane with `gradlane control --uplink` (reduction within leaves
first). Writes every iteration time, the medians, their average per run, the
ratios and the bound (measured and nominal).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cluster_args, record_cluster_run, unwind_on_signals  # noqa: E402

from gradlane.control_runs import run_two_jobs  # noqa: E402
from gradlane.policies.chunks import LAYOUTS  # noqa: E402  (torch-free: --help is quick)


def main() -> None:
    ap = cluster_args(__doc__, "two_jobs", 50,
                      "per job; the medians are over steps 18 on (past the layout trial)")
    ap.add_argument("--layout", choices=LAYOUTS, default="auto",
                    help="the shims' gradient grouping (auto: the layout trial decides)")
    args = ap.parse_args()
    result = record_cluster_run("two_jobs", args.json, lambda workdir: run_two_jobs(
        workdir, args.steps, say=print, reference=True, layout=args.layout))
    average = result["average_median_s"]
    print(", ".join(f"{k} {v * 1000:.1f} ms" for k, v in average.items())
          + f": the control plane {result['control_speedup']:.2f}x, gradlane+control vs fifo "
          f"{result['gradlane_over_fifo']:.2f}x -> {args.json}")


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
