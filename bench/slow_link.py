"""Chunk owners weighed by link rate, on the emulated cluster (needs root).

    sudo .venv/bin/python bench/slow_link.py [--steps 60] [--json PATH]

Runs `gradlane.control_runs.run_slow_link`: one VGG-19 trace job on 4 hosts,
the last on a link half as fast; the workers compute alone (the bound's
measured compute), then gradlane runs without `gradlane control` (owned bytes
equal) and with it (the shims take the plan's owners, weighed by link rate),
in one cluster. Writes both runs' iteration times, their medians, the ratio,
the bytes each rank owned and the slowest link's modelled times.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cluster_args, record_cluster_run, unwind_on_sigterm  # noqa: E402

from gradlane.control_runs import run_slow_link  # noqa: E402


def main() -> None:
    args = cluster_args(__doc__, "slow_link", 60).parse_args()
    result = record_cluster_run("slow_link", args.json, lambda workdir: run_slow_link(
        workdir, args.steps, say=print, reference=True))
    print_summary(result, args.json)


def print_summary(result: dict[str, Any], path: Path) -> None:
    """One line: both runs' medians and owned bytes, the ratio and the bound."""
    without, with_control = result["without_control"], result["with_control"]
    print(f"median iteration {without['median_s'] * 1000:.1f} ms with owned bytes "
          f"{without['owned_bytes']}, {with_control['median_s'] * 1000:.1f} ms with the "
          f"plan's {with_control['owned_bytes']} (taken at step "
          f"{with_control['owners_taken_at'][0]}): {result['speedup']:.2f}x; bound "
          f"{result['lower_bound_s'] * 1000:.1f} ms -> {path}")


if __name__ == "__main__":
    unwind_on_sigterm()  # a SIGTERM removes this run's clusters, as Ctrl-C does
    main()
