"""Where a measurement was taken: commit, kernel, CPU, versions, date."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["environment", "start", "write_result"]

REPO = Path(__file__).resolve().parents[1]
# Per repository, its checkout when the measurement started (`start`), if it was noted.
_started: dict[Path, dict[str, Any]] = {}


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO).stdout.strip()


def _checkout() -> dict[str, Any]:
    return {
        "commit": _run("git", "rev-parse", "HEAD"),
        # results files being rewritten by this very run, and prose (*.md), do not count
        "dirty": bool(_run("git", "status", "--porcelain", "--", ".", ":!bench/results",
                           ":!*.md")),
    }


def start() -> None:
    """Note the checkout a measurement runs from, before it runs.

    Results are written when a run ends, and the checkout may have moved on
    during a long one (a commit, an edit): `environment` then records the
    commit the run started from, and says the checkout changed meanwhile.
    """
    _started[REPO] = _checkout()


def environment() -> dict[str, Any]:
    import pyroute2

    import gradlane

    try:  # the installed distribution's version: importing torch for it takes seconds
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line),
        platform.processor(),
    )
    checkout = now = _checkout()
    if _started.get(REPO, now) != now:
        checkout = {**_started[REPO], "checkout_changed_during_run": True}
    return {
        **checkout,
        "kernel": platform.release(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "gradlane": gradlane.__version__,
        "pyroute2": pyroute2.__version__,
        "torch": torch_version,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a result file (JSON) with the environment it was measured in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "environment": environment()}, indent=1) + "\n")
