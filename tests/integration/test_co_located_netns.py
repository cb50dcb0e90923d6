"""Ranks sharing hosts on the emulated cluster: two hosts with gradlaned, two ranks on
each. The shims see which ranks listen on one address, reduce each chunk within each
host first and tell their daemons so; each host's NIC then carries about one model
each way per step, where the ring would carry 1.5.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gradlane.demo import collect, launch
from gradlane.policies.profiles import trace_spec
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import stop

pytestmark = pytest.mark.netns

STEPS = 12
PLACEMENT = ["h1", "h1", "h2", "h2"]
WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "1", "--forward-ms", "10"]


@pytest.mark.timeout(180)
def test_ranks_sharing_hosts_reduce_within_them_first(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    seen: set[str | None] = set()  # what h1's gradlaned says its workers' job does
    with Cluster(Topology.build("coh", 2, "200mbit")) as c:
        daemons = {h: c.start_daemon(h, tmp_path) for h in ("h1", "h2")}
        sockets = {h: sock for h, (_, sock) in daemons.items()}
        job = launch(c, "gradlane", ["--steps", str(STEPS), *WORKLOAD], port=29840,
                     out=tmp_path, sockets=[sockets[h] for h in PLACEMENT], hosts=PLACEMENT)
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p in job.procs) and time.monotonic() < deadline:
            out = c.run("h1", [sys.executable, "-m", "gradlane.cli", "status", "--json"],
                        check=False).stdout
            if out:
                seen |= {w["exchange"] for j in json.loads(out)["jobs"] for w in j["workers"]}
            time.sleep(0.5)
        run = collect(c, job)
        assert [stop(proc) for proc, _ in daemons.values()] == [0, 0]  # qdiscs restored
    records = [json.loads((tmp_path / f"gradlane-rank{r}.json").read_text()) for r in range(4)]
    assert [(r["exchange"], r["leaves"]) for r in records] == [("host", [0, 0, 1, 1])] * 4
    assert "host" in seen, seen
    # Each step, each host sends one copy of each chunk: its ranks' partial sum of the
    # chunks the other host owns, and the average of its own. The ring would send 1.5
    # models; what else crosses (rank 0's parameters once, the store, headers) is small.
    model = 4 * sum(n for n, _, _ in trace_spec("vgg19", 1.0, 0.010))
    per_host_step = run.wire_bytes / 2 / len(run.times)
    assert per_host_step < 1.3 * model, (per_host_step, model)
    print(f"each host sent {per_host_step / model:.2f} models per step")
