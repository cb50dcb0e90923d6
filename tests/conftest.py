"""Shared fixtures: root gating for namespace tests and the end-of-run leak check;
SIGTERM or a hang-up ends a run as Ctrl-C does, cleaning up.

Hypothesis runs without its per-example deadline (200 ms by default): that
is a timing assertion, and on a shared, noisy machine it fails by chance.
`GRADLANE_EXAMPLES=N` multiplies every property test's example count
(`tests.examples`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import settings

from gradlane.signals import unwind_on_signals
from tests import examples

settings.register_profile("gradlane", deadline=None, max_examples=examples(100))
settings.load_profile("gradlane")

IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (a CI timeout, `kill`) or a hang-up stops the run as Ctrl-C does: the
    # running test's `with Cluster(...)` blocks and every fixture's teardown still run, so
    # no namespace, link or process is left behind.
    unwind_on_signals(KeyboardInterrupt)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A longer hunt (`GRADLANE_EXAMPLES=N`) draws N times the examples: its property tests
    # get N times their time limit too, or the per-test timeout (pyproject's, or the test's
    # own) would end the hunt, and hypothesis report the example it stopped in as flaky.
    factor = examples(1)
    if factor == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        if not getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            continue
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * factor), append=False)


def _can_use_namespaces() -> str | None:
    """None if namespace tests can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2) to check results independently"
    return None


@pytest.fixture(autouse=True)
def _netns_gate(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("netns") is None:
        return
    reason = _can_use_namespaces()
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI=true but this namespace test cannot run: {reason}")
    pytest.skip(reason)


def gl_objects() -> set[str]:
    """gl-* namespaces, and gl-* links in the root namespace."""
    found: set[str] = set()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return found
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found |= {line.split()[0] for line in names.splitlines() if line.startswith("gl-")}
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("gl-"):
            found.add(f"link {name}")
    return found


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the whole run, no gl- namespace or link may remain (beyond pre-existing ones)."""
    before = gl_objects()
    yield
    left = gl_objects() - before
    assert not left, f"the test run left these behind: {sorted(left)}"
