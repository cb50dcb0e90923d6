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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import owners_bench, unwind_on_signals  # noqa: E402

from gradlane.control_runs import run_slow_link  # noqa: E402

if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    owners_bench(__doc__, "slow_link", run_slow_link)
