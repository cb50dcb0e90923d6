"""Ranks sharing hosts on the emulated cluster: two hosts with gradlaned, two ranks on
each, every rank listening on an address of its own (as pods do). The shims learn their
host from their gradlaned's welcome, reduce each chunk within each host first and tell
their daemons so; each host's NIC then carries about one model each way per step, where
the ring would carry 1.5.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradlane.demo import collect, launch
from gradlane.policies.profiles import trace_spec
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import stop

pytestmark = pytest.mark.netns

STEPS = 12
PLACEMENT = ["h1", "h1", "h2", "h2"]
SECOND = 200  # each host's second rank listens on 10.200.0.(200 + host): its own address
WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "1", "--forward-ms", "10"]
# Run in h1: polls its gradlaned's /status every 0.1 s (up to argv[1] s) until a worker's
# exchange is said; prints it (nothing if none was).
PROBE = """
import json, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9464/status", timeout=2) as r:
            said = {w["exchange"] for j in json.load(r)["jobs"] for w in j["workers"]} - {None}
    except OSError:
        said = set()
    if said:
        print(*sorted(said))
        break
    time.sleep(0.1)
"""


@pytest.mark.timeout(180)
def test_ranks_sharing_hosts_reduce_within_them_first(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with Cluster(Topology.build("coh", 2, "200mbit")) as c:
        addresses = [c.addr(h) for h in PLACEMENT]
        for rank in (1, 3):
            host = int(PLACEMENT[rank][1:])
            addresses[rank] = c.topology.address(SECOND + host)
            subprocess.run(["ip", "-n", c.ns(PLACEMENT[rank]), "addr", "add",
                            f"{addresses[rank]}/24", "dev", "eth0"], check=True)
        daemons = {h: c.start_daemon(h, tmp_path) for h in ("h1", "h2")}
        sockets = {h: sock for h, (_, sock) in daemons.items()}
        probe = c.popen("h1", [sys.executable, "-c", PROBE, "90"], stdout=subprocess.PIPE,
                        text=True)
        job = launch(c, "gradlane", ["--steps", str(STEPS), *WORKLOAD], port=29840,
                     out=tmp_path, sockets=[sockets[h] for h in PLACEMENT], hosts=PLACEMENT,
                     rank_args=[["--address", a] for a in addresses])
        run = collect(c, job)
        seen = probe.communicate(timeout=100)[0].split()  # what h1's gradlaned was told
        assert [stop(proc) for proc, _ in daemons.values()] == [0, 0]  # qdiscs restored
    records = [json.loads((tmp_path / f"gradlane-rank{r}.json").read_text()) for r in range(4)]
    assert [(r["exchange"], r["leaves"], r["hosts"]) for r in records] == [
        ("host", None, [0, 0, 1, 1])] * 4
    assert seen == ["host"], seen
    # Each step, each host sends one copy of each chunk: its ranks' partial sum of the
    # chunks the other host owns, and the average of its own. The ring would send 1.5
    # models; what else crosses (rank 0's parameters once, the store, headers) is small.
    model = 4 * sum(n for n, _, _ in trace_spec("vgg19", 1.0, 0.010))
    per_host_step = run.wire_bytes / 2 / len(run.times)
    assert per_host_step < 1.3 * model, (per_host_step, model)
    print(f"each host sent {per_host_step / model:.2f} models per step")
