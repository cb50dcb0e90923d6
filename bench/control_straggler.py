"""Straggler mitigation by the control plane, on the emulated cluster (needs root).

    sudo .venv/bin/python bench/control_straggler.py [--steps 40] [--json PATH]

Runs `gradlane.control_runs.run_control_straggler`: one VGG-19 trace job on 4
workers at speeds 1, 1, 1, 0.5 computing alone (the bound's measured compute,
batches proportional to speed), under PyTorch DDP, then gradlane without and
with `gradlane control` (then through its crash and a partition), in one
cluster. Writes both runs' iteration times, their medians (second
half of the steps), the ratio, and every rank's batch per step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cluster_args, record_cluster_run, unwind_on_signals  # noqa: E402

from gradlane.control_runs import run_control_straggler  # noqa: E402


def main() -> None:
    args = cluster_args(__doc__, "control_straggler", 40).parse_args()
    result = record_cluster_run("control_straggler", args.json, lambda workdir:
                                run_control_straggler(workdir, args.steps, say=print, ddp=True,
                                                      reference=True))
    print(f"median iteration {result['without_control']['median_s'] * 1000:.1f} ms without "
          f"the control plane, {result['with_control']['median_s'] * 1000:.1f} ms with it: "
          f"{result['speedup']:.2f}x (DDP {result['ddp']['median_s'] * 1000:.1f} ms: "
          f"{result['speedup_over_ddp']:.2f}x); final batches {[b[-1] for b in result['batches']]} "
          f"-> {args.json}")


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
