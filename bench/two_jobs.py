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

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, unwind_on_sigterm, write_result  # noqa: E402

from gradlane.control_runs import run_two_jobs  # noqa: E402
from gradlane.shim.config import LAYOUTS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50,
                    help="per job; the medians are over steps 18 on (past the layout trial)")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/two_jobs.json")
    ap.add_argument("--layout", choices=LAYOUTS, default="auto",
                    help="the shims' gradient grouping (auto: the layout trial decides)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradlane-two-jobs-") as tmp:
        result = run_two_jobs(Path(tmp), args.steps, say=print, reference=True,
                              layout=args.layout)
    write_result(args.json, {"benchmark": "two_jobs", **result})
    average = result["average_median_s"]
    print(", ".join(f"{k} {v * 1000:.1f} ms" for k, v in average.items())
          + f": the control plane {result['control_speedup']:.2f}x, gradlane+control vs fifo "
          f"{result['gradlane_over_fifo']:.2f}x -> {args.json}")


if __name__ == "__main__":
    unwind_on_sigterm()  # a SIGTERM removes this run's clusters, as Ctrl-C does
    main()
