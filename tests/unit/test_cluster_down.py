"""`Cluster.down` finishes its clean-up through repeated interruptions (no root needed).

`timeout(1)` and other supervisors forward a Ctrl-C to the process that already
got it; the second one used to land in the clean-up and leave namespaces behind.
"""

from __future__ import annotations

import pytest

import gradlane.testbed.cluster as cluster_module
from gradlane.testbed import Cluster, Topology


def test_down_rides_out_an_interruption_then_passes_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    removed: list[str] = []
    interruptions = [KeyboardInterrupt(), SystemExit(130)]  # Ctrl-C, then SIGTERM's exit

    def remove(name: str) -> list[str]:
        if interruptions:
            raise interruptions.pop(0)
        removed.append(name)
        return [name]

    monkeypatch.setattr(cluster_module, "remove_cluster", remove)
    c = Cluster(Topology.build("tdown", 2, "1gbit"))
    with pytest.raises(SystemExit):  # the last interruption goes on once all is removed
        c.down()
    assert removed == ["tdown"] and not interruptions


def test_down_gives_up_after_a_bounded_number_of_interruptions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def remove(name: str) -> list[str]:
        calls.append(name)
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster_module, "remove_cluster", remove)
    with pytest.raises(KeyboardInterrupt):
        Cluster(Topology.build("tdown", 2, "1gbit")).down()
    assert len(calls) == cluster_module.DOWN_ATTEMPTS
