"""The transport's room for its connections: the open-file limit."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from gradlane.shim.transport import _room_for


def test_the_soft_open_file_limit_is_raised_for_the_connections() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    if hard != resource.RLIM_INFINITY and hard < in_use + 400:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise the soft one")
    low = in_use + 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        _room_for(300, 0)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised >= in_use + 300, (low, raised)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hard_limit_without_room_is_named_with_the_way_out() -> None:
    # The hard limit cannot be raised again without privileges: in a process of its own.
    script = (
        "import os, resource\n"
        "from gradlane.errors import TransportError\n"
        "from gradlane.shim.transport import _room_for\n"
        "n = len(os.listdir('/proc/self/fd')) + 20\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
        "try:\n"
        "    _room_for(1196, 3)\n"
        "except TransportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "rank 3 needs 1196 connections" in out and "ulimit -n" in out, out
