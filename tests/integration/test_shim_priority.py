"""Priority is real: the shim's bands through gradlaned's HTB leaves, in emulated hosts.

Two hosts at 100 Mbit/s, each with the real gradlaned; tests/shim_probe.py
runs one rank per host (forked with torch imported). Measured, not assumed: the completion order of
chunks made ready in backward order, and how long a small band-0 chunk takes
while a bulk band-3 transfer streams, against the same with one band (FIFO).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradlane.testbed import Cluster, Topology
from tests import shim_probe
from tests.integration.helpers import start_netns_daemon, stop

pytestmark = pytest.mark.netns
RATE = "100mbit"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[Path]]]:
    tmp = tmp_path_factory.mktemp("prio")
    with Cluster(Topology.build("tprio", 2, RATE)) as c:
        daemons = [start_netns_daemon(c, host, tmp, rate=RATE) for host in ("h1", "h2")]
        try:
            yield c, [sock for _, sock in daemons]
        finally:
            for proc, _ in daemons:
                assert stop(proc) == 0


def probe(cluster: Cluster, sockets: list[Path], bands: int, port: int,
          out: Path) -> dict[str, Any]:
    result = out / f"probe-{bands}.json"
    procs = [
        cluster.fork(host, shim_probe.main,
                     ["--rank", str(rank), "--master", f"{cluster.addr('h1')}:{port}",
                      "--address", cluster.addr(host), "--bands", str(bands),
                      "--socket", str(sockets[rank]), "--out", str(result)],
                     env=dict(os.environ), log=out / f"probe-{bands}-rank{rank}.log")
        for rank, host in enumerate(("h1", "h2"))
    ]
    for p in procs:
        assert p.wait(timeout=90) == 0, p.output()[-3000:]
    found: dict[str, Any] = json.loads(result.read_text())
    assert found["registered"], "the probe never registered with gradlaned"
    return found


def _ms(seconds: list[float]) -> list[float]:
    return [round(s * 1000, 1) for s in seconds]


@pytest.mark.timeout(240)
def test_chunks_complete_in_priority_order_and_band0_preempts_bulk(
    cluster: tuple[Cluster, list[Path]], tmp_path: Path,
) -> None:
    c, sockets = cluster
    banded = probe(c, sockets, 4, 29410, tmp_path)
    fifo = probe(c, sockets, 1, 29411, tmp_path)
    print(
        f"band-0 chunk during bulk (median of 3): {banded['high_latency_s'] * 1000:.1f} ms "
        f"with 4 bands, {fifo['high_latency_s'] * 1000:.1f} ms with one band "
        f"(each: {_ms(banded['high_latencies_s'])}, {_ms(fifo['high_latencies_s'])}); "
        f"order {banded['order']}"
    )
    assert banded["order"] == ["p0", "p1", "p2", "p3"]
    assert fifo["high_latency_s"] >= 3 * banded["high_latency_s"]
