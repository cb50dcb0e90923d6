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

from common import owners_bench, unwind_on_signals  # noqa: E402

from gradlane.control_runs import run_co_located  # noqa: E402

if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    owners_bench(__doc__, "co_located", run_co_located)
